"""Schemas: defined once, versioned, validated on write and read; real Parquet via fsspec (local, memory://)."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest

from notebank.schemas import answers, inputs, manifest
from notebank.schemas._base import SchemaError, parquet_bytes_to_table, table_to_parquet_bytes


def test_truncated_parquet_names_the_file():
    table = pa.table({"doc_id": ["d"] * 64, "token_ids": [list(range(i, i + 16)) for i in range(64)]})
    data = table_to_parquet_bytes(table)
    with pytest.raises(SchemaError, match=r"notes/d\.parquet.*truncated or corrupted"):
        parquet_bytes_to_table(data[: len(data) // 2], "memory://x/notes/d.parquet")


def test_run_record_roundtrip_and_fingerprint_diff():
    fp = {"model": "m", "notebank": {"chunk_size": 64}}
    d = manifest.parse_run_record(manifest.run_record(fp, "2026-01-01T00:00:00+00:00"), "r.json")
    assert d["fingerprint"] == fp and d["schema"] == "manifest.run" and d["schema_version"] == manifest.VERSION
    with pytest.raises(SchemaError, match="r.json.*not valid JSON"):
        manifest.parse_run_record(manifest.run_record(fp, "t")[:20], "r.json")
    with pytest.raises(SchemaError, match="not a manifest.run v1 record"):
        manifest.parse_run_record(json.dumps({"schema": "manifest.doc"}).encode(), "r.json")
    assert manifest.fingerprint_diff({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {"c": 3}}) == ["b.c: 2 -> 3"]


def test_answers_table_validates():
    rows = [{"question_id": "q", "doc_id": "d", "method": "notebank", "read_config": "{}", "status": "ok",
             "answer": "x", "token_ids": [1, 2], "retrieved": [0, 3], "votes": [2.0, 1.0], "replay_len": 9,
             "probe_s": 0.1, "route_s": 0.0, "replay_generate_s": 0.2, "total_s": 0.3, "answers": ["x"], "score": 100.0}]
    t = answers.answers_table(rows)
    back = parquet_bytes_to_table(table_to_parquet_bytes(t), "a.parquet")
    answers.validate_answers_table(back, "a.parquet")
    assert back.to_pylist()[0]["retrieved"] == [0, 3]
    with pytest.raises(SchemaError, match="columns"):
        answers.validate_answers_table(back.drop_columns(["score"]), "a.parquet")


def test_input_row_checks():
    assert inputs.check_corpus_row({"doc_id": 7, "text": "t", "lang": "en"}) == ("7", "t", {"lang": "en"}, None)
    assert "missing text" in inputs.check_corpus_row({"doc_id": "a"})[3]
    assert "doc_id" in inputs.check_corpus_row({"text": "t"})[3]
    q, err = inputs.check_question_row({"question_id": 1, "doc_id": "a", "question": "?", "answers": "x"})
    assert err is None and q["answers"] == ["x"] and q["question_id"] == "1"
    assert inputs.check_question_row({"question_id": 1, "doc_id": "a"})[1] == "missing question"
