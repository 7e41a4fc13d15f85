"""RULER evaluation sweep: backbones x methods x routers x tasks x lengths x budgets, on Ray.

    python jobs/evaluate.py -c configs/eval_ruler.yaml                 # full grid (documented, not CI)
    python jobs/evaluate.py -c configs/eval_smoke.yaml                 # CI smoke: 4K/16K, few examples
    ray job submit --working-dir . -- python jobs/evaluate.py -c configs/eval_ruler.yaml

Resumable: finished cells are skipped on rerun. Writes results.parquet, summary.json, report.md
and plots under `output`; prints a one-line JSON summary.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root (ray job submit)
from pipeline.cli import cleanup, emit, parse, setup  # noqa: E402


def main(argv=None):
    from pipeline.evaluate import EvalJobConfig, run_sweep
    cfg = parse(EvalJobConfig, __doc__.split("\n")[0], argv)
    started = setup(cfg)
    try:
        summary = run_sweep(cfg)
    finally:
        cleanup(started)
    emit(summary)
    return summary


if __name__ == "__main__":
    main()
