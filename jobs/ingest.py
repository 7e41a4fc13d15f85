"""Ingest a corpus into NoteBank archives (notes dataset + documents table + states + commit records).

    python jobs/ingest.py -c configs/ingest.yaml --set corpus=data/corpus --set output=out/archive
    ray job submit --working-dir . -- python jobs/ingest.py -c configs/ingest.yaml ...

Prints a progress bar (stderr) and, last, a one-line JSON summary:
{"docs_ok", "docs_skipped", "docs_failed", "docs_retried", "docs_retried_ok", "docs_rewritten",
"groups_redone", "tokens", "notes", "bytes", "wall_s", "tokens_per_s", "output"}. A rerun tries the
rows that failed before again when they now read differently (retry_failed: true, the default).
Exit status: 0 when every document is archived (or already was), 1 when some documents or shards
failed (they are in the summary, the commit records and manifest/shards/) or the store failed under
the job (disk full, permission denied, the output gone: one line, then a summary with
committed_groups/committed_docs), 2 on a config error, a missing corpus, or a refused output folder
(another writer holds it, a symlink in it leads outside, another model/config wrote it, an older
archive layout).
"""
from __future__ import annotations

import sys

import os

if not __package__:   # run as a script from a checkout (or ray job submit): the repo root holds notebank/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from notebank.pipeline.cli import archive_user_errors, run_job  # noqa: E402


def run(cfg) -> dict:
    from notebank.pipeline.ingest import run_ingest
    return run_ingest(cfg)


def main(argv=None) -> int:
    from notebank.pipeline.ingest import IngestJobConfig, committed_in_store
    return run_job(IngestJobConfig, __doc__.splitlines()[0], run, argv, errors=archive_user_errors, committed=committed_in_store)


if __name__ == "__main__":
    sys.exit(main())
