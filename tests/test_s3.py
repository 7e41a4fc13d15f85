"""The pipeline against a real S3 API (moto's server on 127.0.0.1, tests/s3_server.py): ingest, rerun,
append, query, the writer lease, deleted / truncated / flipped files, with the bytes the server
received counted on its side. Corpus, questions, archive and answers all live in the bucket.

One ingest (4 documents, 2 groups) is shared by the module; tests that damage or extend an archive
work on a server-side copy of it."""
from __future__ import annotations

import json
import shutil

import fsspec
import pyarrow.dataset as pds
import pytest

from conftest import TEST_ACTORS, TINY_MODEL
from nbcore.testing import needle_text
from notebank.pipeline.archive import Archive
from notebank.pipeline.ingest import run_ingest
from notebank.pipeline.query import run_query
from notebank.pipeline.config import QueryJobConfig, build
from test_integrity import flip_bytes
from test_pipeline_ingest import cfg_for

DATA = ("notes", "documents", "state")
pytestmark = pytest.mark.slow           # eight pipeline runs (about 2 minutes on an idle 2-core machine)


def data_files(fs, root: str) -> dict[str, bytes]:
    """Every data file under an archive root (any fsspec filesystem), by relative path."""
    root = root.rstrip("/")
    out = {}
    for sub in DATA:
        if fs.exists(f"{root}/{sub}"):
            for p in fs.find(f"{root}/{sub}"):
                out[p[len(root) + 1:]] = fs.cat_file(p)
    return out


def qcfg(questions, archive, output, **kw) -> QueryJobConfig:
    d = {"questions": questions, "archive": archive, "output": output, "model": TINY_MODEL, "actors": TEST_ACTORS,
         "progress": False, "methods": ["notebank"], "read": {"max_new_tokens": 6, "top_r": 2, "stop": ["\n"]}}
    return build(QueryJobConfig, {**d, **kw}).validate()


def strip(url: str) -> str:
    return url.split("://", 1)[1]


def answers(fs, url: str) -> dict[str, dict]:
    rows = pds.dataset(strip(url), filesystem=fs, format="parquet").to_table().to_pylist()
    return {r["question_id"]: r for r in rows}


@pytest.fixture(scope="module")
def run(ray_session, s3, tmp_path_factory):
    """4 documents in 2 groups ingested into s3://.../archive, and the same corpus into a local folder."""
    fs = s3.fs()
    base = s3.url("m")
    docs, questions = [], []
    for i in range(4):
        text, needles = needle_text(1600 + 250 * i, 2, seed=20 + i)
        docs.append({"doc_id": f"doc{i}", "text": text})
        questions += [{"question_id": f"doc{i}-q{j}", "doc_id": f"doc{i}", "answers": [v],
                       "question": f"What is the special magic number for {k}?"} for j, (k, v) in enumerate(needles)]
    jsonl = lambda rows: "".join(json.dumps(r) + "\n" for r in rows).encode()
    fs.pipe_file(strip(f"{base}/corpus/part-0.jsonl"), jsonl(docs))
    fs.pipe_file(strip(f"{base}/questions.jsonl"), jsonl(questions))
    archive = f"{base}/archive"
    s3.reset()
    s = run_ingest(cfg_for(f"{base}/corpus", archive, docs_per_group=2))
    requests = s3.requests(strip(archive).split("/", 1)[1])
    assert (s["docs_ok"], s["docs_failed"]) == (4, 0), s
    local = tmp_path_factory.mktemp("s3-local") / "archive"
    assert run_ingest(cfg_for(f"{base}/corpus", local, docs_per_group=2))["docs_ok"] == 4
    return {"fs": fs, "base": base, "archive": archive, "local": local, "requests": requests, "docs": docs,
            "questions": f"{base}/questions.jsonl", "n_questions": len(questions)}


def _copy(run, name: str) -> str:
    dst = f"{run['base']}/{name}"
    run["fs"].copy(strip(run["archive"]), strip(dst), recursive=True)
    return dst


def test_ingest_writes_each_byte_once_and_matches_a_local_archive(run, s3):
    fs, archive = run["fs"], run["archive"]
    files = data_files(fs, strip(archive))
    assert files and files == data_files(fsspec.filesystem("file"), str(run["local"]))   # same bytes as local
    writes = [r for r in run["requests"] if r["method"] in ("PUT", "POST")]
    assert not [r for r in writes if ".tmp-" in r["path"]]                 # no temporary names ...
    assert not [r for r in writes if r["copy"]]                            # ... and no server-side copies
    data_puts = sum(r["body_bytes"] for r in writes if r["path"].split("/archive/", 1)[1].startswith(DATA))
    assert data_puts == sum(len(b) for b in files.values())                # every data byte sent once
    commits = [r for r in writes if "/manifest/commits/" in r["path"]]
    assert len(commits) == 2

    # rerun: everything committed is skipped, no data file is written again
    s3.reset()
    s = run_ingest(cfg_for(f"{run['base']}/corpus", archive, docs_per_group=2))
    assert (s["docs_ok"], s["docs_skipped"]) == (0, 4), s
    again = [r for r in s3.requests(strip(archive).split("/", 1)[1]) if r["method"] in ("PUT", "POST")]
    assert not [r for r in again if r["path"].split("/archive/", 1)[1].startswith(DATA + ("manifest/commits",))]
    assert data_files(fs, strip(archive)) == files


