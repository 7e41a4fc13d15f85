"""Archive layout v2: a notes *dataset*, a documents table and group commit records.

Layout under an ingest output URL (written by pipeline/archive.py):

    _lease.json                          the live writer's lease (pipeline.safety): one writer at a time
    manifest/_run.json                   run fingerprint (model, tokenizer, NoteBank config, layout version)
    manifest/commits/<group>.json        CommitRecord: the commit marker of one group of documents
    notes/<group>.parquet                notes v2: many documents per file, one row per note
    documents/<group>.parquet            documents v1: one row per document of the group (ok or failed)
    state/<key>.g<gen>.safetensors       one document's retained state (+ writer carry), small states
    state/<key>.g<gen>/part-00000-of-00003.safetensors   ... or in pieces above `state_piece_bytes`

A *group* is a fixed run of corpus rows (one shard, rows [lo, hi)), so a rerun rebuilds exactly the
same groups and, archives being deterministic, the same bytes. A group is committed iff its commit
record exists and every file it names has the recorded size (and sha256, with verify). Data files
hold no timestamps; commit records do. `gen` counts appends: 0 for the first ingest of a document.

The notes and documents folders are plain Parquet datasets: ``pyarrow.dataset.dataset(root +
"/notes")``, duckdb ``read_parquet('root/notes/*.parquet')``, polars and ``ray.data.read_parquet``
read all documents as one table, with the right values per row (``doc_id`` is a column, not file
metadata). A document's live notes are the rows with its ``doc_id`` and ``generation`` <= its current
generation (appends add rows, never change old ones); its live documents row is the one with the
highest ``generation``.
"""
from __future__ import annotations

import json
import urllib.parse
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import pyarrow as pa

from notebank.schemas._base import SchemaError, check_table, dumps_json, schema_meta, with_meta
from notebank.schemas.manifest import FileRef  # noqa: F401 (part of this layout's API)

LAYOUT_VERSION = 2
NOTES_NAME, NOTES_VERSION = "notes", 2
DOCUMENTS_NAME, DOCUMENTS_VERSION = "documents", 1
COMMIT_NAME, COMMIT_VERSION = "manifest.commit", 2
ADDRESS_ENCODING = "bfloat16-bits-as-uint16"
#: Parquet row groups of the notes dataset: ~1-4 MB for typical J * d_rho (scan-friendly, not tiny).
NOTES_ROW_GROUP = 4096
_KEY_SAFE = "-_.=+@,"


def doc_key(doc_id: str) -> tuple[str | None, str | None]:
    """File-name key of a document (the `<key>` of state/<key>.g<gen>...) -> (key, error). Keys never
    contain a path separator: a doc_id that would escape the output folder gets an error instead."""
    if not isinstance(doc_id, str) or doc_id == "":
        return None, "empty doc_id"
    if "/" in doc_id or "\\" in doc_id or "\x00" in doc_id:
        return None, f"doc_id {doc_id!r} contains a path separator and would escape the output folder"
    if doc_id.startswith("."):
        return None, f"doc_id {doc_id!r} starts with '.' (reserved: '.', '..' and hidden names)"
    if any(ord(c) < 32 for c in doc_id):
        return None, f"doc_id {doc_id!r} contains control characters"
    key = urllib.parse.quote(doc_id, safe=_KEY_SAFE)
    if len(key.encode()) > 200:
        return None, f"doc_id is too long for a file name ({len(key.encode())} bytes when quoted, max 200)"
    return key, None


