"""Resumable cell sweeps: the file mechanics of the evaluation sweep runner (pipeline/evaluate.py).

A sweep is a list of cells (dicts with a `path`); the actor that evaluates a cell commits its rows
as one Parquet file. Files are written to a temporary name and then renamed, so a file that
exists is complete: a rerun skips those cells (`unfinished`) and `collect` never reads half a file.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from notebank.schemas._base import read_parquet_file

if TYPE_CHECKING:
    import pandas as pd


def commit_parquet(table: pa.Table, url: str) -> None:
    """Write `table` to url + ".tmp", then rename it to `url` (a killed writer leaves no file at `url`)."""
    fs, path = fsspec.core.url_to_fs(url)
    fs.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with fs.open(tmp, "wb") as f:
        pq.write_table(table, f)
    fs.mv(tmp, path)


def cell_result(cell: dict, rows: list[dict], error: str | None, tokens_key: str = "n_tokens") -> dict:
    """Commit a cell's rows unless it failed. -> the record the driver collects: {path, error, n_tokens}."""
    if error is None:
        commit_parquet(pa.Table.from_pylist(rows), cell["path"])
    return {"path": cell["path"], "error": error, "n_tokens": rows[0][tokens_key] if rows else 0}


def unfinished(output: str, cells: list[dict]) -> list[dict]:
    """The cells whose Parquet file does not exist yet (in plan order)."""
    fs, _ = fsspec.core.url_to_fs(output)
    return [c for c in cells if not fs.exists(fsspec.core.url_to_fs(c["path"])[1])]


def collect(output: str, cells: list[dict] | None = None) -> pa.Table | None:
    """Finished cells as one table (only those of `cells` when given; None if there are none)."""
    fs, root = fsspec.core.url_to_fs(output)
    if cells is None:
        files = fs.glob(root.rstrip("/") + "/cells/**/*.parquet")
    else:
        files = [p for p in (fsspec.core.url_to_fs(c["path"])[1] for c in cells) if fs.exists(p)]
    if not files:
        return None
    tables = []
    for p in sorted(files):
        with fs.open(p, "rb") as f:
            tables.append(read_parquet_file(f))
    return pa.concat_tables(tables, promote_options="permissive")   # string vs large_string: restored cells keep a shipped file's types


def finish_sweep(output: str, report: Callable[[pd.DataFrame], dict], cells: list[dict] | None = None,
                 key: list[str] | None = None, prepare: Callable[[pa.Table], pa.Table] | None = None) -> dict:
    """Gather the finished cells (of `cells` when given) into <output>/results.parquet, committed like a
    cell, then report(rows as a DataFrame) when `output` is on the local file system (the reports
    write with plain file I/O). -> report's summary, or {} when there are no rows or no report.

    With `key` (the columns that name one measurement), rows of an existing results.parquet whose key
    no finished cell measured are kept: `cells/` is scratch (git-ignored), results.parquet is what a
    repository ships, so a fresh clone that runs a slice of a sweep adds to the shipped rows instead
    of replacing them. A cell's rows win over an older row with the same key. prepare(table) -> table
    checks the rows before they are written (a results schema; it raises on bad rows)."""
    rows = collect(output, cells)
    if key is not None:
        rows = _with_previous_rows(rows, output.rstrip("/") + "/results.parquet", key)
    if rows is None or not rows.num_rows:
        return {}
    if prepare is not None:
        rows = prepare(rows)
    commit_parquet(rows, output.rstrip("/") + "/results.parquet")
    fs, _ = fsspec.core.url_to_fs(output)
    if fs.protocol in ("file", ("file", "local")) or "://" not in output:
        return report(rows.to_pandas())
    return {}


def _with_previous_rows(rows: pa.Table | None, results_url: str, key: list[str]) -> pa.Table | None:
    """`rows` plus the rows of `results_url` (if it exists) whose `key` is not among `rows`."""
    fs, path = fsspec.core.url_to_fs(results_url)
    if not fs.exists(path):
        return rows
    with fs.open(path, "rb") as f:
        old = read_parquet_file(f)
    if rows is None or not rows.num_rows:
        return old
    missing = [k for k in key if k not in old.column_names or k not in rows.column_names]
    if missing:
        raise ValueError(f"{results_url} lacks the measurement key columns {missing}; not overwriting it")
    new_keys = set(zip(*(rows.column(k).to_pylist() for k in key)))
    keep = [k not in new_keys for k in zip(*(old.column(k).to_pylist() for k in key))]
    kept = old.filter(pa.array(keep, pa.bool_()))
    if not kept.num_rows:
        return rows
    try:
        return pa.concat_tables([rows, kept], promote_options="permissive")   # string vs large_string, as collect
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise ValueError(f"{results_url} has rows whose columns do not match the new cells' ({e}); "
                         f"not overwriting it") from e
