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
from typing import Callable

from pipeline.archive_io import run_fingerprint
from pipeline.config import IngestJobConfig
from pipeline.corpus import iter_corpus
from pipeline.pool import dispatch, start_workers, stop_workers
from pipeline.store import ArchiveStore, doc_key
from schemas.manifest import DocRecord


def _sha(text: str) -> str:
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
    store = ArchiveStore(cfg.output)
    store.clean_tmp()
    own = workers is None
    handles, infos = workers if workers is not None else start_workers(cfg.model, cfg.actors)
    try:
        i0 = infos[0]
        fp = run_fingerprint(i0["fingerprint"], i0["family"], i0["n_channels"], cfg.notebank, i0.get("tokenizer"))
        store.check_or_write_run(fp)
        done = {k: r for k, r in store.load_records().items() if r.status == "ok"}
        stats = dict(docs_ok=0, docs_skipped=0, docs_failed=0, tokens=0, notes=0, bytes=0)
        failures: list[dict] = []
        bar = _progress(cfg.progress)
        seen: dict[str, dict] = {}
        nb = cfg.notebank.to_dict()

        def note_failure(doc_id, error, source):
            stats["docs_failed"] += 1
            if len(failures) < 20:
                failures.append({"doc_id": doc_id, "error": error, "source": source})
            bar.update(1)

        def fail(rec: DocRecord):
            store.record_failure(rec)
            note_failure(rec.doc_id, rec.error, rec.source)
            if on_commit:
                on_commit(rec)

        def tasks():
            for row in iter_corpus(cfg.corpus, cfg.limit):
                base = dict(doc_id=row.doc_id, key=None, status="failed", source=row.source, metadata=row.metadata,
                            fingerprint=fp)
                key, kerr = doc_key(row.doc_id) if row.doc_id is not None else (None, None)
                if row.error or kerr:
                    # a row with a usable, new doc_id is recorded under it; others under manifest/rejected/
                    if key and row.doc_id not in seen and key not in done:
                        seen[row.doc_id] = row.source
                        base["key"] = key
                    fail(DocRecord(error=row.error or kerr, **base))
                    continue
                if row.doc_id in seen:
                    fail(DocRecord(error=f"duplicate doc_id (first seen at {seen[row.doc_id]})", **base))
                    continue
                seen[row.doc_id] = row.source
                text_sha = _sha(row.text)
                prev = done.get(key)
                if prev is not None:
                    if prev.text_sha256 != text_sha:
                        # keep the committed archive (not rewritten): never mix two versions of a document
                        note_failure(row.doc_id, "already archived with different text; use a new output folder",
                                     row.source)
                    else:
                        stats["docs_skipped"] += 1
                        bar.update(1)
                    continue
                base.update(key=key, text_sha256=text_sha)
                yield {"doc_id": row.doc_id, "text": row.text, "base": base}

        def submit(actor, t):
            return actor.ingest_doc.remote({"doc_id": t["doc_id"], "text": t["text"]}, nb, cfg.block_size)

        def on_done(t, res, err):
            base = t["base"]
            if err is not None:
                return fail(DocRecord(error=f"worker failed: {type(err).__name__}: {str(err)[:500]}", **base))
            if not res["ok"]:
                return fail(DocRecord(error=res["error"], **base))
            base = {k: v for k, v in base.items() if k != "status"}
            rec = DocRecord(status="ok", n_tokens=res["n_tokens"], n_notes=res["n_notes"],
                            n_archived_tokens=res["n_archived_tokens"], timings=res["timings"], **base)
            rec = store.commit(base["key"], res["notes"], res["state"], rec)
            stats["docs_ok"] += 1
            stats["tokens"] += rec.n_tokens
            stats["notes"] += rec.n_notes
            stats["bytes"] += rec.bytes
            bar.update(1)
            el = time.perf_counter() - t_start
            bar.set_postfix(tokens=stats["tokens"], tok_s=f"{stats['tokens'] / max(el, 1e-9):.0f}", refresh=False)
            if on_commit:
                on_commit(rec)

        dispatch(handles, tasks(), submit, on_done, max_in_flight=cfg.actors.max_in_flight)
        bar.close()
    finally:
        if own:
            stop_workers(handles)
    wall = time.perf_counter() - t_start
    return {**stats, "wall_s": round(wall, 3), "tokens_per_s": round(stats["tokens"] / wall, 1) if wall > 0 else 0.0,
            "output": cfg.output, "failures": failures}


class _NoBar:
    def update(self, n=1): pass
    def set_postfix(self, **kw): pass
    def close(self): pass


def _progress(enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(unit="doc", desc="ingest", mininterval=1.0, dynamic_ncols=True)
