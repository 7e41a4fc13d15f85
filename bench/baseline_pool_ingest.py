"""Baseline for bench/dataplane.py: today's (pre-Ray-Data) `pool.dispatch` ingest driver loop.

This is the pre-Ray-Data design, kept ONLY as the benchmark baseline; production ingest is
`pipeline.ingest.run_ingest` (pipeline/dataplane.py). It is a minimal, faithful copy of the body of
the old `run_ingest` (git show cac2f38:pipeline/ingest.py):

  * `pipeline.pool.start_workers` starts `num_actors` NoteBankWorker actors;
  * the driver reads the corpus (`pipeline.corpus.iter_corpus`), and `pipeline.pool.dispatch`
    sends every document's TEXT to an actor (`actor.ingest_doc.remote(...)`, at most
    `max_in_flight` calls per actor);
  * the actor returns the document's notes Parquet bytes and state safetensors bytes to the driver;
  * the driver writes three files per document (`pipeline.store.ArchiveStore.commit`: notes/<key>.parquet,
    state/<key>.safetensors, manifest/docs/<key>.json, each under a temporary name + rename).

Left out (not on the measured path): the skip/refuse logic for a rerun into a non-empty folder and the
rejected-row records (a benchmark writes into a fresh folder from a clean corpus), the progress bar.

`NoteBankWorker.ingest_doc` (pipeline/worker.py) is used when it exists; if it has been removed,
`_ingest_doc` below does what it did (nbcore.ingest, notes -> pyarrow Parquet, state -> safetensors).
"""
from __future__ import annotations

import dataclasses
import hashlib
import pickle
import time
from typing import Callable

from notebank.pipeline.config import IngestJobConfig

__all__ = ["run_baseline_ingest"]


def _ingest_doc(worker, task: dict, nb: dict, block_size: int) -> dict:
    """What NoteBankWorker.ingest_doc did: -> {ok, error | notes, state, n_tokens, n_notes, ...}."""
    from nbcore import ingest
    from nbcore.config import NoteBankConfig
    from notebank.pipeline import archive_io
    t0 = time.perf_counter()
    try:
        res = ingest(worker.bb, task["text"], NoteBankConfig(**nb), block_size=block_size)
    except ValueError as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    t1 = time.perf_counter()
    notes = archive_io.archive_to_notes_bytes(task["doc_id"], res.archive, worker.bb.n_channels)
    state = archive_io.state_to_bytes(worker.bb.state_to_tensors(res.state), doc_id=task["doc_id"],
                                      model_fingerprint=worker.fp)
    return {"ok": True, "notes": notes, "state": state, "n_tokens": int(res.n_tokens),
            "n_notes": len(res.archive), "n_archived_tokens": int(res.archive.n_archived_tokens),
            "timings": {"ingest_s": t1 - t0, "serialize_s": time.perf_counter() - t1}}


def _start(model, actors):
    """pool.start_workers, or (NoteBankWorker.ingest_doc removed) the same pool of a subclass that has it."""
    import ray

    from notebank.pipeline import pool
    from notebank.pipeline.worker import NoteBankWorker
    if hasattr(NoteBankWorker, "ingest_doc"):
        return pool.start_workers(model, actors)

    class _Worker(NoteBankWorker):                      # pragma: no cover - only once worker.py drops it
        def ingest_doc(self, task, nb, block_size):
            return _ingest_doc(self, task, nb, block_size)

    opts = dict(num_cpus=actors.num_cpus, num_gpus=actors.num_gpus, max_restarts=actors.max_restarts,
                max_task_retries=actors.max_task_retries)
    threads = actors.torch_threads or max(1, int(actors.num_cpus))
    cls = ray.remote(_Worker)
    handles = [cls.options(**opts).remote(dataclasses.asdict(model), threads) for _ in range(actors.num_actors)]
    return handles, ray.get([h.info.remote() for h in handles], timeout=actors.start_timeout_s)