def notes_schema(n_slots: int, addr_dim: int) -> pa.Schema:
    """n_slots: address slots per note (J channels x addr_positions)."""
    if n_slots <= 0 or addr_dim <= 0:
        raise SchemaError(f"notes schema needs positive n_slots and addr_dim, got {n_slots}, {addr_dim}")
    f = pa.field
    return with_meta(pa.schema([
        f("doc_id", pa.string(), nullable=False),
        f("generation", pa.int32(), nullable=False),       # the append generation that wrote the note
        f("note_index", pa.int32(), nullable=False),       # 0.. within the document, write order
        f("chunk_index", pa.int64(), nullable=False),
        f("start", pa.int64(), nullable=False),            # token positions in the document, [start, end)
        f("end", pa.int64(), nullable=False),
        f("token_ids", pa.list_(pa.int32()), nullable=False),
        f("text", pa.string()),                            # token_ids decoded with the model's tokenizer
        f("addresses", pa.list_(pa.uint16(), n_slots * addr_dim), nullable=False),
    ]), NOTES_NAME, NOTES_VERSION, {
        "addresses.encoding": ADDRESS_ENCODING,
        "addresses.shape": json.dumps(["slots", "d_rho"]),
        "n_slots": n_slots,
        "addr_dim": addr_dim,
    })


def notes_table(rows: list[dict], n_slots: int, addr_dim: int) -> pa.Table:
    """rows: {doc_id, generation, note_index, chunk_index, start, end, token_ids, text,
    addresses: uint16 array [n_slots * addr_dim] (BF16 bit patterns)}."""
    schema = notes_schema(n_slots, addr_dim)
    n = len(rows)
    width = n_slots * addr_dim
    bits = np.zeros((n, width), np.uint16)
    for i, r in enumerate(rows):
        a = np.asarray(r["addresses"], np.uint16).reshape(-1)
        if a.shape != (width,):
            raise SchemaError(f"note {i} of {r.get('doc_id')!r}: {a.size} address values, expected {width}")
        bits[i] = a
    lens = [len(r["token_ids"]) for r in rows]
    offsets = np.zeros(n + 1, np.int32)
    if n:
        offsets[1:] = np.cumsum(lens)
    values = (np.concatenate([np.asarray(r["token_ids"], np.int32) for r in rows]) if n
              else np.zeros(0, np.int32))
    table = pa.Table.from_arrays([
        pa.array([r["doc_id"] for r in rows], pa.string()),
        pa.array([int(r["generation"]) for r in rows], pa.int32()),
        pa.array([int(r["note_index"]) for r in rows], pa.int32()),
        pa.array([int(r["chunk_index"]) for r in rows], pa.int64()),
        pa.array([int(r["start"]) for r in rows], pa.int64()),
        pa.array([int(r["end"]) for r in rows], pa.int64()),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int32())),
        pa.array([r.get("text") for r in rows], pa.string()),
        pa.FixedSizeListArray.from_arrays(pa.array(bits.reshape(-1), pa.uint16()), width),
    ], schema=schema)
    validate_notes_table(table, "notes table")
    return table


def validate_notes_table(table: pa.Table, where: str) -> dict:
    meta = schema_meta(table.schema)
    if meta.get("notebank.schema") == NOTES_NAME and meta.get("notebank.schema_version") == "1":
        raise SchemaError(f"{where}: notes schema version 1 (one file per document, layout 1): this version "
                          f"reads layout {LAYOUT_VERSION} only; re-ingest the corpus into a new output folder")
    try:
        j, d = int(meta["n_slots"]), int(meta["addr_dim"])
    except (KeyError, ValueError) as e:
        raise SchemaError(f"{where}: notes schema metadata lacks n_slots/addr_dim ({meta})") from e
    check_table(table, notes_schema(j, d), where)
    if table.num_rows:
        s, e = table.column("start").to_numpy(), table.column("end").to_numpy()
        if (s < 0).any() or (e < s).any():
            raise SchemaError(f"{where}: some note has start < 0 or end < start")
    return {"n_slots": j, "addr_dim": d}


def address_bits(table: pa.Table) -> np.ndarray:
    """uint16 [N, slots, d_rho] of a validated notes table."""
    meta = schema_meta(table.schema)
    j, d = int(meta["n_slots"]), int(meta["addr_dim"])
    col = table.column("addresses").combine_chunks()
    flat = col.values.to_numpy(zero_copy_only=False) if len(col) else np.zeros(0, np.uint16)
    return np.asarray(flat, np.uint16).reshape(table.num_rows, j, d)


def token_id_lists(table: pa.Table) -> list[np.ndarray]:
    col = table.column("token_ids").combine_chunks()
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    return [values[offsets[i]:offsets[i + 1]].copy() for i in range(len(col))]


