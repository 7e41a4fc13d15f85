"""Shared machinery for versioned Arrow/Parquet schemas.

Every schema is defined once (a function returning a ``pyarrow.Schema``) and carries its name and
version in the schema metadata (``notebank.schema`` / ``notebank.schema_version``). Tables are
validated before they are written and after they are read; Parquet is written with fixed settings so
that the same table always gives the same bytes (no timestamps, no random ids in data files).
"""
from __future__ import annotations

import io
import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_KEY = b"notebank.schema"
VERSION_KEY = b"notebank.schema_version"

# Fixed Parquet writer settings: changing any of these changes archive bytes (bump the schema
# version if you do). pyarrow embeds its own version in `created_by`, so byte-equality holds for a
# given pyarrow release.
PARQUET_WRITE_OPTIONS = dict(
    compression="zstd",
    compression_level=3,
    use_dictionary=False,
    write_statistics=True,
    data_page_version="2.0",
    version="2.6",
    row_group_size=1 << 16,
    store_schema=True,
)


class SchemaError(ValueError):
    """A table or file does not match the schema it claims (message names the file when known)."""


def with_meta(schema: pa.Schema, name: str, version: int, extra: dict | None = None) -> pa.Schema:
    meta = {SCHEMA_KEY: name.encode(), VERSION_KEY: str(version).encode()}
    for k, v in (extra or {}).items():
        meta[k.encode()] = v if isinstance(v, bytes) else str(v).encode()
    return schema.with_metadata(meta)


def schema_meta(schema: pa.Schema) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (schema.metadata or {}).items() if not k.startswith(b"ARROW:")}


def check_table(table: pa.Table, expected: pa.Schema, where: str = "table") -> None:
    """Raise SchemaError unless `table` has exactly the fields/types of `expected` and its name+version."""
    exp_meta = schema_meta(expected)
    got_meta = schema_meta(table.schema)
    name, version = exp_meta.get("notebank.schema"), exp_meta.get("notebank.schema_version")
    if got_meta.get("notebank.schema") != name:
        raise SchemaError(f"{where}: expected a '{name}' table, schema metadata says {got_meta.get('notebank.schema')!r}")
    if got_meta.get("notebank.schema_version") != version:
        raise SchemaError(
            f"{where}: '{name}' schema version {got_meta.get('notebank.schema_version')!r} is not the supported "
            f"version {version!r}"
        )
    got_names, exp_names = table.schema.names, expected.names
    if got_names != exp_names:
        missing = [n for n in exp_names if n not in got_names]
        extra = [n for n in got_names if n not in exp_names]
        raise SchemaError(f"{where}: columns {got_names} != expected {exp_names} (missing {missing}, unexpected {extra})")
    for f in expected:
        g = table.schema.field(f.name)
        if not g.type.equals(f.type):
            raise SchemaError(f"{where}: column '{f.name}' has type {g.type}, expected {f.type}")
        if not f.nullable and table.column(f.name).null_count:
            raise SchemaError(f"{where}: column '{f.name}' has {table.column(f.name).null_count} nulls but is not nullable")
    for k, v in exp_meta.items():
        if got_meta.get(k) != v:
            raise SchemaError(f"{where}: schema metadata {k}={got_meta.get(k)!r}, expected {v!r}")


def table_to_parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, **PARQUET_WRITE_OPTIONS)
    return buf.getvalue()


# Reading Parquet from memory Python owns (a Python file object such as fsspec's, BytesIO, bytes) lets
# pyarrow's IO and CPU threads hold buffers whose release takes the GIL. When the last such buffer is
# released on one of those threads while the interpreter exits, the thread cannot take the GIL and the
# process aborts (SIGABRT, exit 134) after all its work is done: ~1 exit in 4 for one small read here
# (tests/test_parquet_exit.py). Every first-party Parquet read goes through one of the three readers
# below, which leave no such buffer behind.

def read_parquet_bytes(data: bytes, **kw) -> pa.Table:
    """A whole Parquet file already in memory -> Table (`kw` as pq.read_table: columns, filters).

    The bytes are copied into memory Arrow owns first, so no Python object is left to Arrow's threads."""
    out = pa.BufferOutputStream()
    out.write(data)
    return pq.read_table(pa.BufferReader(out.getvalue()), **kw)


def read_parquet_file(f, **kw) -> pa.Table:
    """The asked part of a Parquet file open as a Python file object (`kw`: columns, filters).

    Reads only the pages it needs, all on the calling thread (no pre-buffering, no thread pool)."""
    return pq.read_table(f, pre_buffer=False, use_threads=False, **kw)


def open_parquet_file(f) -> pq.ParquetFile:
    """A ParquetFile over a Python file object, for reads by row group or batch without loading it all.

    It does not pre-buffer; callers pass use_threads=False to read_row_group/iter_batches, so every
    read stays on the calling thread."""
    return pq.ParquetFile(f, pre_buffer=False)


def parquet_bytes_to_table(data: bytes, where: str) -> pa.Table:
    try:
        return read_parquet_bytes(data)
    except Exception as e:  # ArrowInvalid, OSError, ... on truncated/corrupted files
        raise SchemaError(f"{where}: not a readable Parquet file (truncated or corrupted?): {type(e).__name__}: {e}") from e


def read_parquet_url(url: str, where: str | None = None) -> pa.Table:
    where = where or url
    try:
        with fsspec.open(url, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        raise SchemaError(f"{where}: file not found") from e
    return parquet_bytes_to_table(data, where)


def dumps_json(obj) -> bytes:
    """Canonical JSON bytes (sorted keys, no whitespace variance)."""
    return (json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode("utf-8")
