"""One prepared script for a GPU lease (fits 8 minutes including warm-up on one H200).

Order (each stage isolated: an error is recorded and the next stage still runs; a stage that
would not fit in what is left of `--budget-s` is skipped and says so):
  1. correctness: `gpu_checks.py` — fla GDN chunked == one pass, a copied state is independent,
     archives independent of the block size and bit-deterministic; the shipped tiny GDN's CUDA
     archives and answers == CPU's on the same weights.
  2. Plain vs NB-TF top-2 at 64K / 256K / 1M for GDN-1.3B shapes (fla kernels): the cost bar
     (NB/Plain <= 1.05 at 1M).
  3. Mamba-2-1.3B shapes and a Qwen3.5-style hybrid (transformers, with mamba-ssm / fla kernels
     where they install) at 64K / 256K.
Everything goes to $OUT/lease.json (rewritten after every stage, so an interrupted lease keeps
what finished); copy it to bench/results/ with the date and machine.

On the device machine (no internet; fla is carried as wheels, see bench/gpu/README.md):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python3 bench/gpu/lease.py --out $OUT/lease.json

CPU smoke form (CI runs it through tests/test_bench_scripts.py):

    .venv/bin/python bench/gpu/lease.py --smoke --out /tmp/lease.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import machine, today, write_json  # noqa: E402

# (stage name, argv of overhead_gpu.py, seconds it needs on a warm H200 incl. autotuning — from
# the 2026-11-29 lease: GDN-1.3B 1M Plain 8.5 s / NB 15.7 s; first-use Triton tuning ~1-2 min)
GPU_STAGES = (
    ("overhead_gdn13b", ["--shape", "gdn13b", "--lengths", "64K,256K,1M", "--reps", "2"], 200),
    ("overhead_mamba2", ["--shape", "mamba2", "--lengths", "64K,256K", "--reps", "2"], 100),
    ("overhead_hybrid", ["--shape", "hybrid", "--lengths", "64K,256K", "--reps", "2"], 100),
)
SMOKE_STAGES = (
    ("overhead_tiny", ["--tiny", "--device", "cpu", "--lengths", "1K", "--reps", "1", "--gen", "2"], 0),
)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default="", help="JSON result file (rewritten after every stage)")
    ap.add_argument("--budget-s", type=float, default=470.0, help="stop starting stages after this (default %(default)s)")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke form: tiny models, no GPU needed")
    ap.add_argument("--skip-checks", action="store_true", help="only the timing stages")
    args = ap.parse_args(argv)
    import torch
    if not args.smoke and not torch.cuda.is_available():
        ap.error("no CUDA device (use --smoke for the CPU form)")
    from bench.gpu import gpu_checks, overhead_gpu
    t0 = time.perf_counter()
    doc = {"machine": machine(), "date": today(), "torch": torch.__version__, "smoke": args.smoke,
           "command": "python bench/gpu/lease.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "stages": {}}

    def save():
        doc["elapsed_s"] = round(time.perf_counter() - t0, 1)
        if args.out:
            write_json(args.out, doc)

    def run(name, fn, need_s):
        left = args.budget_s - (time.perf_counter() - t0)
        if left < need_s:
            doc["stages"][name] = {"skipped": f"needs ~{need_s} s, {left:.0f} s of the budget left"}
        else:
            s0 = time.perf_counter()
            try:
                doc["stages"][name] = fn()
            except BaseException as e:  # noqa: BLE001 - one lease, many stages (argparse exits too)
                if isinstance(e, KeyboardInterrupt):
                    raise
                doc["stages"][name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
            doc["stages"][name]["stage_s"] = round(time.perf_counter() - s0, 1)
        print(f"[lease] {name}: {str(doc['stages'][name])[:300]}", flush=True)
        save()

    if not args.skip_checks:
        run("checks", lambda: gpu_checks.main(["--smoke"] if args.smoke else []), 0)
    for name, av, need in (SMOKE_STAGES if args.smoke else GPU_STAGES):
        run(name, lambda av=av: overhead_gpu.main(av), need)
    save()
    return doc


if __name__ == "__main__":
    main()
