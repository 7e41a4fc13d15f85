"""Batch QA over an ingest output: questions grouped by document, each group answered by one
state-holding actor that loads the document's state and notes once (every answer works on its own
copy of the state), every configured method per question. Output: answers Parquet (schemas.answers)."""
from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from typing import Callable

from nbcore.config import ReadConfig
from pipeline.config import QueryJobConfig
from pipeline.corpus import read_questions
from pipeline.pool import dispatch, start_workers, worker_failure, worker_pool
from pipeline.store import ArchiveStore, FingerprintMismatch, doc_key, is_process_local
from pipeline.worker import _rc_json
from schemas._base import table_to_parquet_bytes
from schemas.answers import answers_table
from schemas.manifest import DocRecord


def score_fn():
    """-> (fn(prediction, references) -> 0..100, metric name). RULER's string_match_all from
    nbcore.tasks.ruler when that module exists, else the same rule implemented here."""
    try:
        from nbcore.tasks import ruler
    except ImportError:
        return substring_score, "substring_match_all"
    if hasattr(ruler, "string_match_all"):
        return (lambda p, refs: float(ruler.string_match_all([p or ""], [list(refs)]))), "nbcore.tasks.ruler.string_match_all"
    return (lambda p, refs: float(ruler.score("niah_single_1", p or "", refs))), "nbcore.tasks.ruler.score"


def substring_score(prediction: str, references: list[str]) -> float:
    """Mean over references of case-insensitive substring presence, x100 (RULER string_match_all)."""
    if not references:
        return 0.0
    p = (prediction or "").lower()
    return round(100.0 * sum(r.lower() in p for r in references) / len(references), 2)


def _rc_dict(rc) -> dict:
    d = dataclasses.asdict(rc)
    d["stop"] = tuple(d.get("stop") or ())
    return d


def run_query(cfg: QueryJobConfig, workers: tuple | None = None) -> dict:
    """Questions -> answers dataset (pipeline.dataplane.query_dataset, on Ray Data). `memory: mone`
    answers from per-document MoNe states instead (pipeline.mone_pipeline)."""
    cfg.validate()
    if cfg.memory == "mone":
        from pipeline.mone_pipeline import run_query_mone
        return run_query_mone(cfg, workers=workers)
    from pipeline.dataplane import query_dataset
    return query_dataset(cfg)


def rc_json(rc) -> str:
    return _rc_json(rc)


def answer_rows_table(rows: list[dict]):
    for r in rows:
        r.pop("trace", None)
    rows.sort(key=lambda r: (r["doc_id"], r["question_id"], r["method"]))
    return answers_table(rows)


def write_rejected(out, rejected: list[dict], methods: list[str], provenance: dict) -> list[dict]:
    """Failed rows for questions that were not answered (bad rows, duplicates, unknown documents),
    written by the driver as one answers part. -> the rows."""
    import hashlib
    import json as _json
    rows = []
    for r in rejected:
        for m in (r.get("methods") or ["-"]):
            rows.append({"question_id": str(r["question_id"]), "doc_id": str(r.get("doc_id") or ""), "method": m,
                         "read_config": "{}", "status": "failed", "error": r["error"],
                         "source_shard": r.get("source_shard"), "source_row": r.get("source_row"), **provenance})
    key = hashlib.sha1(_json.dumps(sorted((r["question_id"], r["method"], r["source_row"] or 0) for r in rows)).encode()).hexdigest()[:16]
    out.atomic_write(f"part-rejected-{key}.parquet", table_to_parquet_bytes(answer_rows_table(rows)))
    return rows


# ------------------------------------------------------------------------------------------------
# shared with the `memory: mone` driver (pipeline.mone_pipeline.run_query_mone)

def open_archive(archive: str) -> tuple[ArchiveStore, dict]:
    """-> (store, run record) of an ingest output; FileNotFoundError when `archive` is none."""
    store = ArchiveStore(archive)
    run = store.read_run()
    if run is None:
        raise FileNotFoundError(f"{archive}: not an ingest output (no {store.url_of(store.REL_RUN)})")
    return store, run


def check_fingerprints(store: ArchiveStore, run: dict, info: dict, written: str) -> None:
    """The actors' model and tokenizer must be those the `written` archives/states were made with."""
    for what, mine in (("model", info["fingerprint"]), ("tokenizer", info.get("tokenizer"))):
        theirs = run["fingerprint"].get(what)
        if mine != theirs:
            raise FingerprintMismatch(
                f"{store.url_of(store.REL_RUN)}: {written} were written with {what} {theirs!r}, but the "
                f"configured {what} is {mine!r}")


