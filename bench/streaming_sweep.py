"""Run (or resume) cells of a RULER sweep config in this process, one after another, without Ray.

The same cells, files and rows as `jobs/evaluate.py` (pipeline/evaluate.py: plan, `run_cell`, one
Parquet file per finished cell, skipped on rerun), for a machine where starting Ray is not worth it
or fails (on a shared, overloaded 2-core host `ray.init` timed out: "The current node timed out
during startup"). The model is loaded once. Reports come from bench/streaming_summary.py (or
`jobs/evaluate.py ... --set report_only=true` once Ray is usable).

    nice -n 15 python bench/streaming_sweep.py -c configs/eval_streaming_smollm2.yaml \
        --set 'only_lengths=[16K]' --set 'tasks=[niah_single_2,phrased_niah_heldout]' \
        --set 'only_backbones=[smollm2-135m]'

Two of these on disjoint cells (e.g. one per length) share a 2-core machine best with one torch
thread each: `--set num_cpus_per_cell=1` (cells are separate files, so they never collide). Two on
the same cells: give one `--reverse`; each skips a cell the other has finished by the time it gets
there, so they meet in the middle (at most the cell both are on runs twice, to the same file).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("-s", "--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--max-cells", type=int, default=None, help="stop after this many cells")
    ap.add_argument("--reverse", action="store_true",
                    help="run the cells last first (a second process on the same cells)")
    a = ap.parse_args(argv)
    from notebank.pipeline.config import load_config
    from notebank.pipeline.evaluate import cells_to_run, run_cell
    from notebank.pipeline.fanout import unfinished
    from notebank.pipeline.evaluate_ruler import RulerJobConfig
    cfg = load_config(RulerJobConfig, a.config, a.set).validate()
    cells, _ = cfg.plan()
    todo = sorted(cells_to_run(cfg, cells), key=cfg.cell_order, reverse=a.reverse)[: a.max_cells]
    print(json.dumps({"cells": len(cells), "todo": len(todo), "output": cfg.output}), flush=True)
    results = []
    for i, cell in enumerate(todo):
        if not unfinished(cfg.output, [cell]):      # another process finished it meanwhile
            print(json.dumps({"done": i + 1, "of": len(todo), "path": cell["path"], "skipped": "finished"}),
                  flush=True)
            continue
        t0 = time.time()
        r = run_cell(cell)
        results.append(r)
        print(json.dumps({"done": i + 1, "of": len(todo), "path": r["path"], "error": r["error"],
                          "s": round(time.time() - t0, 1)}), flush=True)
    return results


if __name__ == "__main__":
    main()
