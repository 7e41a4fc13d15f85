"""Reading corpus and question shards (JSONL or Parquet) from an fsspec URL or local path.

A URL may name one file, a folder (every *.jsonl, *.jsonl.gz, *.json, *.parquet below it, sorted) or a
glob. Rows are yielded lazily, shard by shard (Parquet in record batches), so the driver never holds
the corpus. A row that cannot be decoded (invalid UTF-8, bad JSON) or lacks required fields is yielded
with an error instead of raising: it is recorded as failed and the rest proceeds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator

import fsspec
import pyarrow.parquet as pq

from schemas.inputs import check_corpus_row, check_question_row

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")


@dataclass
class Row:
    source: dict                 # {"shard": url, "row": index within shard}
    doc_id: str | None = None
    text: str | None = None
    metadata: dict = field(default_factory=dict)
    error: str | None = None


def list_shards(url: str) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    fs, path = fsspec.core.url_to_fs(url)
    if any(c in path for c in "*?["):
        paths = sorted(p for p in fs.glob(path) if fs.isfile(p))
    elif fs.isdir(path):
        paths = sorted(p for p in fs.find(path) if p.endswith(SUFFIXES))
    elif fs.isfile(path):
        paths = [path]
    else:
        raise FileNotFoundError(f"{url}: no such file or folder")
    if not paths:
        raise FileNotFoundError(f"{url}: no .jsonl/.parquet shards found")
    bad = [p for p in paths if not p.endswith(SUFFIXES)]
    if bad:
        raise ValueError(f"{url}: unsupported shard type(s) {bad[:3]} (expected {SUFFIXES})")
    return fs, paths


def iter_raw_rows(fs, path: str, batch_rows: int = 64) -> Iterator[tuple[int, dict | None, str | None]]:
    """-> (row index, row dict or None, error or None)."""
    if path.endswith(".parquet"):
        with fs.open(path, "rb") as f:
            try:
                pf = pq.ParquetFile(f)
            except Exception as e:
                raise ValueError(f"{fs.unstrip_protocol(path)}: not a readable Parquet file: {e}") from e
            i = 0
            batches = pf.iter_batches(batch_size=batch_rows)
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                except Exception as e:
                    raise ValueError(f"{fs.unstrip_protocol(path)}: Parquet shard unreadable after row {i} "
                                     f"(truncated or corrupted?): {e}") from e
                for row in batch.to_pylist():
                    yield i, row, None
                    i += 1
        return
    compression = "gzip" if path.endswith(".gz") else None
    with fs.open(path, "rb", compression=compression) as f:
        for i, raw in enumerate(f):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield i, None, f"invalid UTF-8 at byte {e.start} of line {i + 1}"
                continue
            try:
                yield i, json.loads(line), None
            except json.JSONDecodeError as e:
                yield i, None, f"invalid JSON on line {i + 1}: {e.msg}"


def iter_corpus(url: str, limit: int | None = None) -> Iterator[Row]:
    fs, paths = list_shards(url)
    n = 0
    for path in paths:
        shard = fs.unstrip_protocol(path)
        for i, raw, err in iter_raw_rows(fs, path):
            if limit is not None and n >= limit:
                return
            n += 1
            src = {"shard": shard, "row": i}
            if err:
                yield Row(source=src, error=err)
                continue
            doc_id, text, meta, err = check_corpus_row(raw)
            yield Row(source=src, doc_id=doc_id, text=text, metadata=_jsonable(meta), error=err)


def read_questions(url: str) -> tuple[list[dict], list[dict]]:
    """-> (questions, rejected rows [{source, error, ...}]). Questions keep their input order."""
    fs, paths = list_shards(url)
    good, bad = [], []
    for path in paths:
        shard = fs.unstrip_protocol(path)
        for i, raw, err in iter_raw_rows(fs, path):
            src = {"shard": shard, "row": i}
            if err is None:
                q, err = check_question_row(raw)
            if err:
                bad.append({"source": src, "error": err, "question_id": (raw or {}).get("question_id") if isinstance(raw, dict) else None,
                            "doc_id": (raw or {}).get("doc_id") if isinstance(raw, dict) else None})
            else:
                q["source"] = src
                good.append(q)
    return good, bad


def _jsonable(meta: dict) -> dict:
    out = {}
    for k, v in meta.items():
        try:
            json.dumps(v)
            out[str(k)] = v
        except (TypeError, ValueError):
            out[str(k)] = repr(v)
    return out
