"""Ingest on a real local Ray: bad inputs, rerun/resume, determinism, refusal, actor and driver kills."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO, TEST_ACTORS, TINY_MODEL, TINY_NB, write_jsonl
from nbcore.testing import needle_text
from pipeline.config import IngestJobConfig, build
from pipeline.ingest import run_ingest
from pipeline.store import ArchiveStore, FingerprintMismatch

ACTORS = TEST_ACTORS


def cfg_for(corpus, output, **kw) -> IngestJobConfig:
    d = {"corpus": str(corpus), "output": str(output), "model": TINY_MODEL, "notebank": TINY_NB,
         "actors": ACTORS, "progress": False, "block_size": 512}
    for k, v in kw.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return build(IngestJobConfig, d).validate()


def good_docs(n, chars=1500, prefix="d"):
    return [{"doc_id": f"{prefix}{i}", "text": needle_text(chars + 97 * i, 2, seed=i)[0], "src": "gen"} for i in range(n)]


def ray_pid(actor) -> int:
    import ray
    return ray.get(actor.info.remote())["pid"]


def data_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for sub in ("notes", "state")
            for p in sorted((root / sub).glob("*")) if p.is_file()}


def test_bad_inputs_rerun_determinism_and_refusal(pool, other_pool, tmp_path):
    corpus = tmp_path / "corpus"
    docs = good_docs(4)
    write_jsonl(corpus / "part-0.jsonl", docs[:3] + [
        {"doc_id": "empty", "text": ""},
        {"doc_id": "short", "text": "Shorter than one chunk."},
        {"doc_id": "../x", "text": docs[0]["text"]},
        {"doc_id": "d1", "text": "a duplicate id with other text"},
        {"doc_id": "no-text"},
        {"text": "no id at all"},
    ], raw_lines=[b'{"doc_id": "utf8", "text": "bad \xff\xfe bytes"}'])
    pq.write_table(pa.table({"doc_id": [docs[3]["doc_id"]], "text": [docs[3]["text"]], "year": [2026]}),
                   corpus / "part-1.parquet")
    out = tmp_path / "out"
    s = run_ingest(cfg_for(corpus, out), workers=pool)
    assert (s["docs_ok"], s["docs_failed"], s["docs_skipped"]) == (5, 6, 0), s
    assert s["tokens"] > 6000 and s["notes"] > 0 and s["bytes"] > 0 and s["tokens_per_s"] > 0
    errors = {f["doc_id"]: f["error"] for f in s["failures"]}
    assert "empty document" in errors["empty"]
    assert "escape the output folder" in errors["../x"]
    assert "duplicate doc_id" in errors["d1"]
    assert errors["no-text"] == "missing text"
    anonymous = sorted(f["error"] for f in s["failures"] if f["doc_id"] is None)
    assert anonymous[0].startswith("invalid UTF-8") and "missing or invalid doc_id" in anonymous[1]
    store = ArchiveStore(str(out))
    recs = store.load_records()
    assert {k for k, r in recs.items() if r.status == "ok"} == {"d0", "d1", "d2", "d3", "short"}
    assert recs["short"].n_notes == 0 and recs["short"].n_tokens == len("Shorter than one chunk.")
    assert recs["empty"].status == "failed"
    assert recs["d3"].metadata == {"year": 2026} and recs["d0"].metadata == {"src": "gen"}
    fp = recs["d0"].fingerprint
    assert set(fp) >= {"model", "notebank", "projection_seed", "schema_versions"}
    assert store.count_rejected() == 4  # ../x, duplicate, missing id, invalid UTF-8
    assert recs["no-text"].status == "failed" and recs["no-text"].error == "missing text"
    assert not (out / "x").exists() and not (tmp_path / "x").exists()
    before = data_files(out)
    assert len(before) == 10

    # rerun: committed documents are skipped, nothing rewritten, failures re-recorded
    s2 = run_ingest(cfg_for(corpus, out), workers=pool)
    assert (s2["docs_ok"], s2["docs_skipped"], s2["docs_failed"]) == (0, 5, 6)
    assert data_files(out) == before

    # same inputs, another output, one actor (a fresh process): byte-identical archives
    s3 = run_ingest(cfg_for(corpus, tmp_path / "out1", actors={"num_actors": 1}))
    assert s3["docs_ok"] == 5 and data_files(tmp_path / "out1") == before

    # another NoteBank config into the same output is refused, clearly
    with pytest.raises(FingerprintMismatch, match=r"refusing to write.*notebank.chunk_size: 128 -> 64"):
        run_ingest(cfg_for(corpus, out, notebank={"chunk_size": 64}), workers=pool)
    with pytest.raises(FingerprintMismatch, match=r"different model.*model: '"):
        run_ingest(cfg_for(corpus, out, model={**TINY_MODEL, "seed": 1}), workers=other_pool)
    assert data_files(out) == before


def test_memory_fs_corpus_and_output(pool):
    import fsspec
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/mcorpus/a.jsonl", "\n".join(json.dumps(d) for d in good_docs(2)).encode())
    s = run_ingest(cfg_for("memory://mcorpus", "memory://marchive"), workers=pool)
    assert s["docs_ok"] == 2
    store = ArchiveStore("memory://marchive")
    assert sorted(store.load_records()) == ["d0", "d1"]
    assert store.document_payload("d0")["notes"][:4] == b"PAR1"
    # batch QA straight from the in-memory archive (the driver ships each document's bytes)
    from pipeline.config import QueryJobConfig
    from pipeline.query import run_query
    fs.pipe_file("/mq/q.jsonl", json.dumps({"question_id": "q", "doc_id": "d1", "question": "Which?",
                                            "answers": ["x"]}).encode())
    q = build(QueryJobConfig, {"questions": "memory://mq", "archive": "memory://marchive",
                               "output": "memory://manswers/a.parquet", "model": TINY_MODEL, "actors": ACTORS,
                               "progress": False, "methods": ["notebank"], "read": {"max_new_tokens": 3}})
    sq = run_query(q.validate(), workers=pool)
    assert sq["questions_ok"] == 1 and fs.exists("/manswers/a.parquet")


def test_killed_actor_loses_and_duplicates_nothing(pool, tmp_path):
    docs = good_docs(10, chars=2500)
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    cfg = cfg_for(corpus, tmp_path / "out")
    handles, infos = pool
    victim = ray_pid(handles[0])
    killed = []

    def on_commit(rec):
        if not killed and rec.status == "ok":
            os.kill(victim, signal.SIGKILL)  # mid-job: the other docs are queued or running
            killed.append(victim)

    s = run_ingest(cfg, on_commit=on_commit, workers=pool)
    assert killed and ray_pid(handles[0]) != victim  # Ray restarted the actor
    assert (s["docs_ok"], s["docs_failed"]) == (10, 0), s
    out = tmp_path / "out"
    recs = ArchiveStore(str(out)).load_records()
    assert sorted(recs) == sorted(d["doc_id"] for d in docs) and all(r.status == "ok" for r in recs.values())
    files = data_files(out)
    assert len(files) == 20 and not [p for p in out.rglob("*") if ".tmp-" in p.name]
    ref = run_ingest(cfg_for(corpus, tmp_path / "ref"), workers=pool)
    assert ref["docs_ok"] == 10 and data_files(tmp_path / "ref") == files


def test_killed_driver_then_rerun_matches_uninterrupted_run(pool, tmp_path):
    import ray
    docs = good_docs(10, chars=8000)
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    out = tmp_path / "out"
    gcs = ray.get_runtime_context().gcs_address
    cmd = [sys.executable, "jobs/ingest.py", "--set", f"corpus={corpus}", "--set", f"output={out}",
           "--set", f"model={json.dumps(TINY_MODEL)}", "--set", f"notebank={json.dumps(TINY_NB)}",
           "--set", "block_size=512", "--set", "progress=false", "--set", f"ray.address={gcs}",
           "--set", "actors={num_actors: 1, num_cpus: 0, torch_threads: 1}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    mdir = out / "manifest" / "docs"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if mdir.exists() and len(list(mdir.glob("*.json"))) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    n_done = len(list(mdir.glob("*.json")))
    assert 2 <= n_done < 10, "the driver must die mid-job"
    # rerun (same CLI, to completion)
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["docs_skipped"] >= n_done and s["docs_ok"] + s["docs_skipped"] == 10 and s["docs_failed"] == 0
    assert set(s) >= {"docs_ok", "docs_failed", "tokens", "notes", "bytes", "wall_s", "tokens_per_s"}
    recs = ArchiveStore(str(out)).load_records()
    assert len(recs) == 10 and all(r.status == "ok" for r in recs.values())
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    ref = run_ingest(cfg_for(corpus, tmp_path / "ref"), workers=pool)
    assert ref["docs_ok"] == 10
    assert data_files(out) == data_files(tmp_path / "ref")