# ------------------------------------------------------------------------------------------------
# documents table

def documents_schema() -> pa.Schema:
    f = pa.field
    return with_meta(pa.schema([
        f("doc_id", pa.string(), nullable=False),
        f("key", pa.string()),                              # file-name key (None for unusable ids)
        f("generation", pa.int32(), nullable=False),
        f("status", pa.string(), nullable=False),           # ok | failed
        f("error", pa.string()),
        f("memory", pa.string(), nullable=False),           # notebank | mone
        f("n_tokens", pa.int64(), nullable=False),          # whole document so far (all generations)
        f("n_notes", pa.int64(), nullable=False),           # live notes of the document
        f("n_archived_tokens", pa.int64(), nullable=False),
        f("text_sha256", pa.string()),                      # of this generation's text
        f("source_shard", pa.string()),
        f("source_row", pa.int64()),
        f("metadata", pa.string()),                         # JSON of the row's extra fields
        f("model_fingerprint", pa.string(), nullable=False),
        f("tokenizer", pa.string()),                        # tokenizer name/path
        f("tokenizer_hash", pa.string()),
        f("notebank", pa.string()),                         # JSON of the NoteBank config
        f("group", pa.string(), nullable=False),
        f("notes_file", pa.string()),                       # relative path of the notes part
        f("state_files", pa.list_(pa.string())),            # relative paths, in piece order
        f("state_bytes", pa.int64()),
    ]), DOCUMENTS_NAME, DOCUMENTS_VERSION)


DOCUMENT_COLUMNS = documents_schema().names


def documents_table(rows: list[dict]) -> pa.Table:
    table = pa.Table.from_pylist([{c: r.get(c) for c in DOCUMENT_COLUMNS} for r in rows], schema=documents_schema())
    check_table(table, documents_schema(), "documents table")
    return table


def validate_documents_table(table: pa.Table, where: str) -> None:
    check_table(table, documents_schema(), where)


# ------------------------------------------------------------------------------------------------
# commit records

@dataclass
class DocEntry:
    """One document of a group, as committed."""
    doc_id: str | None
    key: str | None
    status: str                         # ok | failed | skipped (same text already committed)
    error: str | None = None
    generation: int = 0
    n_tokens: int = 0
    n_notes: int = 0                    # notes written by this generation
    text_sha256: str | None = None
    source: dict | None = None          # {"shard": url, "row": i}
    state: list = field(default_factory=list)   # FileRefs of the state pieces
    retried: bool = False               # the row had failed in an earlier run and was tried again


@dataclass
class CommitRecord:
    group: str
    fingerprint_digest: str             # of manifest/_run.json's fingerprint
    documents: list                     # DocEntry
    notes: FileRef | None = None        # None when the group wrote no note
    documents_file: FileRef | None = None
    committed_at: str | None = None
    timings: dict = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        d = asdict(self)
        return dumps_json({"schema": COMMIT_NAME, "schema_version": COMMIT_VERSION, **d})

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "CommitRecord":
        try:
            d = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SchemaError(f"{where}: commit record is not valid JSON (truncated?): {e}") from e
        if d.pop("schema", None) != COMMIT_NAME or d.pop("schema_version", None) != COMMIT_VERSION:
            raise SchemaError(f"{where}: not a {COMMIT_NAME} v{COMMIT_VERSION} record")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise SchemaError(f"{where}: unknown commit record fields {sorted(unknown)}")
        try:
            docs = []
            for e in d.pop("documents"):
                e["state"] = [FileRef(**r) for r in e.get("state") or []]
                docs.append(DocEntry(**e))
            for k in ("notes", "documents_file"):
                if d.get(k) is not None:
                    d[k] = FileRef(**d[k])
            return cls(documents=docs, **d)
        except (TypeError, KeyError) as e:
            raise SchemaError(f"{where}: commit record fields not understood: {e}") from e

    def files(self) -> list[FileRef]:
        out = [r for r in (self.notes, self.documents_file) if r is not None]
        for e in self.documents:
            out += list(e.state)
        return out
