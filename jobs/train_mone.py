"""CLI: meta-train MoNe on a frozen Qwen2-family base (optionally under Ray Train), with its diagnostics.

    python jobs/train_mone.py -c configs/train_mone.yaml                              # plain loop (resumable)
    python jobs/train_mone.py -c configs/train_mone.yaml --set action=ray             # Ray Train TorchTrainer
    python jobs/train_mone.py -c configs/train_mone.yaml --set action=diagnostics     # answer CE with / without memory
    python jobs/evaluate.py -c configs/eval_mone.yaml                                 # mone / icl / rag results (the sweep)

Runner: pipeline/train_mone.py. Prints the action's result as JSON. Exit status 0, or 2 on a config error.
"""
from __future__ import annotations

import json
import os
import sys

if not __package__:   # run as a script from a checkout (or ray job submit): the repo root holds notebank/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from notebank.pipeline.train_mone import MALLOC_ENV  # noqa: E402

if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})


def main(argv=None) -> int:
    from notebank.pipeline.cli import parse
    from notebank.pipeline.train_mone import TrainMoneJobConfig, run
    cfg = parse(TrainMoneJobConfig, __doc__.splitlines()[0], argv)
    print(json.dumps(run(cfg), indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
