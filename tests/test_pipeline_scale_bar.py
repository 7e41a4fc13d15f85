"""The data-plane bar, end to end through the CLIs: 130 generated documents of ~600 tokens with the
shipped tiny GDN -> an archive readable as one table -> batch QA readable as one dataset."""
from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.dataset as pds
import pytest

from conftest import REPO, write_jsonl

pytestmark = pytest.mark.slow
N_DOCS = 130


def test_130_documents_through_jobs_ingest_and_query(ray_session, tmp_path):
    import ray
    from nbcore.tasks import ruler
    from nbcore.tasks.tokenizer import load_tokenizer
    if not (REPO / "models/tiny-gdn/config.json").exists():
        pytest.fail("the shipped model models/tiny-gdn is missing")
    tok = load_tokenizer()
    docs, qs = [], []
    for i in range(N_DOCS):
        ex = ruler.generate("niah_single_1", 600, i, tok, seed=3)
        docs.append({"doc_id": f"doc-{i:04d}", "text": ex["context"]})
        qs.append({"question_id": f"q-{i:04d}", "doc_id": f"doc-{i:04d}", "question": ex["question"],
                   "answers": list(ex["answers"])})
    write_jsonl(tmp_path / "corpus" / "part-0.jsonl", docs[:70])
    write_jsonl(tmp_path / "corpus" / "part-1.jsonl", docs[70:])
    write_jsonl(tmp_path / "questions.jsonl", qs)
    gcs = ray.get_runtime_context().gcs_address
    common = ["--set", f"ray.address={gcs}", "--set", f"model.path={REPO / 'models/tiny-gdn'}",
              "--set", "progress=false", "--set", "actors={num_actors: 2, num_cpus: 0, torch_threads: 1}", "--json"]
    out = tmp_path / "archive"
    r = subprocess.run([sys.executable, "jobs/ingest.py", "-c", "configs/ingest.yaml", "--set",
                        f"corpus={tmp_path / 'corpus'}", "--set", f"output={out}", *common],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["docs_ok"] == N_DOCS and s["docs_failed"] == 0, s
    notes_files = list((out / "notes").glob("*.parquet"))
    assert 1 <= len(notes_files) <= 8
    notes = pds.dataset(str(out / "notes"), format="parquet").to_table()
    assert len(set(notes.column("doc_id").to_pylist())) == N_DOCS
    for row in notes.slice(0, 50).to_pylist():
        assert row["text"] == tok.decode(row["token_ids"])
    docs_t = pds.dataset(str(out / "documents"), format="parquet").to_table()
    assert docs_t.num_rows == N_DOCS and len(set(docs_t.column("text_sha256").to_pylist())) == N_DOCS
    r = subprocess.run([sys.executable, "jobs/query.py", "-c", "configs/query.yaml", "--set",
                        f"questions={tmp_path / 'questions.jsonl'}", "--set", f"archive={out}", "--set",
                        f"output={tmp_path / 'answers'}", "--set", "methods=[notebank]",
                        "--set", "read.max_new_tokens=12", *common],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    q = json.loads(r.stdout.strip().splitlines()[-1])
    answers = pds.dataset(str(tmp_path / "answers"), format="parquet").to_table()
    assert answers.num_rows == N_DOCS and q["questions_ok"] == N_DOCS
    assert set(answers.column("status").to_pylist()) == {"ok"}

    # The same archive from a notebook, in the README's three lines: the documents, their decoded
    # notes, and an answer equal to the query job's (same memory, same read settings).
    import nbcore
    arc = nbcore.open_archive(str(out), model=str(REPO / "models/tiny-gdn"))
    listed = arc.documents()
    assert [d["doc_id"] for d in listed] == sorted(d["doc_id"] for d in docs)
    assert all(d["n_tokens"] > 0 for d in listed)
    by_q = {r["question_id"]: r for r in answers.to_pylist()}
    for i in (0, 97):
        notes_i = arc.notes(f"doc-{i:04d}")
        assert notes_i and all(n["text"] == tok.decode(n["token_ids"]) for n in notes_i)
        got = arc.ask(f"doc-{i:04d}", qs[i]["question"], max_new_tokens=12)
        want = by_q[f"q-{i:04d}"]
        assert got.answer == want["answer"] and got.retrieved == list(want["retrieved"]), (got, want)
    with pytest.raises(KeyError, match="not in"):
        arc.notes("no-such-doc")
