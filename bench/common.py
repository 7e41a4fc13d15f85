"""Shared helpers for the benchmarks: machine description, timing, result files."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch
        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}; {os.cpu_count()} CPU cores"
        threads = torch.get_num_threads()
    except ImportError:
        threads = "?"
    return f"{cpu}, {os.cpu_count()} cores, torch threads {threads}"


def today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def median(xs):
    return float(statistics.median(xs))


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def add_dev_draw_args(ap, model: str, length: str, n: int) -> None:
    """The CLI shared by the RULER development-draw probes (router_dev, channel_hits)."""
    ap.add_argument("--model", default=model)
    ap.add_argument("--length", default=length)
    ap.add_argument("--n", type=int, default=n, help="examples per task")
    ap.add_argument("--seed", type=int, default=1, help="1: a development draw, disjoint from the sweep's seed 0")
    ap.add_argument("--out", required=True)


def write_dev_draw(args, res: dict, argv: list[str], **extra) -> None:
    """Write a probe's result with what reproduces it (date, machine, arguments, command)."""
    write_json(args.out, {"date": today(), "machine": machine(), "model": args.model, "length": args.length,
                          "examples_per_task": args.n, "seed": args.seed, **extra,
                          "command": " ".join(["python", sys.argv[0], *argv]), **res})