def test_second_writer_is_refused(run):
    from notebank.pipeline.safety import OutputBusy, acquire_lease
    before = data_files(run["fs"], strip(run["archive"]))
    with acquire_lease(run["archive"], {"job": "ingest", "argv": "the other writer"}):
        with pytest.raises(OutputBusy, match="the other writer"):
            run_ingest(cfg_for(f"{run['base']}/corpus", run["archive"], docs_per_group=2))
    assert data_files(run["fs"], strip(run["archive"])) == before


def test_deleted_truncated_and_orphaned_files_are_noticed(run):
    fs = run["fs"]
    arc = _copy(run, "damaged")
    root = strip(arc)
    before = data_files(fs, root)
    store = Archive(arc)
    commits, _ = store.load_commits()
    g0, g1 = sorted(commits)
    fs.rm_file(f"{root}/{commits[g0].documents[0].state[0].path}")             # a deleted state
    notes = f"{root}/{commits[g1].notes.path}"
    fs.pipe_file(notes, fs.cat_file(notes)[:-100])                             # a truncated notes part
    fs.pipe_file(f"{root}/state/stray.g0.safetensors", b"left by a write that never committed")
    s = run_ingest(cfg_for(f"{run['base']}/corpus", arc, docs_per_group=2))
    assert (s["docs_ok"], s["docs_skipped"]) == (4, 0), s
    problems = " ".join(s["problems"])
    assert "missing" in problems and "truncated" in problems and "no commit record names" in problems
    assert data_files(fs, root) == before                                      # redone with the same bytes


def test_query_answers_and_flipped_notes_fail_with_an_integrity_error(run):
    fs = run["fs"]
    store = Archive(run["archive"])
    commits, _ = store.load_commits()
    part = f"{store.root}/{commits[sorted(commits)[0]].notes.path}"
    hit = {e.doc_id for e in commits[sorted(commits)[0]].documents}
    original = flip_bytes(fs, part)                                            # same size, other bytes
    try:
        out = f"{run['base']}/answers-flipped"
        s = run_query(qcfg(run["questions"], run["archive"], out, methods=["notebank"]))
        rows = answers(fs, out)
        failed = {q for q, r in rows.items() if r["status"] == "failed"}
        assert failed == {q for q, r in rows.items() if r["doc_id"] in hit} and len(failed) == 2 * len(hit)
        assert s["questions_failed"] == len(failed) and s["questions_ok"] == run["n_questions"] - len(failed)
        for q in failed:
            err = rows[q]["error"]
            assert "integrity check failed" in err and part.rsplit("/", 1)[1] in err and "commit record says" in err
            assert rows[q]["answer"] in (None, "")                            # never an answer
    finally:
        fs.pipe_file(part, original)                                          # repaired
    # a rerun into the same output answers the failed questions again, now from the repaired part
    s = run_query(qcfg(run["questions"], run["archive"], out, methods=["notebank"]))
    assert s["questions_failed"] == 0, s
    table = pds.dataset(strip(out), filesystem=fs, format="parquet").to_table().to_pylist()
    assert sorted(r["question_id"] for r in table) == sorted(rows)          # one row per question
    assert all(r["status"] == "ok" and r["retrieved"] for r in table)


def test_append_on_s3_equals_append_locally(run, tmp_path):
    fs = run["fs"]
    arc = _copy(run, "appended")
    local = tmp_path / "archive"
    shutil.copytree(run["local"], local)
    more = [{"doc_id": "doc1", "text": needle_text(900, 1, seed=99)[0]}]
    fs.pipe_file(strip(f"{run['base']}/more/part-0.jsonl"), "".join(json.dumps(r) + "\n" for r in more).encode())
    for out in (arc, local):
        s = run_ingest(cfg_for(f"{run['base']}/more", out, mode="append"))
        assert (s["docs_ok"], s["docs_failed"]) == (1, 0), s
    got, want = data_files(fs, strip(arc)), data_files(fsspec.filesystem("file"), str(local))
    assert got == want and any(".g1." in p for p in got)


def test_bytes_bench_counts_the_old_protocol_twice(tmp_path):
    """bench/s3_bytes.py, one small document, no Ray: temp + mv sends every byte twice, the shipped
    protocol once (plus the commit record)."""
    from bench import s3_bytes
    res = s3_bytes.main(["--docs", "1", "--chars", "1500", "--no-job", "--out", str(tmp_path / "b.json")])
    assert res["before"]["ratio_to_files"] > 1.9 and res["before"]["copies"] > 0
    assert res["after"]["ratio_to_files"] <= 1.1 and res["after"]["copies"] == 0
    assert res["after"]["temporary_names"] == 0 and res["bar_met"]
    assert (tmp_path / "b.md").read_text().count("|") > 10
