"""Archive <-> bytes: notes Parquet (schemas.notes) and the retained state (safetensors).

Both encodings are deterministic: the same archive/state gives the same bytes.
"""
from __future__ import annotations

import json

import numpy as np
import torch

from nbcore.config import NoteBankConfig
from nbcore.notebank.archive import Archive
from notebank.schemas import notes as notes_schema
from notebank.schemas._base import SchemaError, parquet_bytes_to_table, table_to_parquet_bytes
from notebank.pipeline.archive import safetensors_metadata
from notebank.pipeline.store import ArchiveError, FingerprintMismatch

STATE_FORMAT = "notebank.state"
STATE_VERSION = 1
SCHEMA_VERSIONS = {"notes": notes_schema.VERSION, "state": STATE_VERSION, "manifest": 1}


def run_fingerprint(model_fingerprint: str, family: str, n_channels: int, nb: NoteBankConfig,
                    tokenizer: str | None = None) -> dict:
    """What every archive in an output folder is a pure function of (besides the documents)."""
    return {
        "model": model_fingerprint,
        "tokenizer": tokenizer,
        "family": family,
        "n_channels": int(n_channels),
        "notebank": nb.to_dict(),
        "notebank_digest": nb.digest(),
        "projection_seed": nb.seed,
        "schema_versions": dict(SCHEMA_VERSIONS),
    }


def archive_to_notes_bytes(doc_id: str, archive: Archive, n_channels: int) -> bytes:
    """n_channels: the model's J. With addr_positions m > 1 (variants beyond the paper) a note has J*m
    address slots (channel-major); the file's `n_channels` field then counts slots, and its
    `notebank.addr_positions` says how to read them."""
    addr = archive.addresses
    if addr.dtype != torch.bfloat16:
        raise SchemaError(f"notes for {doc_id!r}: addresses must be bfloat16, got {addr.dtype}")
    slots = n_channels * archive.config.addr_positions
    bits = addr.detach().cpu().contiguous().view(torch.uint16).numpy()
    if bits.ndim != 3:
        bits = bits.reshape(len(archive), slots, archive.config.addr_dim)
    table = notes_schema.build_notes_table(
        doc_id, archive.token_ids, archive.starts, archive.ends, archive.chunk_index, bits,
        n_channels=slots, addr_dim=archive.config.addr_dim, model_fingerprint=archive.model_fingerprint,
        notebank=archive.config.to_dict(), n_tokens=int(archive.n_tokens))
    return table_to_parquet_bytes(table)


def notes_bytes_to_archive(data: bytes, where: str, expect_model: str | None = None) -> Archive:
    table = parquet_bytes_to_table(data, where)
    try:
        meta = notes_schema.validate_notes_table(table, where)
    except SchemaError:
        raise
    if expect_model is not None and meta["model_fingerprint"] != expect_model:
        raise FingerprintMismatch(
            f"{where}: archive was written by model {meta['model_fingerprint']!r}, but the loaded model is "
            f"{expect_model!r}")
    try:
        cfg = NoteBankConfig(**meta["notebank"])
    except TypeError as e:
        raise SchemaError(f"{where}: NoteBank config in metadata not understood: {e}") from e
    bits = notes_schema.address_bits(table)
    return Archive(
        token_ids=notes_schema.token_id_lists(table),
        starts=table.column("start").to_numpy().astype(np.int64),
        ends=table.column("end").to_numpy().astype(np.int64),
        chunk_index=table.column("chunk_index").to_numpy().astype(np.int64),
        addresses=torch.from_numpy(bits.copy()).view(torch.bfloat16),
        config=cfg,
        model_fingerprint=meta["model_fingerprint"],
        n_tokens=meta["n_tokens"],
    )


def state_to_bytes(tensors: dict, *, doc_id: str, model_fingerprint: str) -> bytes:
    from safetensors.torch import save
    clean = {k: v.detach().cpu().contiguous() for k, v in sorted(tensors.items())}
    # ONE metadata key: safetensors writes its metadata map in hash order, so several keys would make
    # the bytes vary from call to call.
    meta = {"notebank": json.dumps({"format": STATE_FORMAT, "version": STATE_VERSION, "doc_id": doc_id,
                                    "model": model_fingerprint}, sort_keys=True)}
    return save(clean, metadata=meta)


def bytes_to_state_tensors(data: bytes, where: str, expect_model: str | None = None) -> dict:
    from safetensors.torch import load
    try:
        meta = safetensors_metadata(data)
        tensors = load(data)
    except Exception as e:
        raise ArchiveError(f"{where}: not a readable safetensors state (truncated or corrupted?): "
                           f"{type(e).__name__}: {e}") from e
    try:
        meta = json.loads(meta.get("notebank", "{}"))
    except json.JSONDecodeError:
        meta = {}
    if meta.get("format") != STATE_FORMAT or meta.get("version") != STATE_VERSION:
        raise ArchiveError(f"{where}: not a {STATE_FORMAT} v{STATE_VERSION} file (metadata {meta})")
    if expect_model is not None and meta.get("model") != expect_model:
        raise FingerprintMismatch(f"{where}: state was written by model {meta.get('model')!r}, but the loaded "
                                  f"model is {expect_model!r}")
    return tensors
