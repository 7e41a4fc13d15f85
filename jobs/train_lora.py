"""Train NB-LoRA read adapters with Ray Train (paper App. B.4, C.4).

    python jobs/train_lora.py -c configs/train_lora.yaml --set data=data/nq_2400.jsonl --set output=out/adapter
    ray job submit --working-dir . -- python jobs/train_lora.py -c configs/train_lora.yaml ...

Rerunning with the same `storage` and `name` resumes from the latest checkpoint.
Prints, last, a one-line JSON summary: {"updates", "resumed_from", "final_loss", "mean_loss_first10",
"mean_loss_last10", "skipped", "checkpoint", "output", "wall_s"}.
Exit status: 0 on success, 2 on a config error, 1 on other errors.
"""
from __future__ import annotations

import os
import sys

if not __package__:   # run as a script from a checkout (or ray job submit): the repo root holds notebank/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from notebank.pipeline.cli import cleanup, emit, parse, setup  # noqa: E402


def main(argv=None) -> int:
    from notebank.pipeline.train_lora import TrainLoraJobConfig, run_train
    cfg = parse(TrainLoraJobConfig, __doc__.splitlines()[0], argv)
    started = setup(cfg)
    try:
        summary = run_train(cfg)
    finally:
        cleanup(started)
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