def run_baseline_ingest(cfg: IngestJobConfig, on_result: Callable[[dict], None] | None = None) -> dict:
    """The old driver loop (Ray must be initialised). -> summary dict like run_ingest's, plus
    `driver_received_bytes` (notes + state bytes the driver got back) and `driver_received_pickled`
    (pickled size of every result dict). on_result(info) gets {doc_id, notes_bytes, state_bytes,
    pickled_bytes, n_tokens} per document."""
    # self-contained on purpose (the old pipeline.ingest helpers may go away): only pool, store, corpus,
    # archive_io and the DocRecord schema, which the old driver used
    from notebank.pipeline.archive_io import run_fingerprint
    from notebank.pipeline.corpus import iter_corpus
    from notebank.pipeline.pool import dispatch, stop_workers, worker_failure
    from notebank.pipeline.store import ArchiveStore, doc_key
    from notebank.schemas.manifest import DocRecord

    cfg.validate()
    t_start = time.perf_counter()
    store = ArchiveStore(cfg.output)
    store.clean_tmp()
    handles, infos = _start(cfg.model, cfg.actors)
    recv = {"payload": 0, "pickled": 0}
    try:
        i0 = infos[0]
        fp = run_fingerprint(i0["fingerprint"], i0["family"], i0["n_channels"], cfg.notebank, i0.get("tokenizer"))
        store.check_or_write_run(fp)
        tally = _Tally()
        nb = cfg.notebank.to_dict()

        def tasks():
            for row in iter_corpus(cfg.corpus, cfg.limit):
                key, kerr = doc_key(row.doc_id) if row.doc_id is not None else (None, None)
                base = dict(doc_id=row.doc_id, key=key, status="failed", source=row.source,
                            metadata=row.metadata, fingerprint=fp)
                if row.error or kerr:
                    tally.failed(row.doc_id, row.error or kerr, row.source)
                    continue
                base["text_sha256"] = hashlib.sha256(row.text.encode("utf-8")).hexdigest()
                yield {"doc_id": row.doc_id, "text": row.text, "base": base}

        def submit(actor, t):
            return actor.ingest_doc.remote({"doc_id": t["doc_id"], "text": t["text"]}, nb, cfg.block_size)

        def on_done(t, res, err):
            base = t["base"]
            if err is not None or not res["ok"]:
                rec = DocRecord(error=worker_failure(err) if err is not None else res["error"], **base)
                store.record_failure(rec)
                tally.failed(rec.doc_id, rec.error, rec.source)
                return
            n_pay = len(res["notes"]) + len(res["state"])
            n_pick = len(pickle.dumps(res, protocol=5))
            recv["payload"] += n_pay
            recv["pickled"] += n_pick
            base = {k: v for k, v in base.items() if k != "status"}
            rec = DocRecord(status="ok", n_tokens=res["n_tokens"], n_notes=res["n_notes"],
                            n_archived_tokens=res["n_archived_tokens"], timings=res["timings"], **base)
            rec = store.commit(base["key"], res["notes"], res["state"], rec)
            s = tally.stats
            s["docs_ok"] += 1
            s["tokens"] += rec.n_tokens
            s["notes"] += rec.n_notes
            s["bytes"] += rec.bytes
            if on_result:
                on_result({"doc_id": rec.doc_id, "notes_bytes": len(res["notes"]), "state_bytes": len(res["state"]),
                           "pickled_bytes": n_pick, "n_tokens": rec.n_tokens})

        dispatch(handles, tasks(), submit, on_done, max_in_flight=cfg.actors.max_in_flight)
    finally:
        stop_workers(handles)
    wall = time.perf_counter() - t_start
    return {**tally.stats, "wall_s": round(wall, 3),
            "tokens_per_s": round(tally.stats["tokens"] / wall, 1) if wall > 0 else 0.0, "output": cfg.output,
            "failures": tally.failures, "driver_received_bytes": recv["payload"],
            "driver_received_pickled": recv["pickled"]}


class _Tally:
    """The old run's counters and first 20 failures (pipeline.ingest.Tally without the progress bar)."""

    def __init__(self):
        self.stats = dict(docs_ok=0, docs_skipped=0, docs_failed=0, tokens=0, notes=0, bytes=0)
        self.failures: list[dict] = []

    def failed(self, doc_id, error: str, source) -> None:
        self.stats["docs_failed"] += 1
        if len(self.failures) < 20:
            self.failures.append({"doc_id": doc_id, "error": error, "source": source})
