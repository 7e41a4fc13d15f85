"""End-to-end Plain vs NB-TF (top-2) latency at growing context lengths (paper App. C.5 protocol).

Per length: one input (RULER niah_single_2 example 0 when the project's generators and a shipped
model exist, else a generated needle text with the byte tokenizer), methods alternated, `--reps`
timed runs each, median reported. Timing covers context processing (plain prefill vs NoteBank
ingest with archive writing — the archive is rebuilt every run), question probing, routing,
replay and exactly `--gen` generated tokens (EOS and stop strings disabled). Model loading and
the initial tokenisation are excluded. One warm-up pair runs at the first length only.

    .venv/bin/python bench/overhead.py --lengths 16K,64K,256K,1M --out bench/results/overhead-cpu.json
    # GPU: bench/gpu/overhead_gpu.py (GDN-1.3B shapes with fla kernels)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from bench.common import machine, median, timed, today, write_json  # noqa: E402
from nbcore import NoteBankConfig, ReadConfig, answer, ingest, load_backbone  # noqa: E402
from nbcore.reader import encode_context  # noqa: E402

K = 1024


def parse_len(s: str) -> int:
    s = s.strip().upper()
    if s.endswith("M"):
        return int(float(s[:-1]) * K * K)
    if s.endswith("K"):
        return int(float(s[:-1]) * K)
    return int(s)


def make_input(bb, n_tokens: int, seed: int = 0):
    """-> (context ids [T], question str). Uses RULER niah_single_2 when available."""
    try:
        from nbcore.tasks import ruler
        if bb.tokenizer is not None and getattr(bb, "_ruler_ok", True):
            ex = ruler.generate("niah_single_2", n_tokens, 0, bb.tokenizer, seed=seed)
            ids, _ = encode_context(bb, ex["context"])
            return ids, ex["question"]
    except Exception:  # noqa: BLE001 - generators not present: fall back to a needle text
        pass
    from nbcore.testing import needle_text
    text, needles = needle_text(n_tokens, 4, seed=seed)
    ids, _ = encode_context(bb, text)
    return ids[:n_tokens], f"What is the special magic number for {needles[0][0]}?"


def run_once(bb, ids, question, method: str, cfg: NoteBankConfig, gen: int, block: int):
    rc = ReadConfig(method=method, top_r=2, max_new_tokens=gen, stop_at_eos=False)
    res = ingest(bb, token_ids=ids, cfg=cfg, block_size=block, write=(method == "notebank"))
    return answer(bb, res.state, res.archive, question, rc)


def bench(bb, lengths, cfg, gen=32, reps=3, block=65536, log=print):
    out = {}
    warmed = False
    for name in lengths:
        T = parse_len(name)
        ids, question = make_input(bb, T)
        if not warmed:
            for m in ("plain", "notebank"):
                run_once(bb, ids, question, m, cfg, gen, block)
            warmed = True
        times = {"plain": [], "notebank": []}
        for r in range(reps):
            order = ("plain", "notebank") if r % 2 == 0 else ("notebank", "plain")
            for m in order:
                dt, ans = timed(run_once, bb, ids, question, m, cfg, gen, block)
                times[m].append(dt)
        p, n = median(times["plain"]), median(times["notebank"])
        out[name] = {"tokens": int(len(ids)), "plain_s": round(p, 3), "nb_s": round(n, 3),
                     "ratio": round(n / p, 4), "overhead_pct": round(100 * (n / p - 1), 2),
                     "plain_runs_s": [round(x, 3) for x in times["plain"]],
                     "nb_runs_s": [round(x, 3) for x in times["notebank"]]}
        log(f"{name:>5} ({len(ids)} tok): plain {p:.2f}s  nb {n:.2f}s  ratio {n / p:.4f}")
    return out


def load_default_backbone(path: str | None):
    if path and os.path.isdir(path):
        return load_backbone(path), path
    from nbcore.testing import byte_tokenizer, tiny_gdn_config
    cfg = tiny_gdn_config(layers=4, hidden=128, key_heads=4, value_heads=4, head_dim=32)
    return load_backbone(cfg, tokenizer=byte_tokenizer()), "random-init tiny GDN (4 layers, hidden 128, J=16)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/tiny-gdn")
    ap.add_argument("--lengths", default="16K,64K,256K,1M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--block", type=int, default=65536, help="tokens per backbone call (both methods)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--route", action="store_true", help="also run the routing benchmark")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bb, model_name = load_default_backbone(args.model)
    cfg = NoteBankConfig()
    doc = {"machine": machine(), "date": today(), "model": model_name, "notebank": cfg.to_dict(),
           "protocol": f"median of {args.reps}, alternating order, {args.gen} generated tokens, top-2, "
                       f"archive rebuilt each run, block {args.block}",
           "lengths": bench(bb, [x for x in args.lengths.split(",") if x], cfg, args.gen, args.reps, args.block)}
    if args.route:
        from bench.route_bench import bench_route
        r = bench_route([512, 1024, 2048, 4096, 8192, 16384, 32768, 65536])
        doc["route_ms"] = {k: v["warm_ms"] for k, v in r.items()}        # keys normalised once per archive
        doc["route_ms_cold"] = {k: v["cold_ms"] for k, v in r.items()}
    doc["command"] = "python bench/overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.out:
        write_json(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
