"""CPU prefill throughput: transformers' pure-torch fallback kernels vs nbcore.kernels' fast path.

    .venv/bin/python bench/prefill_cpu.py --model models/tiny-gdn-v5 --lengths 16K,64K --reps 3 \
        --threads 1 --out bench/results/prefill-cpu.json

Per length: one real-text input (the shipped prose corpus, nbcore.tasks.haystack, tokenised by the
model's tokenizer, first T tokens), read from a fresh state by `backbone.forward` in blocks of
`--block` tokens (plain prefill: no NoteBank writing, logits of the last token only; the default
64K block reads a 64K document in one call, as bench/overhead.py does). At the largest length it is
also measured with `--also-block` tokens per call (default 8K: `nbcore.reader.ingest`'s default
block_size, what an ingest does), reported under `ingest_block`. The two methods alternate within
each repetition (fallback first on even reps, fast first on odd ones), `--reps` timed runs each,
medians reported (wall time; process CPU time too); one untimed warm-up pair runs first on a
short input. Outputs are checked: the final logits and every cached state tensor (conv,
recurrent, KV) of the fast run against the fallback run, max |diff| <= 1e-4 x max(1, max
|fallback|) (the tolerance of tests/test_cpu_kernels.py). `speedup` = fast tokens/s over fallback
tokens/s at the largest length with `--block`. The machine's load average is recorded before and
after (other jobs on a shared machine slow both methods, and add noise to the ratio).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from bench.common import machine, median, timed, today, write_json  # noqa: E402
from bench.overhead import parse_len  # noqa: E402
from nbcore import kernels, load_backbone  # noqa: E402

K = 1024
TOL = 1e-4
METHODS = ("fallback", "fast")


def prose_ids(bb, n_tokens: int) -> torch.Tensor:
    """The first n_tokens tokens of the shipped prose corpus (cycled as needed)."""
    from nbcore.tasks.haystack import essay_slice
    if bb.tokenizer is None:
        raise ValueError("the benchmark needs a backbone with a tokenizer")
    n_words = max(16, n_tokens)
    while True:
        ids = bb.tokenizer(essay_slice(n_words), add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            return torch.tensor(ids[:n_tokens], dtype=torch.long)
        n_words *= 2


def prefill(bb, ids: torch.Tensor, method: str, block: int):
    """Plain prefill of ids from a fresh state -> (last logits, state tensors)."""
    with kernels.use_fast_kernels(method == "fast"):
        s = bb.new_state()
        logits = None
        for a in range(0, len(ids), block):
            b = min(len(ids), a + block)
            logits = bb.forward(s, ids[a:b], need_logits=b == len(ids))
    return logits, bb.state_to_tensors(s)


def diffs(fast, ref) -> dict:
    (lf, sf), (lr, sr) = fast, ref
    out = {"max_abs_diff_logits": float((lf - lr).abs().max()),
           "max_rel_diff_logits": float((lf - lr).abs().max() / max(1.0, float(lr.abs().max())))}
    abs_s, rel_s = 0.0, 0.0
    for k in sr:
        d = float((sf[k].float() - sr[k].float()).abs().max()) if sr[k].numel() else 0.0
        abs_s = max(abs_s, d)
        rel_s = max(rel_s, d / max(1.0, float(sr[k].float().abs().max())))
    out.update(max_abs_diff_state=abs_s, max_rel_diff_state=rel_s,
               within_tolerance=bool(out["max_rel_diff_logits"] <= TOL and rel_s <= TOL))
    return out


def warm_up(bb, block: int) -> None:
    warm = prose_ids(bb, 512)
    for m in METHODS:
        prefill(bb, warm, m, block)


def bench(bb, lengths: list[str], reps: int, block: int, log=print) -> dict:
    """-> {length name: row} for plain prefill in blocks of `block` tokens, methods alternated."""
    rows = {}
    for name in lengths:
        T = parse_len(name)
        ids = prose_ids(bb, T)
        times = {m: [] for m in METHODS}
        outs = {}
        cpu = {m: [] for m in METHODS}
        outs = {}
        for rep in range(reps):
            for m in (METHODS if rep % 2 == 0 else METHODS[::-1]):
                c0 = time.process_time()
                t, out = timed(prefill, bb, ids, m, block)
                cpu[m].append(time.process_time() - c0)
                times[m].append(t)
                outs.setdefault(m, out)
                log(f"{name} rep {rep} {m}: {t:.2f} s wall, {cpu[m][-1]:.2f} s cpu ({T / t:,.0f} tok/s)")
        med = {m: median(times[m]) for m in METHODS}
        row = {"tokens": T,
               **{f"{m}_s": [round(t, 3) for t in times[m]] for m in METHODS},
               **{f"{m}_median_s": round(med[m], 3) for m in METHODS},
               **{f"{m}_tok_s": round(T / med[m], 1) for m in METHODS},
               "speedup": round(med["fallback"] / med["fast"], 3),
               # process CPU time: less sensitive to other jobs on a shared machine than wall time
               **{f"{m}_cpu_s": [round(t, 3) for t in cpu[m]] for m in METHODS},
               "speedup_cpu_time": round(median(cpu["fallback"]) / median(cpu["fast"]), 3),
               **diffs(outs["fast"], outs["fallback"])}
        log(f"{name}: fallback {row['fallback_tok_s']:,.0f} tok/s, fast {row['fast_tok_s']:,.0f} tok/s, "
            f"speedup {row['speedup']:.2f}x (cpu time {row['speedup_cpu_time']:.2f}x), max rel diff logits {row['max_rel_diff_logits']:.2g} "
            f"state {row['max_rel_diff_state']:.2g}")
        rows[name] = {"block": block, **row}
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-gdn-v5", help="checkpoint dir (GDN or Mamba-2)")
    ap.add_argument("--lengths", default="64K", help="comma-separated token counts, e.g. 16K,64K")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per method and length (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--block", default="64K", help="tokens per forward call (64K: a 64K document in one call)")
    ap.add_argument("--also-block", default="8K",
                    help="second block size measured at the largest length (8K: the ingest default); 0 = skip")
    ap.add_argument("--out", default=None, help="JSON result path (default: print only)")
    a = ap.parse_args(argv)
    lengths = [s.strip() for s in a.lengths.split(",") if s.strip()]
    if a.reps < 1 or a.threads < 1 or not lengths:
        ap.error("--reps and --threads must be >= 1 and --lengths non-empty")
    for s in lengths + [a.block, a.also_block]:
        try:
            parse_len(s)
        except ValueError:
            ap.error(f"bad length {s!r}")
    if parse_len(a.block) < 1 or min(map(parse_len, lengths)) < 1:
        ap.error("--block and --lengths must be positive")
    torch.set_num_threads(a.threads)
    bb = load_backbone(a.model)
    load_before = os.getloadavg()
    warm_up(bb, parse_len(a.block))
    rows = bench(bb, lengths, a.reps, parse_len(a.block))
    largest = max(lengths, key=parse_len)
    also = parse_len(a.also_block)
    extra = bench(bb, [largest], a.reps, also)[largest] if also > 0 and also != parse_len(a.block) else None
    doc = {
        "benchmark": "prefill-cpu: transformers fallback kernels vs nbcore.kernels fast path",
        "date": today(), "machine": machine(), "threads": a.threads,
        "command": " ".join(["python", "bench/prefill_cpu.py", *(argv if argv is not None else sys.argv[1:])]),
        "model": a.model, "model_type": bb.model.config.model_type, "block": parse_len(a.block), "reps": a.reps,
        "input": "shipped prose corpus (nbcore.tasks.haystack), first T tokens",
        "tolerance": f"max |fast - fallback| <= {TOL:g} x max(1, max |fallback|), final logits and every state tensor",
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "speedup": rows[largest]["speedup"], "speedup_at": largest,
        "within_tolerance": all(r["within_tolerance"] for r in rows.values()) and (extra is None or extra["within_tolerance"]),
        "lengths": rows,
        "ingest_block": extra,
    }
    if a.out:
        write_json(a.out, doc)
    return doc


if __name__ == "__main__":
    main()
