"""Routing alone (probe excluded): native channel voting (Eq. 5) for J channels, d_rho=16,
|Q| question tokens and N notes, as N grows. Reports medians of `--reps` runs (ms), warm
(archive keys normalised once, as the query stage does) and cold (normalisation included), for the
tiled kernel (channel_scores) and, in the same run and interleaved with it, the previous whole-channel
kernel (channel_scores_naive) as the baseline: naive_warm_ms and speedup = naive_warm_ms / warm_ms.

    .venv/bin/python bench/route_bench.py --out bench/results/route-cpu.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from bench.common import machine, median, today, write_json  # noqa: E402
from nbcore.notebank.route import (bf16_prefilter_available, channel_scores_naive, native_votes,  # noqa: E402
                                   normalized_keys)


def bench_route(n_notes: list[int], J=192, d=16, Q=64, reps=5, seed=0, baseline: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for N in n_notes:
        u = torch.randn(Q, J, d, generator=g).to(torch.bfloat16)
        a = torch.randn(N, J, d, generator=g).to(torch.bfloat16)
        keys = normalized_keys(a)
        v = native_votes(u, keys=keys)                   # warm-up
        if baseline and not torch.equal(v, native_votes(u, keys=keys, scorer=channel_scores_naive)):
            print(f"N={N}: tiled and old kernels disagree (a near-tie within rounding?)", flush=True)
        warm, cold, naive = [], [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            native_votes(u, keys=keys)
            warm.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            native_votes(u, a)
            cold.append(time.perf_counter() - t0)
            if baseline:
                t0 = time.perf_counter()
                native_votes(u, keys=keys, scorer=channel_scores_naive)
                naive.append(time.perf_counter() - t0)
        r = out[str(N)] = {"warm_ms": round(1e3 * median(warm), 3), "cold_ms": round(1e3 * median(cold), 3)}
        line = f"N={N:>6}: warm {r['warm_ms']:.2f} ms, cold {r['cold_ms']:.2f} ms"
        if baseline:
            r["naive_warm_ms"] = round(1e3 * median(naive), 3)
            r["speedup"] = round(r["naive_warm_ms"] / max(r["warm_ms"], 1e-9), 2)
            line += f", naive (old) warm {r['naive_warm_ms']:.2f} ms, speedup x{r['speedup']:.2f}"
        print(line, flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notes", default="512,1024,2048,4096,8192,16384,32768,65536")
    ap.add_argument("--channels", type=int, default=192)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-baseline", action="store_true", help="skip the old-kernel timing")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    res = bench_route([int(x) for x in args.notes.split(",")], J=args.channels, Q=args.question_tokens, reps=args.reps,
                      baseline=not args.no_baseline)
    doc = {"machine": machine(), "date": today(), "J": args.channels, "d_rho": 16, "Q": args.question_tokens,
           "threads": torch.get_num_threads(),
           "kernel": ("channel_winners: BF16 prefilter + FP32 rescoring (N >= ~700), else tiled channel_scores"
                      if bf16_prefilter_available() else "tiled channel_scores (FP32)"),
           "baseline": "channel_scores_naive (previous kernel)",
           "route_ms": res, "command": "python bench/route_bench.py " + " ".join(argv or sys.argv[1:])}
    if args.out:
        write_json(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
