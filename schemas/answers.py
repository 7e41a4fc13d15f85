"""Answers Parquet: one row per (question, method). A query job writes a *dataset* of these files
(`part-*.parquet` in its output folder), readable as one table. v2 added provenance columns; v3
`retried` (the pair had failed in an earlier run and was answered again: its failed row was
removed)."""
from __future__ import annotations

import pyarrow as pa

from notebank.schemas._base import check_table, with_meta

NAME = "answers"
VERSION = 3


def answers_schema() -> pa.Schema:
    f = pa.field
    return with_meta(pa.schema([
        f("question_id", pa.string(), nullable=False),
        f("doc_id", pa.string(), nullable=False),
        f("method", pa.string(), nullable=False),
        f("read_config", pa.string(), nullable=False),     # JSON of the ReadConfig used
        f("status", pa.string(), nullable=False),           # ok | failed
        f("error", pa.string()),
        f("answer", pa.string()),
        f("token_ids", pa.list_(pa.int32())),
        f("retrieved", pa.list_(pa.int64())),                # note indices, document order
        f("votes", pa.list_(pa.float64())),                  # router score per retrieved note (channel votes for native)
        f("replay_len", pa.int64()),
        f("probe_s", pa.float64()),
        f("route_s", pa.float64()),
        f("replay_generate_s", pa.float64()),
        f("total_s", pa.float64()),
        f("answers", pa.list_(pa.string())),                 # references, when given
        f("score", pa.float64()),                            # 0..100, when references given
        f("source_shard", pa.string()),                      # the question row's shard and row
        f("source_row", pa.int64()),
        f("load_s", pa.float64()),                           # loading the document's state and notes
        f("archive", pa.string()),                           # provenance: archive URL,
        f("model_fingerprint", pa.string()),                 # the model that answered,
        f("notebank", pa.string()),                          # and the archive's NoteBank config (JSON)
        f("retried", pa.bool_()),                            # answered again after failing in an earlier run
    ]), NAME, VERSION, {"score.metric": "RULER string_match_all x100 (nbcore.tasks.ruler when present)"})


COLUMNS = answers_schema().names


def answers_table(rows: list[dict]) -> pa.Table:
    schema = answers_schema()
    table = pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} for r in rows], schema=schema)
    validate_answers_table(table)
    return table


def validate_answers_table(table: pa.Table, where: str = "answers table") -> None:
    check_table(table, answers_schema(), where)
