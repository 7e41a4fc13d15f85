"""End-to-end Plain vs NB-TF (top-2) latency on text with sentences (paper App. C.5 protocol).

Per length: one RULER niah_single_2 document (essay prose with real sentences and a needle) of about
L tokens for the model's tokenizer. The input is TEXT and tokenisation happens inside the timing:
  plain     tokenizer(text) -> prefill (no capture) -> question -> `--gen` greedy tokens
  notebank  tokenizer(text) with sentence offsets -> prefill with native q/k capture and archive
            writing (rebuilt every run) -> probe the question from a state copy -> route (Eq. 5)
            -> replay 2 notes + question from another copy -> `--gen` greedy tokens
EOS and stop strings are disabled so both methods generate exactly `--gen` tokens. Methods are
alternated (plain first on even reps; `--interleave block`: the two runs stepped in alternation block
by block, each timed on its own steps), `--reps` timed runs each, medians reported, with the
median of each stage so the writer's share of the overhead is visible. Model loading is excluded;
one warm-up pair runs at the first length. The archive's bytes are reported beside Eq. 19.

    .venv/bin/python bench/overhead.py --model models/tiny-gdn-v5 --lengths 64K,256K --reps 3 \\
        --out bench/results/overhead-cpu.json
    # on a noisy host: the two methods stepped block by block (two such 31-pair runs agreed within a point)
    .venv/bin/python bench/overhead.py --lengths 64K,256K --reps 31 --threads 1 --interleave block \\
        --out bench/results/overhead-cpu-interleaved.json
    # --allocator default: glibc's malloc thresholds instead of the CPU workers' (pipeline/allocator.py)
    # + a random-init GDN-1.3B-shaped model (qwen3_5 GDN layers, fp32) at a small length:
    .venv/bin/python bench/overhead.py --model models/tiny-gdn-v5 --lengths 64K --gdn13b-lengths 1K
    # GPU: bench/gpu/lease.py (GDN-1.3B, Mamba-2 and hybrid shapes with their CUDA kernels)
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import machine, median, today, write_json  # noqa: E402
from nbcore import NoteBankConfig, ReadConfig, answer, ingest, load_backbone  # noqa: E402
from nbcore import cost  # noqa: E402
from nbcore.reader import ingest_steps  # noqa: E402
from nbcore.kernels import native  # noqa: E402

K = 1024
METHODS = ("plain", "notebank")

# GDN-1.3B (m-a-p/1.3B-100B-GatedDeltaNet-pure) shapes as a transformers qwen3_5 text config:
# hidden 2048, 24 GDN layers, 8 heads, d_k = d_v = 256, MLP 5632, vocab 32000, short conv 4.
GDN_1_3B_QWEN = dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=5632, vocab_size=32000,
                     linear_num_key_heads=8, linear_num_value_heads=8, linear_key_head_dim=256,
                     linear_value_head_dim=256, linear_conv_kernel_dim=4, num_attention_heads=8,
                     num_key_value_heads=8, head_dim=256, layer_types=["linear_attention"] * 24,
                     tie_word_embeddings=False)


def parse_len(s: str) -> int:
    s = s.strip().upper()
    if s.endswith("M"):
        return int(float(s[:-1]) * K * K)
    if s.endswith("K"):
        return int(float(s[:-1]) * K)
    if not s.isdigit():
        raise ValueError(f"bad length {s!r}: use e.g. 700, 16K or 1M")
    return int(s)


def make_text_input(bb, n_tokens: int, seed: int = 0) -> tuple[str, str]:
    """-> (context text with sentences, question) of about n_tokens tokens: RULER niah_single_2."""
    from nbcore.tasks import ruler
    if bb.tokenizer is None:
        raise ValueError("the text benchmark needs a backbone with a tokenizer")
    ex = ruler.generate("niah_single_2", n_tokens, 0, bb.tokenizer, seed=seed)
    return ex["context"], ex["question"]


def method_steps(bb, text: str, question: str, method: str, cfg: NoteBankConfig, gen: int, block: int,
                 out: dict):
    """One method's run from text as a generator of steps: tokenising (with sentence offsets for
    NoteBank), then one step per block (`ingest_steps`), the archive's finish, and the answer; fills
    `out` with its stage times and counts at the end. Driving it to the end is one run
    (`run_text`); two of them stepped in alternation is the interleaved mode."""
    rc = ReadConfig(method=method, top_r=2, max_new_tokens=gen, stop_at_eos=False)
    if method == "plain":
        t0 = time.perf_counter()
        ids = np.asarray(bb.tokenizer(text)["input_ids"], dtype=np.int64)
        t_tok = time.perf_counter() - t0
        steps = ingest_steps(bb, token_ids=ids, cfg=cfg, block_size=block, write=False)
    else:
        t_tok = None     # tokenised inside ingest_steps' first step (with sentence offsets)
        steps = ingest_steps(bb, text, cfg, block_size=block, write=True)
    t0 = time.perf_counter()
    next(steps)                                    # checked and tokenised
    t_first = time.perf_counter() - t0
    yield
    res = yield from steps                         # one step per block, then the archive's finish
    yield
    ans = answer(bb, res.state, res.archive, question, rc)
    pre, wr = res.timings["prefill_s"], res.timings["write_s"]
    out.update({
        "tokenize_s": t_tok if t_tok is not None else t_first,
        "prefill_s": pre, "write_s": wr, "probe_s": ans.timings["probe_s"], "route_s": ans.timings["route_s"],
        "replay_generate_s": ans.timings["replay_generate_s"], "n_tokens": res.n_tokens,
        "n_notes": len(res.archive), "archived_tokens": int(sum(len(t) for t in res.archive.token_ids)),
        "archive_bytes": archive_nbytes(res.archive), "channels": bb.n_channels,
        "addr_dim": cfg.addr_dim, "answer": ans.text})


class _Clock:
    """Wall, process-CPU and kernel time, and minor page faults, summed over the steps it times."""

    def __init__(self):
        self.total_s = self.cpu_s = self.sys_s = 0.0
        self.minor_faults = 0

    def step(self, steps) -> bool:
        """Time one next(steps); -> False once the generator is done."""
        ru0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
        try:
            next(steps)
            more = True
        except StopIteration:
            more = False
        self.total_s += time.perf_counter() - t0
        self.cpu_s += time.process_time() - c0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        # kernel time and minor page faults: big temporaries that glibc maps and unmaps per call
        # are re-faulted every time (README, "Speed"); this shows how much of a run it was
        self.sys_s += ru1.ru_stime - ru0.ru_stime
        self.minor_faults += ru1.ru_minflt - ru0.ru_minflt
        return more

    def result(self, out: dict) -> dict:
        return dict(out, total_s=self.total_s, cpu_s=self.cpu_s, sys_s=self.sys_s, minor_faults=self.minor_faults)


def run_text(bb, text: str, question: str, method: str, cfg: NoteBankConfig, gen: int, block: int) -> dict:
    """One timed run from text -> stage times (s) and counts."""
    out, clock = {}, _Clock()
    steps = method_steps(bb, text, question, method, cfg, gen, block, out)
    while clock.step(steps):
        pass
    return clock.result(out)


def run_interleaved(bb, text: str, question: str, cfg: NoteBankConfig, gen: int, block: int,
                    first: int = 0) -> dict[str, dict]:
    """Both methods' runs stepped in alternation on one core: tokenising, each block, the finish and
    the answer of one, then the same step of the other (which goes first alternates, starting with
    METHODS[first]). Each method's time is the sum of its own steps, so a slow phase of a noisy
    host (seconds long on the 2-core VM) falls on both methods instead of on one run."""
    outs = {m: {} for m in METHODS}
    clocks = {m: _Clock() for m in METHODS}
    steps = {m: method_steps(bb, text, question, m, cfg, gen, block, outs[m]) for m in METHODS}
    k = first
    while steps:
        for m in (METHODS if k % 2 == 0 else METHODS[::-1]):
            if m in steps and not clocks[m].step(steps[m]):
                del steps[m]
        k += 1
    return {m: clocks[m].result(outs[m]) for m in METHODS}


def archive_nbytes(archive) -> int:
    """Bytes of the archive's arrays as Eq. 19 counts them: BF16 addresses, int32 note token ids and
    three int64 span fields (start, end, chunk) per note."""
    n = len(archive)
    return int(archive.addresses.numel() * 2 + 4 * sum(len(t) for t in archive.token_ids) + 24 * n)


def run_ids(bb, ids, question, method: str, cfg: NoteBankConfig, gen: int, block: int):
    """Token-ids input (random-id GPU shapes: no text to tokenise)."""
    rc = ReadConfig(method=method, top_r=2, max_new_tokens=gen, stop_at_eos=False)
    res = ingest(bb, token_ids=ids, cfg=cfg, block_size=block, write=(method == "notebank"))
    return answer(bb, res.state, res.archive, question, rc)


run_once = run_ids       # the name bench/gpu scripts import


STAGES = ("total_s", "tokenize_s", "prefill_s", "write_s", "probe_s", "route_s", "replay_generate_s", "sys_s",
          "minor_faults")


def ratio_interval(plain: list[float], nb: list[float], n_boot: int = 2000, seed: int = 0) -> list[float]:
    """Bootstrap 95% interval of median(nb) / median(plain), resampling the rep pairs (fixed seed:
    the same runs give the same interval). How far the ratio can be trusted on a noisy machine."""
    import random
    rng = random.Random(seed)
    k = len(plain)
    if k < 2:
        return [round(median(nb) / median(plain), 4)] * 2
    bs = []
    for _ in range(n_boot):
        idx = [rng.randrange(k) for _ in range(k)]
        bs.append(median([nb[i] for i in idx]) / median([plain[i] for i in idx]))
    bs.sort()
    return [round(bs[int(0.025 * n_boot)], 4), round(bs[int(0.975 * n_boot) - 1], 4)]


def summarise(name: str, runs: dict[str, list[dict]]) -> dict:
    med = {m: {s: median([r[s] for r in runs[m]]) for s in STAGES} for m in METHODS}
    p, n = med["plain"]["total_s"], med["notebank"]["total_s"]
    nb0 = runs["notebank"][0]
    over = n - p
    parts = {  # where NoteBank's extra time goes (medians of stages; they need not add up exactly)
        "tokenize_sentences_s": med["notebank"]["tokenize_s"] - med["plain"]["tokenize_s"],
        "capture_in_prefill_s": med["notebank"]["prefill_s"] - med["plain"]["prefill_s"],
        "writer_s": med["notebank"]["write_s"],
        "probe_route_s": med["notebank"]["probe_s"] + med["notebank"]["route_s"],
        "replay_extra_s": med["notebank"]["replay_generate_s"] - med["plain"]["replay_generate_s"],
    }
    eq19 = cost.archive_bytes(nb0["n_notes"], nb0["archived_tokens"], channels=nb0["channels"],
                              addr_dim=nb0["addr_dim"])
    return {
        "tokens": nb0["n_tokens"], "plain_s": round(p, 3), "nb_s": round(n, 3), "ratio": round(n / p, 4),
        "overhead_pct": round(100 * (n / p - 1), 2),
        # how noisy the machine was: each rep's pair (run back to back), the spread of Plain's runs,
        # and the same ratio in process CPU time (less sensitive to other tenants' load)
        "pair_ratios": [round(b["total_s"] / a["total_s"], 4) for a, b in zip(runs["plain"], runs["notebank"])],
        "pair_ratio_median": round(median([b["total_s"] / a["total_s"] for a, b in zip(runs["plain"], runs["notebank"])]), 4),
        "ratio_ci95": ratio_interval([r["total_s"] for r in runs["plain"]], [r["total_s"] for r in runs["notebank"]]),
        "plain_spread_pct": round(100 * (max(r["total_s"] for r in runs["plain"])
                                         - min(r["total_s"] for r in runs["plain"])) / p, 1),
        "cpu_ratio": round(median([r["cpu_s"] for r in runs["notebank"]])
                           / median([r["cpu_s"] for r in runs["plain"]]), 4),
        "plain_runs_s": [round(r["total_s"], 3) for r in runs["plain"]],
        "nb_runs_s": [round(r["total_s"], 3) for r in runs["notebank"]],
        "stages_median_s": {m: {s: round(v, 4) for s, v in med[m].items()} for m in METHODS},
        "overhead_parts_s": {k: round(v, 4) for k, v in parts.items()},
        # the writer's share: capture inside the forward + span selection/addressing, of NB's total
        "writer_share_pct": round(100 * (parts["capture_in_prefill_s"] + parts["writer_s"]) / n, 2),
        "archive": {"notes": nb0["n_notes"], "archived_tokens": nb0["archived_tokens"],
                    "bytes_measured": nb0["archive_bytes"], "bytes_eq19": int(eq19)},
        "answers": {"plain": runs["plain"][0]["answer"], "notebank": runs["notebank"][0]["answer"]},
    }


# The product's ingest block (configs/ingest.yaml, pipeline defaults). On CPU it is also the fast
# one: a 64K block's activations are >= 32 MiB each, which glibc maps and unmaps on every call, so
# every forward re-faults them (~5 million minor faults and ~8 s of kernel time per 256K tokens on
# the 2-core VM); 8K blocks' temporaries are reused from the heap (0 faults).
DEFAULT_BLOCK = 8192


INTERLEAVE = ("run", "block")


def bench(bb, lengths, cfg, gen=32, reps=3, block=DEFAULT_BLOCK, log=print, warm=True, interleave="run"):
    """interleave="run": whole runs alternated (plain first on even reps); "block": the two methods'
    runs stepped in alternation block by block (`run_interleaved`, who goes first alternating by rep)."""
    if interleave not in INTERLEAVE:
        raise ValueError(f"interleave must be one of {INTERLEAVE}, got {interleave!r}")
    out = {}
    for name in lengths:
        text, question = make_text_input(bb, parse_len(name))
        if warm:
            for m in METHODS:
                run_text(bb, text, question, m, cfg, gen, block)
            warm = False
        runs = {m: [] for m in METHODS}
        for r in range(reps):
            if interleave == "block":
                pair = run_interleaved(bb, text, question, cfg, gen, block, first=r % 2)
                for m in METHODS:
                    runs[m].append(pair[m])
                continue
            for m in (METHODS if r % 2 == 0 else METHODS[::-1]):
                runs[m].append(run_text(bb, text, question, m, cfg, gen, block))
        out[name] = row = summarise(name, runs)
        row["interleave"] = interleave
        log(f"{name:>5} ({row['tokens']} tok): plain {row['plain_s']:.2f}s  nb {row['nb_s']:.2f}s  "
            f"ratio {row['ratio']:.4f} (95% {row['ratio_ci95'][0]:.3f}-{row['ratio_ci95'][1]:.3f}, median pair "
            f"{row['pair_ratio_median']:.4f}, cpu {row['cpu_ratio']:.4f}, plain spread {row['plain_spread_pct']}%)  writer share {row['writer_share_pct']:.1f}%  "
            f"sys {row['stages_median_s']['plain']['sys_s']:.2f}/{row['stages_median_s']['notebank']['sys_s']:.2f}s  "
            f"archive {row['archive']['bytes_measured']} B (Eq. 19: {row['archive']['bytes_eq19']} B)")
    return out


def gdn13b_backbone(tokenizer_from: str):
    """Random-init GDN-1.3B-shaped qwen3_5 model (fp32, CPU), with the shipped model's tokenizer
    (its ids are a subset of the 32000-token vocabulary)."""
    from transformers import AutoConfig
    from nbcore.backbones.loading import build_tokenizer
    cfg = AutoConfig.for_model("qwen3_5_text", **GDN_1_3B_QWEN)
    return load_backbone(cfg, tokenizer=build_tokenizer(tokenizer_from))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="models/tiny-gdn-v5", help="checkpoint directory (default: %(default)s)")
    ap.add_argument("--lengths", default="64K,256K", help="comma list, e.g. 16K,64K,256K,1M (default: %(default)s)")
    ap.add_argument("--gdn13b-lengths", default="", help="also time a random-init GDN-1.3B-shaped model at these "
                    "lengths (small: ~1 min per run per 1K tokens on 2 cores)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per method (median; default %(default)s)")
    ap.add_argument("--gen", type=int, default=32, help="generated tokens per answer (default %(default)s)")
    ap.add_argument("--block", type=int, default=DEFAULT_BLOCK, help="tokens per backbone call, both methods "
                    "(default: the ingest default, %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--allocator", choices=("tuned", "default"), default="tuned",
                    help="glibc malloc thresholds: 'tuned' = what the pipeline's CPU workers set at start "
                         "(pipeline/allocator.py), 'default' = glibc's own (default: %(default)s)")
    ap.add_argument("--interleave", choices=INTERLEAVE, default="run",
                    help="'run': whole runs of the two methods alternated; 'block': the two runs stepped in "
                         "alternation block by block, each timed on its own steps, so that a noisy host's slow "
                         "phases fall on both methods (default: %(default)s)")
    ap.add_argument("--route", action="store_true", help="also run the routing benchmark")
    ap.add_argument("--out", default="", help="JSON result file")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    lengths = [x for x in args.lengths.split(",") if x]
    big = [x for x in args.gdn13b_lengths.split(",") if x]
    for x in lengths + big:
        parse_len(x)
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        ap.error(f"--model {args.model!r} is not a checkpoint directory (no config.json)")
    if args.threads:
        torch.set_num_threads(args.threads)
    # before any big allocation, as the CPU workers do (a MALLOC_* variable of the user's wins)
    allocator = "glibc default"
    if args.allocator == "tuned":
        from notebank.pipeline.allocator import tune_cpu_malloc
        if tune_cpu_malloc():
            allocator = "tuned (pipeline/allocator.py: the CPU workers' mallopt thresholds)"
    if any(k.startswith("MALLOC_") for k in os.environ):
        allocator = "MALLOC_* environment (malloc_env)"
    bb = load_backbone(args.model)
    cfg = NoteBankConfig()
    command = "python bench/overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = {"machine": machine(), "date": today(), "model": args.model, "input": "text",
           "notebank": cfg.to_dict(),
           "protocol": f"RULER niah_single_2 text tokenised inside the timing; median of {args.reps}, "
                       + ("methods alternated run by run" if args.interleave == "run" else
                          "the two methods' runs stepped in alternation block by block (tokenising, each "
                          "block, finish, answer), each timed on its own steps")
                       + f", {args.gen} generated tokens, top-2, archive rebuilt each run, block {args.block}",
           "interleave": args.interleave,
           "command": command,
           # glibc's allocator tunables change the noise a lot on a VM (README, "Speed")
           "malloc_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")},
           "allocator": allocator,
           # NoteBank's CPU feature capture: the C kernel (a compiler was found) or its torch reference
           "capture_kernel": "native" if native.available() else "torch",
           "lengths": {}}

    def save(partial: bool):
        if args.out:
            write_json(args.out, dict(doc, partial=partial))

    for name in lengths:      # one length at a time: partial results survive an interrupted run
        doc["lengths"].update(bench(bb, [name], cfg, args.gen, args.reps, args.block, warm=not doc["lengths"],
                                    interleave=args.interleave))
        save(True)
    if big:
        bb13 = gdn13b_backbone(args.model)
        doc["gdn_1_3b_random"] = {"model": "random-init GDN-1.3B-shaped qwen3_5 (24 GDN layers, hidden 2048, "
                                           "8 heads x 256, fp32, CPU)", "channels": bb13.n_channels,
                                  "lengths": bench(bb13, big, cfg, args.gen, args.reps, args.block,
                                                   interleave=args.interleave)}
        save(True)
    if args.route:
        from bench.route_bench import bench_route
        r = bench_route([512, 1024, 2048, 4096, 8192, 16384, 32768, 65536])
        doc["route_ms"] = {k: v["warm_ms"] for k, v in r.items()}        # keys normalised once per archive
        doc["route_ms_cold"] = {k: v["cold_ms"] for k, v in r.items()}
    save(False)
    return doc


if __name__ == "__main__":
    main()
