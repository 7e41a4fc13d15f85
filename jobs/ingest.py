"""Ingest a corpus into NoteBank archives (notes Parquet + state safetensors + manifest).

    python jobs/ingest.py -c configs/ingest.yaml --set corpus=data/corpus --set output=out/archive
    ray job submit --working-dir . -- python jobs/ingest.py -c configs/ingest.yaml ...

Prints a progress bar (stderr) and, last, a one-line JSON summary:
{"docs_ok", "docs_skipped", "docs_failed", "tokens", "notes", "bytes", "wall_s", "tokens_per_s", "output"}.
Exit status: 0 when the job ran (failed documents are in the summary and manifest), 2 on a config
error or a refused output folder (different model/config), 1 on other errors.
"""
from __future__ import annotations

import sys

import os

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root (ray job submit)
from pipeline.cli import run_job  # noqa: E402


def run(cfg) -> dict:
    from pipeline.ingest import run_ingest
    return run_ingest(cfg)


def main(argv=None) -> int:
    from pipeline.config import IngestJobConfig
    from pipeline.store import FingerprintMismatch
    return run_job(IngestJobConfig, __doc__.splitlines()[0], run, argv, errors=(FingerprintMismatch,))


if __name__ == "__main__":
    sys.exit(main())
