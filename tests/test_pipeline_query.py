"""Batch QA, one-pass mode and the demo job on a real local Ray with the tiny model."""
from __future__ import annotations

import json
import os
import shutil

import pyarrow.parquet as pq
import pytest

from conftest import TEST_ACTORS, TINY_MODEL, TINY_NB, write_jsonl
from nbcore.testing import needle_text
from notebank.pipeline.config import DemoConfig, IngestJobConfig, QueryJobConfig, build
from notebank.pipeline.ingest import run_ingest
from notebank.pipeline.query import run_query
from notebank.pipeline.archive import FingerprintMismatch
from notebank.pipeline.safety import UnsafePath
from notebank.schemas.answers import validate_answers_table


def read_answers(folder):
    import pyarrow.dataset as pds
    return pds.dataset(str(folder), format="parquet").to_table()


def qcfg(questions, archive, output, **kw) -> QueryJobConfig:
    d = {"questions": str(questions), "archive": str(archive), "output": str(output), "model": TINY_MODEL,
         "actors": TEST_ACTORS, "progress": False, "methods": ["plain", "notebank", "clean_start"],
         "read": {"max_new_tokens": 6, "top_r": 2, "stop": ["\n"]}}
    d.update(kw)
    return build(QueryJobConfig, d).validate()


