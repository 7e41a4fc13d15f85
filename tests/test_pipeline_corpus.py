"""Document keys (file names in the archive) and corpus / question shard reading."""
from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import write_jsonl
from notebank.pipeline.corpus import iter_corpus, list_shards, read_questions
from notebank.schemas.archive import doc_key


def test_doc_key_rejects_escapes_and_quotes_the_rest():
    assert doc_key("doc-1") == ("doc-1", None)
    assert doc_key("a b?c")[0] == "a%20b%3Fc"
    for bad in ("../x", "a/b", "..", ".hidden", "a\\b", "", "x\x01"):
        key, err = doc_key(bad)
        assert key is None and err, bad
    assert "escape the output folder" in doc_key("../x")[1]


def test_corpus_shards_jsonl_parquet_and_bad_rows(tmp_path):
    d = tmp_path / "corpus"
    write_jsonl(d / "a.jsonl", [{"doc_id": "a1", "text": "hello", "lang": "en"}, {"doc_id": "a2"}],
                raw_lines=[b'{"doc_id": "bad", "text": "\xff\xfe"}', b"{not json", b""])
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"doc_id": 5, "text": "five"}) + "\n")
    pq.write_table(pa.table({"doc_id": ["p1", None], "text": ["par", "x"], "year": [2020, 2021]}), d / "c.parquet")
    (d / "README.txt").write_text("ignored")
    rows = list(iter_corpus(str(d)))
    got = [(r.doc_id, r.text, r.error) for r in rows]
    assert got[0] == ("a1", "hello", None) and rows[0].metadata == {"lang": "en"}
    assert got[1][2] == "missing text"
    assert "invalid UTF-8" in got[2][2] and "invalid JSON" in got[3][2]
    assert got[4] == ("5", "five", None)
    assert got[5] == ("p1", "par", None) and rows[5].metadata == {"year": 2020}
    assert "doc_id" in got[6][2]
    assert rows[2].source["row"] == 2 and rows[2].source["shard"].endswith("a.jsonl")
    assert len(list(iter_corpus(str(d), limit=3))) == 3
    assert len(list_shards(str(d / "*.jsonl"))[1]) == 1
    with pytest.raises(FileNotFoundError):
        list_shards(str(tmp_path / "missing"))


def test_corpus_and_questions_from_memory_fs():
    import fsspec
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/qs/q.jsonl", b'{"question_id": "q1", "doc_id": "d", "question": "?", "answers": ["a"]}\n'
                                b'{"question_id": "q2", "doc_id": "d"}\n')
    good, bad = read_questions("memory://qs")
    assert [q["question_id"] for q in good] == ["q1"] and bad[0]["error"] == "missing question"


def test_truncated_corpus_shard_names_the_file(tmp_path):
    p = tmp_path / "c.parquet"
    pq.write_table(pa.table({"doc_id": ["a"], "text": ["x" * 1000]}), p)
    p.write_bytes(p.read_bytes()[:-30])
    with pytest.raises(ValueError, match=r"c\.parquet: not a readable Parquet file"):
        list(iter_corpus(str(p)))