def answer_documents(cfg, store: ArchiveStore, handles: list, questions: list[dict], gen, *,
                     fail_rows: Callable[[list[dict], str], list[dict]], record_cls, payload: Callable[[str], dict],
                     stored: str) -> list[dict]:
    """Questions grouped by document, one actor call answer_doc(doc, questions, gen) per document.
    Questions of a document that is not `stored` (or failed at ingest), or whose call fails, get
    fail_rows(questions, why). The document travels inline (payload(key)) when the archive is local
    to this process, else by reference. -> answer rows, unordered."""
    groups: "OrderedDict[str, list]" = OrderedDict()
    for q in questions:
        groups.setdefault(q["doc_id"], []).append(q)
    inline = is_process_local(cfg.archive)
    rows: list[dict] = []
    bar = _bar(cfg.progress, len(questions))

    def tasks():
        for doc_id, qs in groups.items():
            key, kerr = doc_key(doc_id)
            rec = store.load_record(key, record_cls) if key else None
            if rec is None or rec.status != "ok":
                why = kerr or (f"document {doc_id!r} is not {stored} in {cfg.archive}" if rec is None
                               else f"document {doc_id!r} failed at ingest: {rec.error}")
                rows.extend(fail_rows(qs, why))
                bar.update(len(qs))
                continue
            doc = {"payload": payload(key)} if inline else {"archive": cfg.archive, "key": key}
            yield {"doc": doc, "questions": [{k: q[k] for k in ("question_id", "doc_id", "question", "answers")}
                                             for q in qs]}

    def submit(actor, t):
        return actor.answer_doc.remote(t["doc"], t["questions"], gen)

    def on_done(t, res, err):
        if err is not None:
            res = fail_rows(t["questions"], worker_failure(err))
        rows.extend(res)
        bar.update(len(t["questions"]))

    dispatch(handles, tasks(), submit, on_done, max_in_flight=cfg.actors.max_in_flight)
    bar.close()
    return rows


def write_answers(output: str, rows: list[dict], rejected: list[dict], t_start: float, **extra) -> dict:
    """Add a failed row per rejected question row, score, sort and commit the answers Parquet.
    -> the job summary (`extra` goes before mean_score)."""
    for r in rejected:
        rows.append({"question_id": str(r.get("question_id") or f"<row {r['source']['row']}>"),
                     "doc_id": str(r.get("doc_id") or ""), "method": "-", "read_config": "{}",
                     "status": "failed", "error": f"bad question row ({r['source']['shard']}:{r['source']['row']}): "
                                                  f"{r['error']}"})
    fn, metric = score_fn()
    for r in rows:
        r.pop("trace", None)
        if r.get("status") == "ok" and r.get("answers"):
            r["score"] = float(fn(r["answer"], r["answers"]))
    rows.sort(key=lambda r: (r["doc_id"], r["question_id"], r["method"]))
    _write_atomic(output, table_to_parquet_bytes(answers_table(rows)))
    by_q: dict[str, bool] = {}
    for r in rows:
        by_q[r["question_id"]] = by_q.get(r["question_id"], True) and r["status"] == "ok"
    per_method: dict[str, list] = {}
    for r in rows:
        if r.get("score") is not None:
            per_method.setdefault(r["method"], []).append(r["score"])
    return {"questions_ok": sum(by_q.values()), "questions_failed": sum(not v for v in by_q.values()),
            "rows": len(rows), "wall_s": round(time.perf_counter() - t_start, 3), "output": output,
            "metric": metric if per_method else None, **extra,
            "mean_score": {m: round(sum(v) / len(v), 4) for m, v in sorted(per_method.items())}}


def _fail(q, rc, why):
    return {"question_id": q["question_id"], "doc_id": q["doc_id"], "method": rc["method"],
            "read_config": _rc_json(ReadConfig(**rc)), "status": "failed", "error": why, "answers": q.get("answers")}


def _write_atomic(url: str, data: bytes) -> None:
    import posixpath
    import uuid

    import fsspec
    fs, path = fsspec.core.url_to_fs(url)
    fs.makedirs(posixpath.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    fs.pipe_file(tmp, data)
    fs.mv(tmp, path)


class _NoBar:
    def update(self, n=1): pass
    def close(self): pass


def _bar(enabled, total):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, unit="q", desc="query", mininterval=1.0, dynamic_ncols=True)
