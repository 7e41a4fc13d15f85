"""Schemas: defined once, versioned, validated on write and read; real Parquet via fsspec (local, memory://)."""
from __future__ import annotations

import json

import fsspec
import numpy as np
import pyarrow as pa
import pytest

from notebank.schemas import answers, inputs, manifest, notes
from notebank.schemas._base import SchemaError, parquet_bytes_to_table, read_parquet_url, schema_meta, table_to_parquet_bytes


def _notes_table(n=3, j=4, d=8, doc_id="doc-1"):
    rng = np.random.default_rng(0)
    toks = [rng.integers(0, 1000, size=int(k), dtype=np.int32) for k in rng.integers(1, 20, size=n)]
    starts = np.arange(n, dtype=np.int64) * 100
    bits = rng.integers(0, 65535, size=(n, j, d), dtype=np.uint16)
    return notes.build_notes_table(doc_id, toks, starts, starts + 10, np.arange(n), bits, n_channels=j, addr_dim=d,
                                   model_fingerprint="fp", notebank={"chunk_size": 64}, n_tokens=999), toks, bits


@pytest.mark.parametrize("url", ["memory://nb-test/notes/doc-1.parquet", "LOCAL"])
def test_notes_roundtrip_via_fsspec(url, tmp_path):
    if url == "LOCAL":
        url = str(tmp_path / "doc-1.parquet")
    table, toks, bits = _notes_table()
    data = table_to_parquet_bytes(table)
    with fsspec.open(url, "wb") as f:
        f.write(data)
    back = read_parquet_url(url)
    meta = notes.validate_notes_table(back, url)
    assert meta == {"n_channels": 4, "addr_dim": 8, "model_fingerprint": "fp", "notebank": {"chunk_size": 64},
                    "n_tokens": 999, "doc_id": "doc-1"}
    assert np.array_equal(notes.address_bits(back), bits)
    assert all(np.array_equal(a, b) for a, b in zip(notes.token_id_lists(back), toks))
    assert back.schema.field("addresses").type == pa.list_(pa.uint16(), 32)
    m = schema_meta(back.schema)
    assert m["notebank.schema"] == "notes" and m["notebank.schema_version"] == str(notes.VERSION)
    assert m["addresses.encoding"] == "bfloat16-bits-as-uint16"


def test_notes_bytes_deterministic_and_empty_ok():
    a, _, _ = _notes_table()
    b, _, _ = _notes_table()
    assert table_to_parquet_bytes(a) == table_to_parquet_bytes(b)
    empty = notes.build_notes_table("d", [], [], [], [], np.zeros((0, 4, 8), np.uint16), n_channels=4, addr_dim=8,
                                    model_fingerprint="fp", notebank={}, n_tokens=5)
    back = parquet_bytes_to_table(table_to_parquet_bytes(empty), "x")
    assert notes.validate_notes_table(back)["n_tokens"] == 5 and back.num_rows == 0
    assert notes.address_bits(back).shape == (0, 4, 8)


def test_notes_validation_rejects_bad_tables():
    table, _, _ = _notes_table()
    # wrong schema version
    meta = dict(table.schema.metadata)
    meta[b"notebank.schema_version"] = b"999"
    with pytest.raises(SchemaError, match="version"):
        notes.validate_notes_table(table.replace_schema_metadata(meta), "f.parquet")
    # wrong column type
    bad = table.set_column(1, pa.field("note_index", pa.int64(), nullable=False),
                           pa.array(np.arange(3), pa.int64()))
    with pytest.raises(SchemaError, match="note_index"):
        notes.validate_notes_table(bad, "f.parquet")
    # address shape mismatch at build time
    with pytest.raises(SchemaError, match="shape"):
        notes.build_notes_table("d", [np.zeros(2, np.int32)], [0], [2], [0], np.zeros((1, 3, 8), np.uint16),
                                n_channels=4, addr_dim=8, model_fingerprint="", notebank={}, n_tokens=2)


def test_truncated_parquet_names_the_file():
    table, _, _ = _notes_table()
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
