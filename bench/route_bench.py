"""Routing alone (probe excluded): native channel voting (Eq. 5) for J channels, d_rho=16,
|Q| question tokens and N notes, as N grows. Reports medians of `--reps` runs (ms), warm
(archive keys normalised once, as the query stage does) and cold (normalisation included).

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
from nbcore.notebank.route import native_votes, normalized_keys  # noqa: E402


def bench_route(n_notes: list[int], J=192, d=16, Q=64, reps=5, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for N in n_notes:
        u = torch.randn(Q, J, d, generator=g).to(torch.bfloat16)
        a = torch.randn(N, J, d, generator=g).to(torch.bfloat16)
        keys = normalized_keys(a)
        native_votes(u, keys=keys)                       # warm-up
        warm, cold = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            native_votes(u, keys=keys)
            warm.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            native_votes(u, a)
            cold.append(time.perf_counter() - t0)
        out[str(N)] = {"warm_ms": round(1e3 * median(warm), 3), "cold_ms": round(1e3 * median(cold), 3)}
        print(f"N={N:>6}: warm {out[str(N)]['warm_ms']:.2f} ms, cold {out[str(N)]['cold_ms']:.2f} ms", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notes", default="512,1024,2048,4096,8192,16384,32768,65536")
    ap.add_argument("--channels", type=int, default=192)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    res = bench_route([int(x) for x in args.notes.split(",")], J=args.channels, Q=args.question_tokens, reps=args.reps)
    doc = {"machine": machine(), "date": today(), "J": args.channels, "d_rho": 16, "Q": args.question_tokens,
           "route_ms": res, "command": "python bench/route_bench.py " + " ".join(argv or sys.argv[1:])}
    if args.out:
        write_json(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
