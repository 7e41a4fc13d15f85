"""Ingest on Ray Data: corpus shards -> archive (layout v2, pipeline/archive.py).

    scan   ray.data.from_items(shards).map(scan_corpus_shard)     ids + text hashes only (Ray tasks)
    plan   driver: fixed groups of `docs_per_group` rows per shard; drop committed groups and documents,
           reject bad rows and duplicate ids -- before any model work
    read   .flat_map(read_corpus_groups)                          the planned rows' text (Ray tasks)
    write  .map_batches(IngestActor, batch_size=1, concurrency=n, num_gpus=g, accelerator_type=...)
           one frozen backbone per actor; the actor writes states, the group's notes and documents
           parts and the commit record straight to the store, and returns one small record per row
The driver holds ids, hashes and records, never text, notes or states. Ray Data schedules, retries
(a killed actor is restarted and its group redone, with the same bytes) and applies backpressure.
A killed driver leaves committed groups; the rerun redoes the rest. One writer per output folder
(a lease); paths that escape the folder through symlinks are refused.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from typing import Callable, Iterator

from pipeline.archive_io import run_fingerprint
from pipeline.config import IngestJobConfig
from pipeline.corpus import Row, iter_corpus
from pipeline.store import ArchiveStore, doc_key
from schemas.manifest import DocRecord

log = logging.getLogger(__name__)


def sha256_text(text: str) -> str:
    """Hex sha256 of the UTF-8 text: a committed document is skipped when its text is unchanged."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def run_ingest(cfg: IngestJobConfig, on_commit: Callable[[dict], None] | None = None,
               workers: tuple | None = None) -> dict:
    """Run one ingest job (Ray must be initialised). Returns the summary dict.

    on_commit(record) is called for each row's small record as it arrives (tests, progress hooks).
    `memory: mone` ingests per-document MoNe states instead (pipeline.mone_pipeline)."""
    cfg.validate()
    if cfg.memory == "mone":
        from pipeline.mone_pipeline import run_ingest_mone
        return run_ingest_mone(cfg, on_commit=on_commit, workers=workers)
    from pipeline.dataplane import ingest_dataset
    return ingest_dataset(cfg, on_commit=on_commit)


# ------------------------------------------------------------------------------------------------
# shared with the `memory: mone` driver (pipeline.mone_pipeline.run_ingest_mone)

def open_output(output: str) -> ArchiveStore:
    """The output's archive store, with temporary files of a killed run removed."""
    store = ArchiveStore(output)
    store.clean_tmp()
    return store


def new_rows(cfg, fp: dict, done: dict, reject: Callable[[str, dict, bool], None]
             ) -> Iterator[tuple[Row, str, dict]]:
    """Corpus rows with a valid doc_id not seen earlier in this run -> (row, key, base record fields).
    Every other row goes to reject(error, base, committed): committed says its key already holds an
    ok record in `done`; a bad row with a usable, new doc_id is recorded under it (base["key"]),
    others under manifest/rejected/."""
    seen: dict[str, dict] = {}
    for row in iter_corpus(cfg.corpus, cfg.limit):
        base = dict(doc_id=row.doc_id, key=None, status="failed", source=row.source, metadata=row.metadata,
                    fingerprint=fp)
        key, kerr = doc_key(row.doc_id) if row.doc_id is not None else (None, None)
        if row.error or kerr:
            if key and row.doc_id not in seen and key not in done:
                seen[row.doc_id] = row.source
                base["key"] = key
            reject(row.error or kerr, base, key in done)
            continue
        if row.doc_id in seen:
            reject(f"duplicate doc_id (first seen at {seen[row.doc_id]})", base, False)
            continue
        seen[row.doc_id] = row.source
        yield row, key, base


class Tally:
    """One ingest run's counters (`stats`, in summary order), first 20 failures and progress bar."""

    def __init__(self, stats: dict, progress: bool):
        self.stats, self.failures, self.bar = stats, [], _progress(progress)

    def failed(self, doc_id, error: str, source) -> None:
        self.stats["docs_failed"] += 1
        if len(self.failures) < 20:
            self.failures.append({"doc_id": doc_id, "error": error, "source": source})
        self.bar.update(1)

    def skipped(self) -> None:
        self.stats["docs_skipped"] += 1
        self.bar.update(1)

    def summary(self, t_start: float, output: str, **extra) -> dict:
        """The job's summary dict: stats, wall time, throughput, output, `extra`, failures."""
        wall = time.perf_counter() - t_start
        return {**self.stats, "wall_s": round(wall, 3),
                "tokens_per_s": round(self.stats["tokens"] / wall, 1) if wall > 0 else 0.0,
                "output": output, **extra, "failures": self.failures}


class _NoBar:
    def update(self, n=1): pass
    def set_postfix(self, **kw): pass
    def close(self): pass


def _progress(enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(unit="doc", desc="ingest", mininterval=1.0, dynamic_ncols=True)
