"""End-to-end demo on embedded defaults: generated needle corpus -> ingest -> batch QA.

    python jobs/run_demo.py                        # local Ray, the shipped tiny GDN, a RULER corpus, ~1 min on 2 CPUs
    python jobs/run_demo.py -c configs/demo.yaml --set n_docs=8
    ray job submit --working-dir . -- python jobs/run_demo.py

Writes corpus.jsonl, questions.jsonl, archive/ (layout v2) and answers/ (a Parquet dataset) under
`workdir` (default: a new temporary folder) and prints one JSON line: {"workdir", "ingest": {...},
"query": {...}}. The default model is the shipped tiny GDN (models/tiny-gdn), which reads RULER's
needle templates at these lengths; `--set task=null --set model.path=...` runs other models.
"""
from __future__ import annotations

import os
import sys

if not __package__:   # run as a script from a checkout (or ray job submit): the repo root holds notebank/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from notebank.pipeline.cli import run_job  # noqa: E402


def run(cfg) -> dict:
    from notebank.pipeline.demo import run as run_demo
    return run_demo(cfg)


def main(argv=None) -> int:
    from notebank.pipeline.demo import DemoConfig
    return run_job(DemoConfig, __doc__.splitlines()[0], run, argv, errors=())


if __name__ == "__main__":
    sys.exit(main())
