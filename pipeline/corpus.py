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

from notebank.schemas._base import open_parquet_file
from notebank.schemas.inputs import check_corpus_row, check_question_row

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
                pf = open_parquet_file(f)
            except Exception as e:
                raise ValueError(f"{fs.unstrip_protocol(path)}: not a readable Parquet file: {e}") from e
            i = 0
            batches = pf.iter_batches(batch_size=batch_rows, use_threads=False)
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


# ------------------------------------------------------------------------------------------------
# Shard scans and group reads for the Ray Data ingest/query (run inside Ray tasks, never the driver)

def shard_slug(url: str) -> str:
    """A file-name-safe, stable name for a shard: its base name plus a hash of the whole URL."""
    import hashlib
    import posixpath
    import re as _re
    base = posixpath.basename(url.rstrip("/"))
    for suf in SUFFIXES:
        if base.endswith(suf):
            base = base[: -len(suf)]
            break
    base = _re.sub(r"[^A-Za-z0-9_.=-]+", "_", base)[:60] or "shard"
    return f"{base}-{hashlib.sha1(url.encode()).hexdigest()[:8]}"


def _text_sha(text) -> str | None:
    import hashlib
    return hashlib.sha256(text.encode("utf-8")).hexdigest() if isinstance(text, str) else None


def iter_shard(url: str, seek: dict | None = None):
    """-> (row index, parsed row or None, error or None, seek point) of one shard, from `seek` on
    ({"offset": bytes, "row": i} for plain JSONL; {"row": i} for Parquet: whole row groups before it
    are skipped; gzip is read from the start). Raises ShardError when the shard cannot be read further."""
    fs, path = fsspec.core.url_to_fs(url)
    try:
        if path.endswith(".jsonl") or path.endswith(".json"):
            yield from _iter_jsonl_at(fs, path, seek or {})
            return
        if path.endswith(".parquet") and seek:
            yield from _iter_parquet_at(fs, path, int(seek.get("row", 0)))
            return
        for i, raw, err in iter_raw_rows(fs, path):
            yield i, raw, err, {"row": i}
    except (ValueError, OSError, EOFError) as e:   # truncated/corrupt Parquet, unreadable gzip ...
        raise ShardError(str(e)) from e


def _iter_jsonl_at(fs, path: str, seek: dict):
    off, i = int(seek.get("offset", 0)), int(seek.get("row", 0))
    with fs.open(path, "rb") as f:
        if off:
            f.seek(off)
        for raw in f:
            here, off = off, off + len(raw)
            if raw.strip():
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield i, None, f"invalid UTF-8 at byte {e.start} of line {i + 1}", {"offset": here, "row": i}
                    i += 1
                    continue
                try:
                    yield i, json.loads(line), None, {"offset": here, "row": i}
                except json.JSONDecodeError as e:
                    yield i, None, f"invalid JSON on line {i + 1}: {e.msg}", {"offset": here, "row": i}
            i += 1


def _iter_parquet_at(fs, path: str, row: int):
    with fs.open(path, "rb") as f:
        try:
            pf = open_parquet_file(f)
        except Exception as e:
            raise ValueError(f"{fs.unstrip_protocol(path)}: not a readable Parquet file: {e}") from e
        first, groups = 0, []
        for k in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(k).num_rows
            if first + n > row:
                groups.append(k)
            elif not groups:
                first += n
        i = first
        for k in groups:
            try:
                t = pf.read_row_group(k, use_threads=False)
            except Exception as e:
                raise ValueError(f"{fs.unstrip_protocol(path)}: Parquet shard unreadable after row {i} "
                                 f"(truncated or corrupted?): {e}") from e
            for r in t.to_pylist():
                yield i, r, None, {"row": i}
                i += 1


class ShardError(RuntimeError):
    """A shard could not be read (any further): recorded as failed, the other shards go on."""


def scan_corpus_shard(item: dict) -> dict:
    """Ray Data map fn: {"shard": url} -> {"shard", "rows": JSON [[row, doc_id, text_sha256, error]],
    "shard_error"}. Reads ids and hashes only; the text stays in the task."""
    rows, shard_err = [], None
    try:
        for i, raw, err, at in iter_shard(item["shard"]):
            if err:
                rows.append([i, None, None, err, at])
                continue
            doc_id, text, _meta, err = check_corpus_row(raw)
            rows.append([i, doc_id, _text_sha(text), err, at])
    except ShardError as e:
        shard_err = str(e)
    return {"shard": item["shard"], "rows": json.dumps(rows), "shard_error": shard_err}


def read_corpus_group(item: dict) -> list[dict]:
    """Ray Data flat_map fn: {"shard", "group", "seek", "plan": JSON {row: [action, reason, extra]}} ->
    [{"group", "payload": JSON [doc dicts]}]: one group's planned rows, read from its seek point."""
    want = {int(r): d for r, d in json.loads(item["plan"]).items()}
    docs = []
    shard = item["shard"]
    try:
        for i, raw, err, _at in iter_shard(shard, json.loads(item["seek"])):
            if i not in want:
                if want and i > max(want):
                    break
                continue
            action, reason, extra = want.pop(i)
            doc = {"row": i, "shard": shard, "action": action, "reason": reason, **(extra or {})}
            if action in ("ingest", "append"):
                doc_id, text, meta, err2 = check_corpus_row(raw) if raw is not None else (None, None, {}, err)
                doc.update(doc_id=doc_id, text=text, metadata=_jsonable(meta))
            docs.append(doc)
            if not want:
                break
    except ShardError as e:
        for i in want:
            docs.append({"row": i, "shard": shard, "action": "fail", "reason": f"shard unreadable: {e}"})
    return [{"group": item["group"], "payload": json.dumps(docs)}] if docs else []


def scan_question_shard(item: dict) -> dict:
    """Ray Data map fn: {"shard"} -> {"shard", "rows": JSON [[row, question_id, doc_id, error]], "shard_error"}."""
    rows, shard_err = [], None
    try:
        for i, raw, err, _at in iter_shard(item["shard"]):
            if err is None:
                q, err = check_question_row(raw)
            else:
                q = None
            qid = q["question_id"] if q else (raw.get("question_id") if isinstance(raw, dict) else None)
            did = q["doc_id"] if q else (raw.get("doc_id") if isinstance(raw, dict) else None)
            rows.append([i, None if qid is None else str(qid), None if did is None else str(did), err])
    except ShardError as e:
        shard_err = str(e)
    return {"shard": item["shard"], "rows": json.dumps(rows), "shard_error": shard_err}


def read_question_rows(item: dict) -> list[dict]:
    """Ray Data flat_map fn: {"shard", "keep": JSON {row: [methods]}, optional "retried": JSON {row:
    [methods that failed in an earlier run]}} -> question rows to answer."""
    keep = {int(k): v for k, v in json.loads(item["keep"]).items()}
    retried = {int(k): v for k, v in json.loads(item.get("retried") or "{}").items()}
    out = []
    try:
        for i, raw, err, _at in iter_shard(item["shard"]):
            if i not in keep or err:
                continue
            q, err = check_question_row(raw)
            if q is None:
                continue
            out.append({"doc_id": q["doc_id"], "question_id": q["question_id"], "question": q["question"],
                        "answers": json.dumps(q["answers"]), "methods": json.dumps(keep[i]),
                        "retried": json.dumps(retried.get(i, [])),
                        "source_shard": item["shard"], "source_row": i})
    except ShardError:
        pass   # the scan saw the same failure: those rows were never planned
    return out
