"""Batch QA over an ingest output: questions grouped by document, each group answered by one
memory-holding actor (pipeline.actors.QueryActor, NoteBank or MoNe) that loads the document's memory
once, every configured method per question. Output: answers dataset (schemas.answers)."""
from __future__ import annotations

import dataclasses

from nbcore.config import ReadConfig
from notebank.pipeline.config import QueryJobConfig
from notebank.pipeline.worker import _rc_json
from notebank.schemas._base import table_to_parquet_bytes
from notebank.schemas.answers import answers_table

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
    """Questions -> answers dataset (pipeline.dataplane.query_dataset, on Ray Data), for both memories
    (`memory: notebank | mone`); a query with the other memory than the archive holds is refused.
    `workers` is accepted for compatibility and unused."""
    cfg.validate()
    from notebank.pipeline.dataplane import query_dataset
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


def _fail(q, rc, why):
    return {"question_id": q["question_id"], "doc_id": q["doc_id"], "method": rc["method"],
            "read_config": _rc_json(ReadConfig(**rc)), "status": "failed", "error": why, "answers": q.get("answers")}
