"""Answer questions against NoteBank archives (batch QA), one row per question and method.

    python jobs/query.py -c configs/query.yaml --set questions=data/questions.jsonl \
        --set archive=out/archive --set output=out/answers
    ray job submit --working-dir . -- python jobs/query.py -c configs/query.yaml ...

Last stdout line: {"questions_ok", "questions_failed", "questions_retried", "rows", "wall_s", "output",
"metric", "mean_score"}.
The output is a folder of answers parts (one Parquet dataset), written while the job runs; a rerun
answers the missing (question_id, method) pairs and, with retry_failed: true (the default), the
failed ones again (their old rows are replaced: one row per pair; column `retried`).
Exit status: 0 when every question was answered, 1 when some failed (rows with status "failed") or the
store failed under the job (one line, then a summary with committed_parts/committed_rows), 2 on a
config error, missing input, a model/archive fingerprint mismatch, or a refused output (inside any
ingest output, held by another run, escaping through a symlink).
"""
from __future__ import annotations

import sys

import os

if not __package__:   # run as a script from a checkout (or ray job submit): the repo root holds notebank/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from notebank.pipeline.cli import archive_user_errors, run_job  # noqa: E402


def run(cfg) -> dict:
    from notebank.pipeline.query import run_query
    return run_query(cfg)


def main(argv=None) -> int:
    from notebank.pipeline.query import QueryJobConfig, committed_in_store
    return run_job(QueryJobConfig, __doc__.splitlines()[0], run, argv, errors=archive_user_errors, committed=committed_in_store)


if __name__ == "__main__":
    sys.exit(main())
