"""Notes Parquet: one file per document, one row per note, in write order.

Addresses are BF16 values stored as their raw 16-bit patterns (pyarrow has no bfloat16):
``fixed_size_list<uint16>[J * d_rho]``, row-major over [channel, coordinate]. Recover them with
``torch.from_numpy(a.reshape(N, J, d_rho)).view(torch.bfloat16)``. The schema metadata says so
(``addresses.encoding``, ``addresses.shape``) and also carries what makes the file self-describing:
the model fingerprint, the NoteBank config and the document's token count.
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from notebank.schemas._base import SchemaError, check_table, schema_meta, with_meta

NAME = "notes"
VERSION = 1
ADDRESS_ENCODING = "bfloat16-bits-as-uint16"


def notes_schema(n_channels: int, addr_dim: int, *, model_fingerprint: str = "", notebank: dict | None = None,
                 n_tokens: int = 0, doc_id: str = "") -> pa.Schema:
    if n_channels <= 0 or addr_dim <= 0:
        raise SchemaError(f"notes schema needs positive n_channels and addr_dim, got {n_channels}, {addr_dim}")
    fields = [
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("note_index", pa.int32(), nullable=False),
        pa.field("chunk_index", pa.int64(), nullable=False),
        pa.field("start", pa.int64(), nullable=False),
        pa.field("end", pa.int64(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("addresses", pa.list_(pa.uint16(), n_channels * addr_dim), nullable=False),
    ]
    return with_meta(pa.schema(fields), NAME, VERSION, {
        "addresses.encoding": ADDRESS_ENCODING,
        "addresses.shape": json.dumps(["J", "d_rho"]),
        "n_channels": n_channels,
        "addr_dim": addr_dim,
        "model_fingerprint": model_fingerprint,
        "notebank": json.dumps(notebank or {}, sort_keys=True),
        "n_tokens": n_tokens,
        "doc_id": doc_id,
    })


def build_notes_table(doc_id: str, token_ids: list, starts, ends, chunk_index, address_bits: np.ndarray, *,
                      n_channels: int, addr_dim: int, model_fingerprint: str, notebank: dict, n_tokens: int) -> pa.Table:
    """address_bits: uint16 array [N, J, d_rho] (BF16 bit patterns)."""
    n = len(token_ids)
    address_bits = np.ascontiguousarray(address_bits, dtype=np.uint16)
    if address_bits.shape != (n, n_channels, addr_dim):
        raise SchemaError(f"notes for {doc_id!r}: addresses shape {address_bits.shape} != {(n, n_channels, addr_dim)}")
    for name, arr in (("starts", starts), ("ends", ends), ("chunk_index", chunk_index)):
        if len(arr) != n:
            raise SchemaError(f"notes for {doc_id!r}: {name} has {len(arr)} entries for {n} notes")
    schema = notes_schema(n_channels, addr_dim, model_fingerprint=model_fingerprint, notebank=notebank,
                          n_tokens=n_tokens, doc_id=doc_id)
    flat = pa.array(address_bits.reshape(-1), type=pa.uint16())
    offsets = np.zeros(n + 1, np.int32)
    if n:
        offsets[1:] = np.cumsum([len(z) for z in token_ids])
    values = np.concatenate([np.asarray(z, np.int32) for z in token_ids]) if n else np.zeros(0, np.int32)
    table = pa.Table.from_arrays([
        pa.array([doc_id] * n, pa.string()),
        pa.array(np.arange(n, dtype=np.int32)),
        pa.array(np.asarray(chunk_index, np.int64)),
        pa.array(np.asarray(starts, np.int64)),
        pa.array(np.asarray(ends, np.int64)),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int32())),
        pa.FixedSizeListArray.from_arrays(flat, n_channels * addr_dim),
    ], schema=schema)
    validate_notes_table(table, where=f"notes for {doc_id!r}")
    return table


def validate_notes_table(table: pa.Table, where: str = "notes table") -> dict:
    """Check a notes table (freshly built or read back). Returns its parsed metadata."""
    meta = schema_meta(table.schema)
    try:
        j, d = int(meta["n_channels"]), int(meta["addr_dim"])
    except (KeyError, ValueError) as e:
        raise SchemaError(f"{where}: notes schema metadata lacks n_channels/addr_dim ({meta})") from e
    if meta.get("addresses.encoding") != ADDRESS_ENCODING:
        raise SchemaError(f"{where}: addresses.encoding {meta.get('addresses.encoding')!r} != {ADDRESS_ENCODING!r}")
    expected = notes_schema(j, d, model_fingerprint=meta.get("model_fingerprint", ""),
                            notebank=json.loads(meta.get("notebank", "{}")), n_tokens=int(meta.get("n_tokens", 0)),
                            doc_id=meta.get("doc_id", ""))
    check_table(table, expected, where)
    n = table.num_rows
    if n:
        idx = table.column("note_index").to_numpy()
        if not np.array_equal(idx, np.arange(n)):
            raise SchemaError(f"{where}: note_index is not 0..{n - 1} in order")
        starts, ends = table.column("start").to_numpy(), table.column("end").to_numpy()
        if (starts < 0).any() or (ends < starts).any():
            raise SchemaError(f"{where}: some note has start < 0 or end < start")
        doc_ids = set(table.column("doc_id").to_pylist())
        if doc_ids != {meta.get("doc_id")}:
            raise SchemaError(f"{where}: doc_id column {sorted(doc_ids)[:3]} != metadata doc_id {meta.get('doc_id')!r}")
    return {"n_channels": j, "addr_dim": d, "model_fingerprint": meta.get("model_fingerprint", ""),
            "notebank": json.loads(meta.get("notebank", "{}")), "n_tokens": int(meta.get("n_tokens", 0)),
            "doc_id": meta.get("doc_id", "")}


def address_bits(table: pa.Table) -> np.ndarray:
    """uint16 [N, J, d_rho] from a validated notes table."""
    meta = schema_meta(table.schema)
    j, d = int(meta["n_channels"]), int(meta["addr_dim"])
    col = table.column("addresses").combine_chunks()
    flat = col.values.to_numpy(zero_copy_only=False) if len(col) else np.zeros(0, np.uint16)
    return np.asarray(flat, np.uint16).reshape(table.num_rows, j, d)


def token_id_lists(table: pa.Table) -> list:
    col = table.column("token_ids").combine_chunks()
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    return [values[offsets[i]:offsets[i + 1]].copy() for i in range(len(col))]
