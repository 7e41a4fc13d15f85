"""Input row formats: corpus documents and questions (JSONL or Parquet, one row each).

corpus:    doc_id (str), text (str); any other fields are kept as metadata.
questions: question_id (str), doc_id (str), question (str), answers (optional list[str] or str).
Integer ids are accepted and turned into strings. Validation returns an error string, never raises,
so one bad row is recorded as failed and the rest proceed.
"""
from __future__ import annotations

VERSION = 1
CORPUS_REQUIRED = ("doc_id", "text")
QUESTION_REQUIRED = ("question_id", "doc_id", "question")


def _as_id(v):
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return str(v)
    return v if isinstance(v, str) and v != "" else None


def check_corpus_row(row: dict) -> tuple[str | None, str | None, dict, str | None]:
    """-> (doc_id, text, metadata, error)."""
    if not isinstance(row, dict):
        return None, None, {}, f"row is a {type(row).__name__}, expected an object"
    doc_id = _as_id(row.get("doc_id"))
    text = row.get("text")
    meta = {k: v for k, v in row.items() if k not in CORPUS_REQUIRED}
    if doc_id is None:
        return None, None, meta, f"missing or invalid doc_id ({row.get('doc_id')!r})"
    if not isinstance(text, str):
        return doc_id, None, meta, "missing text" if text is None else f"text is a {type(text).__name__}, expected a string"
    return doc_id, text, meta, None


def check_question_row(row: dict) -> tuple[dict | None, str | None]:
    """-> (normalised question dict, error)."""
    if not isinstance(row, dict):
        return None, f"row is a {type(row).__name__}, expected an object"
    q = {k: _as_id(row.get(k)) for k in ("question_id", "doc_id")}
    for k, v in q.items():
        if v is None:
            return None, f"missing or invalid {k} ({row.get(k)!r})"
    if not isinstance(row.get("question"), str) or not row["question"]:
        return None, "missing question"
    answers = row.get("answers")
    if isinstance(answers, str):
        answers = [answers]
    if answers is not None and not (isinstance(answers, (list, tuple)) and all(isinstance(a, str) for a in answers)):
        return None, f"answers must be a string or a list of strings, got {answers!r}"
    q.update(question=row["question"], answers=list(answers) if answers is not None else None)
    return q, None
