"""Model loads and wall time of an evaluation sweep: cells as Ray tasks (the former runner) vs cells on
Ray Data actors (pipeline/evaluate.py run_cells), in ONE run, on one local Ray, the same 12 cells.

    python bench/sweep_reuse.py                      # CPU: 2 actors, writes bench/results/sweep_reuse.{json,md}
    python bench/sweep_reuse.py --num-gpus 1 --out /tmp/sweep_reuse-gpu.json       # on a GPU machine

The sweep: RULER niah_single_1 + niah_multikey_1 at 1K tokens, 3 examples each, methods plain and
nb-tf-top2, over the two shipped backbones (models/tiny-gdn, models/tiny-mamba2-p5): 12 cells, 6 per
backbone. Both runners get the same resources per cell (--num-cpus per cell, --num-gpus per cell).

  tasks   the runner this project had before: one Ray task per cell, all submitted at once, with a
          per-process model cache (a faithful copy below: old_run_all / old_run_cell).
  tasks-max_calls=1   the same with max_calls=1, which is Ray's default for a task with num_gpus > 0
          (the worker exits after every task, so the cache never hits): what the former runner did
          on GPUs with num_gpus_per_cell: 1, shown on CPU when there is no GPU (--num-gpus 0).
  actors  pipeline.evaluate.run_cells: one Ray Data dataset of the cells, ordered by backbone, through
          map_batches(CellRunner, batch_size=1, compute=ActorPoolStrategy(size=--actors)); an actor
          loads a backbone when its first cell of it arrives.

Model loads are counted in the workers: a worker_process_setup_hook wraps
nbcore.backbones.loading.build_backbone to append "<pid> <model path>" to a file per load.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "bench" / "results" / "sweep_reuse.json"
LOADS_ENV = "NB_SWEEP_REUSE_LOADS"
BACKBONES = [("tiny-gdn", "models/tiny-gdn", 512), ("tiny-mamba2-p5", "models/tiny-mamba2-p5", 256)]


def count_model_loads() -> None:
    """worker_process_setup_hook: every build_backbone call in this worker appends one line."""
    from nbcore.backbones import loading
    path = os.environ.get(LOADS_ENV)
    if not path or getattr(loading.build_backbone, "_counted", False):
        return
    inner = loading.build_backbone

    def build_backbone(spec, *a, **kw):
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {spec.get('path')}\n")
        return inner(spec, *a, **kw)

    build_backbone._counted = True
    loading.build_backbone = build_backbone


# ------------------------------------------------------------------------------------------------
# the former runner (pipeline/fanout.py run_all + pipeline/evaluate.py run_cell and its _MODELS
# cache, as they were before the sweeps moved to Ray Data actors)

_OLD_MODELS: dict = {}


def old_run_cell(cell: dict) -> dict:
    import torch

    from nbcore.evals import build_benchmark
    from notebank.pipeline.evaluate import evaluate_cell, load_model
    torch.set_num_threads(max(1, int(cell.get("threads", 1))))
    bench = build_benchmark(cell["benchmark"], cell["options"])
    key = (bench.model_kind, json.dumps(cell["model"], sort_keys=True))
    if key not in _OLD_MODELS:
        _OLD_MODELS[key] = load_model(bench, cell["model"])
    return evaluate_cell(cell, _OLD_MODELS[key])


def old_run_all(fn, items: list[dict], num_cpus: float, num_gpus: float = 0.0, max_retries: int = 2,
                max_calls: int | None = None) -> list[dict]:
    import ray
    opts = {} if max_calls is None else {"max_calls": max_calls}      # None: Ray's default
    remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=max_retries, **opts)(fn)
    pending = [remote.remote(x) for x in items]
    results = []
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        results.append(ray.get(done[0]))
    return results


# ------------------------------------------------------------------------------------------------

def plan(out: Path, args) -> list[dict]:
    from notebank.pipeline.config import load_config
    from notebank.pipeline.evaluate_ruler import RulerJobConfig
    device = "cuda" if args.num_gpus > 0 else "cpu"
    entries = ", ".join(f"{{name: {n}, model: {{path: {REPO / p}, device: {device}}}, notebank: {{chunk_size: {c}}}}}"
                        for n, p, c in BACKBONES)
    cfg = load_config(RulerJobConfig, None, [
        f"output={out}", f"backbones=[{entries}]", "tasks=[niah_single_1, niah_multikey_1]", "lengths=[1K]",
        f"n_examples={args.examples}", "methods=[plain, nb-tf-top2]", "max_new_tokens=4", "progress=false",
        f"num_cpus_per_cell={args.num_cpus}", f"num_gpus_per_cell={args.num_gpus}"]).validate()
    cells, _ = cfg.plan()
    return sorted(cells, key=cfg.cell_order)


def read_loads(path: Path, start: int) -> list[tuple[int, str]]:
    lines = path.read_text().splitlines()[start:] if path.exists() else []
    return [(int(p), m) for p, m in (line.split(" ", 1) for line in lines)]


def run_phase(runner: str, cells: list[dict], args, loads_file: Path) -> dict:
    from notebank.pipeline.evaluate import run_cells
    start = len(loads_file.read_text().splitlines()) if loads_file.exists() else 0
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    if runner == "tasks":
        recs = old_run_all(old_run_cell, cells, args.num_cpus, args.num_gpus)
    elif runner == "tasks-max_calls=1":
        recs = old_run_all(old_run_cell, cells, args.num_cpus, args.num_gpus, max_calls=1)
    else:
        recs = run_cells(cells, args.num_cpus, args.num_gpus, num_actors=args.actors, progress=False)
    wall = time.perf_counter() - t0
    loads = read_loads(loads_file, start)
    failed = [r for r in recs if r["error"]]
    per_backbone = {}
    for _pid, m in loads:
        name = Path(m).name
        per_backbone[name] = per_backbone.get(name, 0) + 1
    return {"runner": runner, "cells": len(recs), "failed": len(failed), "errors": [r["error"] for r in failed[:3]],
            "model_loads": len(loads), "loads_per_backbone": per_backbone,
            "worker_processes": len({p for p, _ in loads}), "wall_s": round(wall, 2),
            "loadavg_1min_before": round(load0, 2), "loadavg_1min_after": round(os.getloadavg()[0], 2)}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {"cpu": cpu, "nproc": os.cpu_count(), "gpu": gpu}


def markdown(r: dict) -> str:
    m, s = r["machine"], r["setup"]
    lines = [f"# Evaluation sweep: cells as Ray tasks vs on Ray Data actors ({r['date'][:10]})", "",
             f"Command: `{r['command']}` (one run; raw numbers in the JSON beside this file)  ",
             f"Machine: {m['nproc']} CPUs ({m['cpu']}), GPU: {m['gpu']}; Ray {r['versions']['ray']}, "
             f"torch {r['versions']['torch']}; local Ray with {s['ray_num_cpus']} CPUs.  ",
             f"Sweep: {s['cells']} cells (RULER niah_single_1 + niah_multikey_1 at 1K, {s['examples']} examples each, "
             f"plain + nb-tf-top2) over 2 backbones ({', '.join(n for n, _, _ in BACKBONES)}); per cell "
             f"{s['num_cpus_per_cell']} CPU and {s['num_gpus_per_cell']} GPU; {s['actors']} actors (one pool for both backbones).", "",
             "| run | runner | model loads | loads per backbone | worker processes | cells failed | wall s | "
             "load avg (1 min) before / after |", "|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(r["runs"]):
        per = ", ".join(f"{k} {v}" for k, v in sorted(p["loads_per_backbone"].items()))
        lines.append(f"| {i + 1} | {p['runner']} | {p['model_loads']} | {per} | {p['worker_processes']} | "
                     f"{p['failed']} | {p['wall_s']:.1f} | {p['loadavg_1min_before']:.1f} / {p['loadavg_1min_after']:.1f} |")
    lines += ["", "tasks: one Ray task per cell with a per-process model cache (the former runner); "
              "tasks-max_calls=1: the same with Ray's default for GPU tasks, where each worker exits after one "
              "task (what the former runner did with num_gpus_per_cell: 1). actors: "
              "pipeline.evaluate.run_cells, one pool of CellRunner actors, cells ordered by backbone; each actor "
              "loads a backbone when its first cell of it arrives. Model loads counted in the workers (bench/sweep_reuse.py count_model_loads). The machine is "
              "shared: the load average beside each run says how busy it was, and wall times move with it.", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--actors", type=int, default=2, help="actors of the new runner (one pool for every backbone)")
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per cell / actor")
    p.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per cell / actor (1 on a GPU machine)")
    p.add_argument("--ray-cpus", type=int, default=2, help="CPUs of the local Ray")
    p.add_argument("--examples", type=int, default=3, help="examples per task (cells = 2 tasks x 2 backbones x this)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each runner, alternated")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    import ray
    import torch
    tmp = Path(tempfile.mkdtemp(prefix="nb-sweep-reuse-"))
    loads_file = tmp / "loads.txt"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [x for x in [os.environ.get("PYTHONPATH")] if x])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "bench.sweep_reuse.count_model_loads",
                          "env_vars": {LOADS_ENV: str(loads_file), "PYTHONPATH": os.environ["PYTHONPATH"],
                                       "TOKENIZERS_PARALLELISM": "false"}})
    runs = []
    try:
        for rep in range(args.repeats):
            order = ["tasks", "actors"] if rep % 2 == 0 else ["actors", "tasks"]
            if args.num_gpus == 0:          # with GPUs, "tasks" already runs with max_calls=1 (Ray's default)
                order.insert(1, "tasks-max_calls=1")
            for runner in order:
                cells = plan(tmp / f"{runner}-{rep}", args)
                r = run_phase(runner, cells, args, loads_file)
                r["rep"] = rep
                runs.append(r)
                print(f"[sweep_reuse] {runner} rep {rep}: {r['model_loads']} loads, {r['wall_s']} s, "
                      f"{r['failed']} failed", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    res = {"command": "python bench/sweep_reuse.py " + " ".join(argv),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
           "versions": {"ray": ray.__version__, "torch": torch.__version__},
           "setup": {"cells": runs[0]["cells"], "examples": args.examples, "actors": args.actors,
                     "num_cpus_per_cell": args.num_cpus, "num_gpus_per_cell": args.num_gpus,
                     "ray_num_cpus": args.ray_cpus, "backbones": [p for _, p, _ in BACKBONES]},
           "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    print(json.dumps({"out": str(out), "runs": [{k: x[k] for k in ("runner", "model_loads", "wall_s", "failed")}
                                               for x in runs]}))
    return res


if __name__ == "__main__":
    main()
