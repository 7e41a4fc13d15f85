"""Archive layout v2 without Ray: streamed states in pieces, commit records, and the archive read
as ONE table by pyarrow.dataset, duckdb, polars and ray.data.read_parquet with per-document values."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load, save

from conftest import TINY_MODEL, TINY_NB
from nbcore.testing import needle_text
from notebank.pipeline.archive import Archive, plan_pieces, safetensors_chunks
from notebank.schemas import archive as S


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"kv.keys": torch.randn(10, 3, 4, generator=g, dtype=torch.float32).to(torch.bfloat16),
            "rec.0": torch.randn(5, 7, generator=g), "pos": torch.tensor([12], dtype=torch.int64),
            "flag": torch.tensor([True, False])}


@pytest.mark.parametrize("root", ["memory://archive-store/s", "LOCAL"])
def test_state_pieces_round_trip_and_are_deterministic(root, tmp_path):
    root = str(tmp_path / "s") if root == "LOCAL" else root
    store = Archive(root)
    t = _tensors()
    one = store.write_state("d", 0, t, doc_id="d", model_fingerprint="m")
    assert len(one) == 1 and one[0].path == "state/d.g0.safetensors"
    many = store.write_state("e", 0, t, doc_id="e", model_fingerprint="m", piece_bytes=64)
    assert len(many) > 3 and all(r.path.startswith("state/e.g0/part-") for r in many)
    for refs in (one, many):
        back = store.read_state(refs, expect_model="m")
        assert set(back) == set(t) and all(torch.equal(back[k], t[k]) for k in t)
    again = Archive(root + "-2").write_state("e", 0, t, doc_id="e", model_fingerprint="m", piece_bytes=64)
    assert [(r.size, r.sha256) for r in again] == [(r.size, r.sha256) for r in many]
    # a streamed file is an ordinary safetensors file
    raw = b"".join(bytes(b) for b in safetensors_chunks(t, {"x": 1}))
    assert all(torch.equal(load(raw)[k], t[k]) for k in t)
    with pytest.raises(Exception, match="model"):
        store.read_state(one, expect_model="other")


def test_plan_pieces_splits_big_tensors_without_copying():
    big = torch.arange(1000, dtype=torch.float32).reshape(100, 10)
    pieces = plan_pieces({"big": big, "small": torch.zeros(2)}, piece_bytes=400)
    slices = [p for p in pieces if any(k.startswith("big@") for k in p)]
    assert len(slices) == 10
    first = next(iter(slices[0].values()))
    assert first.data_ptr() == big.data_ptr()          # a view of the caller's tensor, not a copy
    assert sum(len(p) for p in pieces) == 11


def test_commit_record_round_trip_and_truncation_is_detected(tmp_path):
    store = Archive(str(tmp_path / "a"))
    refs = store.write_state("d", 0, _tensors(), doc_id="d", model_fingerprint="m")
    entry = S.DocEntry(doc_id="d", key="d", status="ok", n_tokens=5, state=refs)
    rec = store.write_group("g", [entry], [], [{"doc_id": "d", "generation": 0, "status": "ok", "memory": "notebank",
                                                 "n_tokens": 5, "n_notes": 0, "n_archived_tokens": 0,
                                                 "model_fingerprint": "m", "group": "g"}],
                            n_slots=2, addr_dim=2, fp_digest="f")
    commits, problems = store.load_commits()
    assert not problems and commits["g"].documents[0].state == refs and rec.notes is None
    assert not store.group_problems(commits["g"], store.file_sizes(), verify=True)
    p = tmp_path / "a" / refs[0].path
    p.write_bytes(p.read_bytes()[:-3])
    assert "truncated" in store.group_problems(commits["g"], store.file_sizes())[0]
    (tmp_path / "a" / "manifest/commits/g.json").write_text("{ not json")
    commits, problems = store.load_commits()
    assert not commits and "not valid JSON" in problems[0]


def test_archive_reads_as_one_table_everywhere(ray_session, tmp_path):
    import duckdb
    import polars as pl
    import pyarrow.dataset as pds
    import ray
    from notebank.pipeline.actors import IngestActor
    out = tmp_path / "out"
    actor = IngestActor(model=TINY_MODEL, nb=TINY_NB, block_size=512, output=str(out), fp_digest="x",
                        tokenizer_name="byte")
    n_tok = {}
    for g in range(2):
        docs = []
        for i in range(3):
            doc_id = f"g{g}d{i}"
            text = needle_text(1300 + 211 * (3 * g + i), 2, seed=3 * g + i)[0]
            n_tok[doc_id] = len(text.encode())
            docs.append({"row": i, "shard": "c.jsonl", "action": "ingest", "reason": None, "doc_id": doc_id,
                         "key": doc_id, "generation": 0, "group_id": f"grp{g}", "text": text, "metadata": {"g": g}})
        actor.ingest_group(f"grp{g}", docs)
    notes_glob, docs_glob = str(out / "notes" / "*.parquet"), str(out / "documents" / "*.parquet")
    a = pds.dataset(str(out / "documents"), format="parquet").to_table().to_pylist()
    d = duckdb.sql(f"SELECT doc_id, n_tokens FROM read_parquet('{docs_glob}') ORDER BY doc_id").fetchall()
    p = pl.read_parquet(docs_glob).select(["doc_id", "n_tokens"]).sort("doc_id").rows()
    r = sorted((x["doc_id"], x["n_tokens"]) for x in ray.data.read_parquet(str(out / "documents")).take_all())
    want = sorted(n_tok.items())
    assert sorted((x["doc_id"], x["n_tokens"]) for x in a) == want and d == want and p == want and r == want
    counts = dict(duckdb.sql(f"SELECT doc_id, count(*) FROM read_parquet('{notes_glob}') GROUP BY doc_id").fetchall())
    pa_counts = {x["doc_id"]: x["n_notes"] for x in a}
    assert counts == pa_counts and len(counts) == 6
    notes = pl.read_parquet(notes_glob)
    assert notes.height == sum(counts.values()) and "text" in notes.columns
    assert ray.data.read_parquet(str(out / "notes")).count() == notes.height
    assert json.loads(a[0]["metadata"]) in ({"g": 0}, {"g": 1})
