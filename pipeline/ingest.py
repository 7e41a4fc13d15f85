"""Ingest: corpus shards -> per-document archives (notes Parquet + state safetensors + manifest).

Driver: reads the corpus lazily, validates rows and doc ids, skips committed documents, dispatches
documents to backbone actors (bounded in flight), and commits each result (pipeline.store). The
driver is the only writer, so a killed actor (Ray restarts it and retries its calls) or a killed
driver (the rerun redoes uncommitted documents, deterministically) never duplicates or loses a
document.
"""
from __future__ import annotations

import hashlib
import time
from typing import Callable, Iterator

from pipeline.archive_io import run_fingerprint
from pipeline.config import IngestJobConfig
from pipeline.corpus import Row, iter_corpus
from pipeline.pool import dispatch, start_workers, worker_failure, worker_pool
from pipeline.store import ArchiveStore, doc_key
from schemas.manifest import DocRecord


def sha256_text(text: str) -> str:
    """Hex sha256 of the UTF-8 text: a committed document is skipped when its text is unchanged."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def run_ingest(cfg: IngestJobConfig, on_commit: Callable[[DocRecord], None] | None = None,
               workers: tuple | None = None) -> dict:
    """Run one ingest job (Ray must be initialised). Returns the summary dict.

    on_commit(record) is called after each document record is written (tests, progress hooks).
    workers: (handles, infos) of an existing pool to reuse (benchmarks); else a pool is started and
    stopped here. `memory: mone` ingests per-document MoNe states instead (pipeline.mone_pipeline)."""
    cfg.validate()
    if cfg.memory == "mone":
        from pipeline.mone_pipeline import run_ingest_mone
        return run_ingest_mone(cfg, on_commit=on_commit, workers=workers)
    t_start = time.perf_counter()
    store = open_output(cfg.output)
    with worker_pool(workers, start_workers, cfg.model, cfg.actors) as (handles, infos):
        i0 = infos[0]
        fp = run_fingerprint(i0["fingerprint"], i0["family"], i0["n_channels"], cfg.notebank, i0.get("tokenizer"))
        store.check_or_write_run(fp)
        done = {k: r for k, r in store.load_records().items() if r.status == "ok"}
        tally = Tally(dict(docs_ok=0, docs_skipped=0, docs_failed=0, tokens=0, notes=0, bytes=0), cfg.progress)
        nb = cfg.notebank.to_dict()

        def fail(rec: DocRecord):
            store.record_failure(rec)
            tally.failed(rec.doc_id, rec.error, rec.source)
            if on_commit:
                on_commit(rec)

        def reject(error, base, committed):
            fail(DocRecord(error=error, **base))

        def tasks():
            for row, key, base in new_rows(cfg, fp, done, reject):
                text_sha = sha256_text(row.text)
                prev = done.get(key)
                if prev is not None:
                    if prev.text_sha256 != text_sha:
                        # keep the committed archive (not rewritten): never mix two versions of a document
                        tally.failed(row.doc_id, "already archived with different text; use a new output folder",
                                     row.source)
                    else:
                        tally.skipped()
                    continue
                base.update(key=key, text_sha256=text_sha)
                yield {"doc_id": row.doc_id, "text": row.text, "base": base}

        def submit(actor, t):
            return actor.ingest_doc.remote({"doc_id": t["doc_id"], "text": t["text"]}, nb, cfg.block_size)

        def on_done(t, res, err):
            base = t["base"]
            if err is not None:
                return fail(DocRecord(error=worker_failure(err), **base))
            if not res["ok"]:
                return fail(DocRecord(error=res["error"], **base))
            base = {k: v for k, v in base.items() if k != "status"}
            rec = DocRecord(status="ok", n_tokens=res["n_tokens"], n_notes=res["n_notes"],
                            n_archived_tokens=res["n_archived_tokens"], timings=res["timings"], **base)
            rec = store.commit(base["key"], res["notes"], res["state"], rec)
            stats = tally.stats
            stats["docs_ok"] += 1
            stats["tokens"] += rec.n_tokens
            stats["notes"] += rec.n_notes
            stats["bytes"] += rec.bytes
            tally.bar.update(1)
            el = time.perf_counter() - t_start
            tally.bar.set_postfix(tokens=stats["tokens"], tok_s=f"{stats['tokens'] / max(el, 1e-9):.0f}",
                                  refresh=False)
            if on_commit:
                on_commit(rec)

        dispatch(handles, tasks(), submit, on_done, max_in_flight=cfg.actors.max_in_flight)
        tally.bar.close()
    return tally.summary(t_start, cfg.output)


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
