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
from pipeline.cli import cleanup, emit, parse, setup  # noqa: E402


def run(cfg) -> dict:
    from pipeline.query import run_query
    return run_query(cfg)


def main(argv=None) -> int:
    from pipeline.config import QueryJobConfig
    from pipeline.store import FingerprintMismatch
    cfg = parse(QueryJobConfig, __doc__.splitlines()[0], argv)
    started = setup(cfg)
    try:
        summary = run(cfg)
    except (FingerprintMismatch, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        cleanup(started)
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