@pytest.fixture(scope="module")
def archive(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    docs, questions = [], []
    for i in range(3):
        text, needles = needle_text(2000 + 300 * i, 2, seed=10 + i)
        docs.append({"doc_id": f"doc{i}", "text": text})
        questions += [{"question_id": f"doc{i}-q{j}", "doc_id": f"doc{i}", "answers": [v],
                       "question": f"What is the special magic number for {k}?"} for j, (k, v) in enumerate(needles)]
    docs.append({"doc_id": "empty", "text": ""})
    questions += [{"question_id": "lost", "doc_id": "nowhere", "question": "Anything?"},
                  {"question_id": "bad", "doc_id": "doc0", "question": "Which of the two?", "answers": ["x"]},
                  {"question_id": "e", "doc_id": "empty", "question": "?"}]
    write_jsonl(root / "corpus.jsonl", docs)
    write_jsonl(root / "questions.jsonl", questions, raw_lines=[b'{"question_id": "noq", "doc_id": "doc0"}'])
    cfg = build(IngestJobConfig, {"corpus": str(root / "corpus.jsonl"), "output": str(root / "archive"),
                                  "model": TINY_MODEL, "notebank": TINY_NB, "actors": TEST_ACTORS,
                                  "progress": False, "block_size": 512})
    s = run_ingest(cfg)
    assert s["docs_ok"] == 3 and s["docs_failed"] == 1
    return root


def test_query_all_methods(ray_session, archive, tmp_path):
    out = tmp_path / "answers"
    s = run_query(qcfg(archive / "questions.jsonl", archive / "archive", out))
    assert s["questions_ok"] == 7 and s["questions_failed"] == 3, s   # lost, empty, noq
    assert set(s) >= {"questions_ok", "questions_failed", "wall_s", "mean_score", "n_scored"}
    table = read_answers(out)                  # many parts, one dataset
    validate_answers_table(table.replace_schema_metadata(pq.read_schema(next(out.glob("part-*.parquet"))).metadata))
    assert len(list(out.glob("part-*.parquet"))) >= 3
    rows = table.to_pylist()
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == 7 * 3 and {r["method"] for r in ok} == {"plain", "notebank", "clean_start"}
    for r in ok:
        assert r["replay_generate_s"] > 0 and r["total_s"] > 0 and r["score"] is not None
        assert r["archive"] == str(archive / "archive") and r["model_fingerprint"] and r["source_shard"]
        if r["method"] == "notebank":
            assert 1 <= len(r["retrieved"]) <= 2 and len(r["votes"]) == len(r["retrieved"])
            # the default router (embmax_centered) reads stored note tokens: it routes without probing the state
            assert r["retrieved"] == sorted(r["retrieved"]) and r["replay_len"] > 0 and r["route_s"] > 0
        else:
            assert r["retrieved"] == [] and r["replay_len"] == 0
        assert json.loads(r["read_config"])["method"] == r["method"]
    failed = {r["question_id"]: r["error"] for r in rows if r["status"] == "failed"}
    assert "not archived" in failed["lost"] and "not archived" in failed["e"]
    assert any("missing question" in e for e in failed.values())
    # deterministic: another output gets the same answers
    run_query(qcfg(archive / "questions.jsonl", archive / "archive", tmp_path / "again"))
    strip = lambda rs: sorted(({k: v for k, v in r.items() if not k.endswith("_s")} for r in rs),
                              key=lambda r: (r["question_id"], r["method"]))
    assert strip(read_answers(tmp_path / "again").to_pylist()) == strip(rows)
    # with retry_failed: false a rerun answers only the missing (question_id, method) pairs: none here
    n_parts = len(list(out.glob("part-*.parquet")))
    s3 = run_query(qcfg(archive / "questions.jsonl", archive / "archive", out, retry_failed=False))
    assert s3["rows"] == 0 and s3["questions_retried"] == 0 and len(list(out.glob("part-*.parquet"))) == n_parts
    s4 = run_query(qcfg(archive / "questions.jsonl", archive / "archive", out, retry_failed=False,
                        read={"max_new_tokens": 6, "lam": 0.5}))
    assert s4["rows"] == 0     # same methods: nothing missing
    # by default a rerun answers the failed pairs again (they fail again here: nothing was repaired)
    n_failed = sum(r["status"] == "failed" for r in rows)
    s5 = run_query(qcfg(archive / "questions.jsonl", archive / "archive", out))
    assert s5["rows"] == n_failed and s5["questions_retried"] == 3 and s5["questions_failed"] == 3, s5
    rows2 = read_answers(out).to_pylist()
    keys = [(r["question_id"], r["method"]) for r in rows2]
    assert len(keys) == len(set(keys)) == len(rows)          # exactly one row per pair
    assert {(r["question_id"], r["method"]) for r in rows2 if r["retried"]} == \
        {(r["question_id"], r["method"]) for r in rows if r["status"] == "failed"}


def test_duplicate_question_id_is_an_error_row(ray_session, archive, tmp_path):
    qs = [{"question_id": "q", "doc_id": "doc0", "question": "What?"},
          {"question_id": "q", "doc_id": "doc1", "question": "What again?"}]
    write_jsonl(tmp_path / "q.jsonl", qs)
    s = run_query(qcfg(tmp_path / "q.jsonl", archive / "archive", tmp_path / "out", methods=["plain"]))
    rows = read_answers(tmp_path / "out").to_pylist()
    assert sorted((r["doc_id"], r["status"]) for r in rows) == [("doc0", "ok"), ("doc1", "failed")]
    assert "duplicate question_id" in [r for r in rows if r["status"] == "failed"][0]["error"]
    assert s["failures"] and "duplicate" in s["failures"][0]["error"]


def test_query_output_inside_archive_is_refused(ray_session, archive, tmp_path):
    a = archive / "archive"
    for out in (a, a / "manifest" / "docs" / "doc0.json", a / "answers"):
        with pytest.raises(UnsafePath):
            run_query(qcfg(archive / "questions.jsonl", a, out))
    assert not (a / "answers").exists() and not (a / "manifest" / "docs").exists()


def test_query_corrupted_state_and_wrong_model(ray_session, archive, tmp_path):
    bad = tmp_path / "archive"
    shutil.copytree(archive / "archive", bad)
    state = next((bad / "state").glob("doc1.*"))
    state.write_bytes(state.read_bytes()[:100])
    s = run_query(qcfg(archive / "questions.jsonl", bad, tmp_path / "a"))
    rows = read_answers(tmp_path / "a").to_pylist()
    errs = {r["error"] for r in rows if r["doc_id"] == "doc1"}
    assert len(errs) == 1 and "state/doc1.g0.safetensors" in errs.pop()
    assert s["questions_failed"] == 5
    with pytest.raises(FingerprintMismatch, match=r"manifest/_run\.json: archives were written with model"):
        run_query(qcfg(archive / "questions.jsonl", archive / "archive", tmp_path / "b",
                       model={**TINY_MODEL, "seed": 1}))


def test_query_rerun_after_a_repair_answers_the_failed_questions(ray_session, archive, tmp_path):
    """A damaged state file fails its document's questions; once the file is restored, a plain rerun
    answers them (retry_failed is the default), the failed rows are gone and the answers equal a fresh
    query's."""
    arc = tmp_path / "archive"
    shutil.copytree(archive / "archive", arc)
    state = next((arc / "state").glob("doc1.*"))
    good = state.read_bytes()
    state.unlink()
    out = tmp_path / "answers"
    s1 = run_query(qcfg(archive / "questions.jsonl", arc, out, methods=["plain", "notebank"]))
    before = read_answers(out).to_pylist()
    doc1 = {(r["question_id"], r["method"]) for r in before if r["doc_id"] == "doc1"}
    assert len(doc1) == 4 and all(r["status"] == "failed" for r in before if r["doc_id"] == "doc1")
    state.write_bytes(good)                                              # the repair
    s2 = run_query(qcfg(archive / "questions.jsonl", arc, out, methods=["plain", "notebank"]))
    assert s2["questions_retried"] == 2 + 3 and s2["questions_ok"] == 2, s2     # doc1's two + the 3 hopeless
    assert s2["questions_failed"] == 3 and s1["questions_failed"] == 5
    after = read_answers(out).to_pylist()
    pairs = [(r["question_id"], r["method"]) for r in after]
    assert len(pairs) == len(set(pairs)) == len(before)                # one row per pair, old failed rows gone
    by = {(r["question_id"], r["method"]): r for r in after}
    assert all(by[p]["status"] == "ok" and by[p]["retried"] for p in doc1)
    assert not any(r["retried"] for r in after if r["status"] == "ok" and (r["question_id"], r["method"]) not in doc1)
    fresh = tmp_path / "fresh"
    run_query(qcfg(archive / "questions.jsonl", arc, fresh, methods=["plain", "notebank"]))
    strip = lambda rs: sorted(({k: v for k, v in r.items() if not k.endswith("_s") and k != "retried"} for r in rs),
                              key=lambda r: (r["question_id"], r["method"]))
    assert strip(after) == strip(read_answers(fresh).to_pylist())


def test_demo_job_end_to_end(ray_session, tmp_path):
    import sys
    from conftest import REPO
    sys.path.insert(0, str(REPO / "jobs"))
    import run_demo
    # needle-text mode on the tiny random-init model (fast) ...
    cfg = build(DemoConfig, {"workdir": str(tmp_path), "n_docs": 2, "doc_tokens": 1500, "progress": False,
                             "task": None, "model": TINY_MODEL,
                             "notebank": TINY_NB, "actors": TEST_ACTORS, "read": {"max_new_tokens": 4}})
    s = run_demo.run(cfg.validate())
    assert s["ingest"]["docs_ok"] == 2 and s["query"]["questions_ok"] == 4 and s["query"]["rows"] == 12
    assert list((tmp_path / "answers").glob("part-*.parquet"))


def test_demo_defaults_use_the_shipped_model_on_ruler(ray_session, tmp_path):
    """The README's `make run`: embedded defaults = shipped tiny GDN + RULER corpus (smaller here)."""
    import sys
    from conftest import REPO
    if not (REPO / "models/tiny-gdn/config.json").exists():
        pytest.skip("shipped model missing")
    sys.path.insert(0, str(REPO / "jobs"))
    import run_demo
    cfg = build(DemoConfig, {"workdir": str(tmp_path), "n_docs": 1, "doc_tokens": 2048, "progress": False,
                             "actors": TEST_ACTORS})
    assert cfg.model.path == "models/tiny-gdn" and cfg.task == "niah_single_1"
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        s = run_demo.run(cfg.validate())
    finally:
        os.chdir(cwd)
    assert s["ingest"]["docs_ok"] == 1 and s["query"]["questions_ok"] == 1 and s["query"]["rows"] == 3


def test_onepass_job_matches_archive_answers_and_persists_nothing(ray_session, archive, tmp_path):
    """Query with `corpus` instead of `archive`: each document is ingested and answered in one actor;
    the answers have the same schema and equal the archive path's, and no state is written."""
    base = qcfg(archive / "questions.jsonl", archive / "archive", tmp_path / "from-archive", methods=["notebank"])
    run_query(base)
    one = qcfg(archive / "questions.jsonl", "", tmp_path / "onepass", methods=["notebank", "jrt"],
               corpus=str(archive / "corpus.jsonl"), notebank=TINY_NB, block_size=512)
    s = run_query(one)
    assert s["questions_ok"] == 7, s
    a = {(r["question_id"], r["method"]): r for r in read_answers(tmp_path / "from-archive").to_pylist()}
    b = {(r["question_id"], r["method"]): r for r in read_answers(tmp_path / "onepass").to_pylist()}
    for (qid, m), r in a.items():
        if r["status"] == "ok":
            o = b[(qid, m)]
            assert o["status"] == "ok" and o["answer"] == r["answer"] and o["retrieved"] == r["retrieved"]
            assert o["archive"] is None
            assert b[(qid, "jrt")]["status"] == "ok"
    assert not list((tmp_path / "onepass").rglob("*.safetensors"))
    with pytest.raises(Exception, match="exactly one of archive"):
        qcfg(archive / "questions.jsonl", archive / "archive", tmp_path / "x", corpus=str(archive / "corpus.jsonl"))


def test_document_reads_put_each_document_in_one_read():
    """The query's read plan: a document's questions all arrive in one row (no shuffle), also when
    they span shards."""
    from notebank.pipeline.dataplane import document_reads
    keep = {"a": {"0": ["plain"], "1": ["plain"], "2": ["notebank"]}, "b": {"0": ["plain"], "1": ["plain"]}}
    row_doc = {("a", "0"): "d1", ("a", "1"): "d2", ("a", "2"): "d1", ("b", "0"): "d3", ("b", "1"): "d2"}
    reads = document_reads(keep, row_doc)
    assert reads == [{"a": {"0": ["plain"], "2": ["notebank"]}}, {"b": {"0": ["plain"]}},
                     {"a": {"1": ["plain"]}, "b": {"1": ["plain"]}}]
    owner = {}
    for i, r in enumerate(reads):
        for shard, rows in r.items():
            for row in rows:
                assert owner.setdefault(row_doc[(shard, row)], i) == i
