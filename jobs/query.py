"""Answer questions against NoteBank archives (batch QA), one row per question and method.

    python jobs/query.py -c configs/query.yaml --set questions=data/questions.jsonl \
        --set archive=out/archive --set output=out/answers.parquet
    ray job submit --working-dir . -- python jobs/query.py -c configs/query.yaml ...

Last stdout line: {"questions_ok", "questions_failed", "rows", "wall_s", "output", "metric", "mean_score"}.
Exit status: 0 when the job ran, 2 on a config error or a model/archive fingerprint mismatch.
"""
from __future__ import annotations

import sys

import os

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root (ray job submit)
from pipeline.cli import run_job  # noqa: E402


def run(cfg) -> dict:
    from pipeline.query import run_query
    return run_query(cfg)


def main(argv=None) -> int:
    from pipeline.config import QueryJobConfig
    from pipeline.store import FingerprintMismatch
    return run_job(QueryJobConfig, __doc__.splitlines()[0], run, argv, errors=(FingerprintMismatch, FileNotFoundError))


if __name__ == "__main__":
    sys.exit(main())
