"""Ingest on Ray Data with a real local Ray: bad inputs, rerun/resume, determinism, refusal, actor and
driver kills, damaged files and shards, two writers, symlink escape, a changed checkpoint."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pds
import pyarrow.parquet as pq
import pytest

from conftest import REPO, TEST_ACTORS, TINY_MODEL, TINY_NB, write_jsonl
from nbcore.testing import needle_text
from notebank.pipeline.archive import Archive, FingerprintMismatch, LayoutError
from notebank.pipeline.config import ConfigError, IngestJobConfig, build
from notebank.pipeline.ingest import run_ingest

ACTORS = TEST_ACTORS


def cfg_for(corpus, output, **kw) -> IngestJobConfig:
    d = {"corpus": str(corpus), "output": str(output), "model": TINY_MODEL, "notebank": TINY_NB,
         "actors": ACTORS, "progress": False, "block_size": 512, "docs_per_group": 3}
    for k, v in kw.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return build(IngestJobConfig, d).validate()


def good_docs(n, chars=1500, prefix="d"):
    return [{"doc_id": f"{prefix}{i}", "text": needle_text(chars + 97 * i, 2, seed=i)[0], "src": "gen"} for i in range(n)]


def data_files(root: Path) -> dict[str, bytes]:
    """Every data file (notes, documents, states) by relative path: what must be byte-identical."""
    return {str(p.relative_to(root)): p.read_bytes() for sub in ("notes", "documents", "state")
            for p in sorted((root / sub).rglob("*")) if p.is_file()}


def commits(root: Path) -> list[Path]:
    d = root / "manifest" / "commits"
    return sorted(d.glob("*.json")) if d.exists() else []


def docs_table(root: Path):
    return pds.dataset(str(root / "documents"), format="parquet").to_table()


def test_bad_inputs_rerun_determinism_and_refusal(ray_session, tmp_path):
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
    s = run_ingest(cfg_for(corpus, out))
    assert (s["docs_ok"], s["docs_failed"], s["docs_skipped"]) == (5, 6, 0), s
    assert s["tokens"] > 6000 and s["notes"] > 0 and s["bytes"] > 0 and s["tokens_per_s"] > 0
    errors = {f["doc_id"]: f["error"] for f in s["failures"]}
    assert "empty document" in errors["empty"]
    assert "escape the output folder" in errors["../x"]
    assert "duplicate doc_id" in errors["d1"]
    assert errors["no-text"] == "missing text"
    anonymous = sorted(f["error"] for f in s["failures"] if f["doc_id"] is None)
    assert anonymous[0].startswith("invalid UTF-8") and "missing or invalid doc_id" in anonymous[1]
    assert all(f["source"]["shard"].endswith(("part-0.jsonl", "part-1.parquet")) for f in s["failures"])
    assert not (out / "x").exists() and not (tmp_path / "x").exists()
    # the documents table: one row per ingested document, ok or failed, with per-document facts
    t = docs_table(out).to_pylist()
    by = {r["doc_id"]: r for r in t}
    assert {k for k, r in by.items() if r["status"] == "ok"} == {"d0", "d1", "d2", "d3", "short"}
    assert by["short"]["n_notes"] == 0 and by["short"]["n_tokens"] == len("Shorter than one chunk.")
    assert by["empty"]["status"] == "failed" and "empty document" in by["empty"]["error"]
    assert json.loads(by["d3"]["metadata"]) == {"year": 2026} and json.loads(by["d0"]["metadata"]) == {"src": "gen"}
    assert len({r["model_fingerprint"] for r in t}) == 1 and by["d0"]["tokenizer"] == "byte"
    assert by["d1"]["n_tokens"] != by["d0"]["n_tokens"]          # per-document values, not the first file's
    notes = pds.dataset(str(out / "notes"), format="parquet").to_table()
    assert set(notes.column("doc_id").to_pylist()) == {"d0", "d1", "d2", "d3"}
    row = notes.slice(0, 1).to_pylist()[0]
    assert row["text"] == bytes(t - 3 for t in row["token_ids"]).decode()   # byte tokenizer: id = 3 + byte
    before = data_files(out)
    assert len(list((out / "notes").glob("*.parquet"))) <= 4

    # rerun: committed groups are skipped, nothing rewritten
    s2 = run_ingest(cfg_for(corpus, out))
    assert (s2["docs_ok"], s2["docs_skipped"]) == (0, 5), s2
    assert data_files(out) == before

    # same inputs, another output, one actor (a fresh process): byte-identical archives
    s3 = run_ingest(cfg_for(corpus, tmp_path / "out1", actors={"num_actors": 1}))
    assert s3["docs_ok"] == 5 and data_files(tmp_path / "out1") == before

    # another NoteBank config or another model into the same output is refused, clearly
    with pytest.raises(FingerprintMismatch, match=r"refusing to write.*notebank.chunk_size: 128 -> 64"):
        run_ingest(cfg_for(corpus, out, notebank={"chunk_size": 64}))
    with pytest.raises(FingerprintMismatch, match=r"different model.*model: '"):
        run_ingest(cfg_for(corpus, out, model={**TINY_MODEL, "seed": 1}))
    assert data_files(out) == before


def test_damaged_files_are_redone_and_truncated_shard_is_recorded(ray_session, tmp_path):
    docs = good_docs(6)
    corpus = tmp_path / "corpus"
    write_jsonl(corpus / "a.jsonl", docs[:3])
    write_jsonl(corpus / "b.jsonl", docs[3:])
    out = tmp_path / "out"
    assert run_ingest(cfg_for(corpus, out))["docs_ok"] == 6
    before = data_files(out)
    # truncate one state and delete one notes part: both groups are redone, with the same bytes
    state = sorted((out / "state").glob("d1.*"))[0]
    state.write_bytes(state.read_bytes()[:100])
    notes_b = [p for p in (out / "notes").glob("b-*.parquet")][0]
    notes_b.unlink()
    s = run_ingest(cfg_for(corpus, out))
    assert (s["docs_ok"], s["docs_skipped"]) == (6, 0), s
    assert any("truncated" in p for p in s["problems"]) and any("missing" in p for p in s["problems"])
    assert data_files(out) == before

    # a truncated Parquet shard: recorded as failed with its path, the other shards go on
    bad = tmp_path / "corpus2"
    write_jsonl(bad / "good.jsonl", good_docs(2, prefix="g"))
    big = good_docs(40, chars=300, prefix="p")
    pq.write_table(pa.table({"doc_id": [d["doc_id"] for d in big], "text": [d["text"] for d in big]}),
                   bad / "trunc.parquet", row_group_size=4)
    raw = (bad / "trunc.parquet").read_bytes()
    (bad / "trunc.parquet").write_bytes(raw[: len(raw) // 2])
    s = run_ingest(cfg_for(bad, tmp_path / "out2"))
    assert s["docs_ok"] == 2 and s["shards_failed"] == 1, s
    f = [f for f in s["failures"] if f.get("shard")][0]
    assert f["shard"].endswith("trunc.parquet") and "unreadable" in f["error"]
    rec = json.loads((tmp_path / "out2" / "manifest" / "shards").glob("trunc-*.json").__next__().read_text())
    assert rec["status"] == "failed"
    s = run_ingest(cfg_for(bad, tmp_path / "out2"))        # the rerun is not aborted either
    assert s["docs_skipped"] == 2 and s["shards_failed"] == 1


def test_refusals_before_any_model_work(ray_session, tmp_path):
    from notebank.pipeline.safety import OutputBusy, UnsafePath, acquire_lease
    corpus = write_jsonl(tmp_path / "c.jsonl", good_docs(2))
    # two writers on one output: the second is refused, naming the first
    out = tmp_path / "busy"
    with acquire_lease(str(out), {"job": "ingest", "argv": "the other job"}):
        with pytest.raises(OutputBusy, match=str(os.getpid())):
            run_ingest(cfg_for(corpus, out))
    # a notes/ symlink that leaves the output folder
    out2 = tmp_path / "linked"
    out2.mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", out2 / "notes")
    with pytest.raises(UnsafePath, match="notes"):
        run_ingest(cfg_for(corpus, out2))
    assert not list((tmp_path / "elsewhere").iterdir())
    # an archive in layout 1 is refused with its version named
    old = tmp_path / "v1"
    (old / "manifest" / "docs").mkdir(parents=True)
    with pytest.raises(LayoutError, match="layout 1"):
        run_ingest(cfg_for(corpus, old))
    with pytest.raises(FileNotFoundError):
        run_ingest(cfg_for(tmp_path / "missing", tmp_path / "o3"))
    assert not (tmp_path / "o3").exists()
    with pytest.raises(ConfigError, match="memory://"):
        run_ingest(cfg_for(corpus, "memory://nope"))


def test_changed_checkpoint_is_refused(ray_session, tmp_path):
    """A checkpoint whose weights changed where a 16-values-per-tensor sample would not look."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    kw = dict(TINY_MODEL["hf_config"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw))
    ck = tmp_path / "ck"
    model.save_pretrained(ck)
    spec = {"path": str(ck), "hf_config": None, "tokenizer": "byte", "device": "cpu"}
    corpus = write_jsonl(tmp_path / "c.jsonl", good_docs(2))
    out = tmp_path / "out"
    assert run_ingest(cfg_for(corpus, out, model=spec))["docs_ok"] == 2
    f = next(ck.glob("*.safetensors"))
    w = load_file(f)
    name = max(w, key=lambda k: w[k].numel())
    flat = w[name].reshape(-1)
    stride = max(1, flat.numel() // 16)
    mask = torch.ones_like(flat, dtype=torch.bool)
    mask[::stride] = False                        # keep exactly the old sampled positions
    flat[mask] += 0.01
    save_file(w, f, metadata={"format": "pt"})
    with pytest.raises(FingerprintMismatch, match="model"):
        run_ingest(cfg_for(corpus, out, model=spec))


def test_killed_actor_loses_and_duplicates_nothing(ray_session, tmp_path):
    docs = good_docs(10, chars=2500)
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    killed = []

    def on_commit(rec):
        if not killed and rec["status"] == "ok":
            os.kill(int(rec["pid"]), signal.SIGKILL)   # mid-job: the other groups are queued or running
            killed.append(rec["pid"])

    out = tmp_path / "out"
    s = run_ingest(cfg_for(corpus, out, docs_per_group=2), on_commit=on_commit)
    assert killed
    assert (s["docs_ok"], s["docs_failed"]) == (10, 0), s
    t = docs_table(out)
    assert sorted(t.column("doc_id").to_pylist()) == sorted(d["doc_id"] for d in docs)   # exactly once
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    ref = run_ingest(cfg_for(corpus, tmp_path / "ref", docs_per_group=2))
    assert ref["docs_ok"] == 10 and data_files(tmp_path / "ref") == data_files(out)


def test_killed_driver_then_rerun_matches_uninterrupted_run(ray_session, tmp_path):
    import ray
    docs = good_docs(10, chars=8000)
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    out = tmp_path / "out"
    gcs = ray.get_runtime_context().gcs_address
    cmd = [sys.executable, "jobs/ingest.py", "--set", f"corpus={corpus}", "--set", f"output={out}",
           "--set", f"model={json.dumps(TINY_MODEL)}", "--set", f"notebank={json.dumps(TINY_NB)}",
           "--set", "block_size=512", "--set", "progress=false", "--set", f"ray.address={gcs}",
           "--set", "docs_per_group=1", "--set", "actors={num_actors: 1, num_cpus: 0, torch_threads: 1}", "--json"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if len(commits(out)) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    n_done = len(commits(out))
    assert 2 <= n_done < 10, "the driver must die mid-job"
    assert (out / "_lease.json").exists()           # left behind by the killed driver: taken over below
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["docs_skipped"] >= n_done and s["docs_ok"] + s["docs_skipped"] == 10 and s["docs_failed"] == 0
    assert sorted(docs_table(out).column("doc_id").to_pylist()) == sorted(d["doc_id"] for d in docs)
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name] and not (out / "_lease.json").exists()
    ref = run_ingest(cfg_for(corpus, tmp_path / "ref", docs_per_group=1))
    assert ref["docs_ok"] == 10
    assert data_files(out) == data_files(tmp_path / "ref")


def test_ingest_actor_without_ray_on_memory_fs(tmp_path):
    """The actor class itself, in this process, writing real Parquet through fsspec memory://."""
    import fsspec
    from notebank.pipeline.actors import IngestActor
    fs = fsspec.filesystem("memory")
    actor = IngestActor(model=TINY_MODEL, nb=TINY_NB, block_size=512, output="memory://ia/out", fp_digest="x",
                        tokenizer_name="byte")
    docs = [{"row": i, "shard": "memory://c.jsonl", "action": "ingest", "reason": None, "doc_id": d["doc_id"],
             "key": d["doc_id"], "generation": 0, "group_id": "g0", "text": d["text"], "metadata": {}}
            for i, d in enumerate(good_docs(2))]
    recs = actor.ingest_group("g0", docs)
    assert [r["status"] for r in recs] == ["ok", "ok"]
    assert fs.exists("/ia/out/manifest/commits/g0.json") and fs.exists("/ia/out/notes/g0.parquet")
    store = Archive("memory://ia/out")
    c, problems = store.load_commits()
    assert not problems and not store.group_problems(c["g0"], store.file_sizes(), verify=True)
    again = IngestActor(model=TINY_MODEL, nb=TINY_NB, block_size=512, output="memory://ia/out2", fp_digest="x",
                        tokenizer_name="byte")
    again.ingest_group("g0", docs)
    assert fs.cat_file("/ia/out/notes/g0.parquet") == fs.cat_file("/ia/out2/notes/g0.parquet")
    assert fs.cat_file("/ia/out/state/d0.g0.safetensors") == fs.cat_file("/ia/out2/state/d0.g0.safetensors")


def test_mode_append_continues_documents_and_equals_one_shot(ray_session, tmp_path):
    """mode: append adds text to archived documents from their stored state and chunk position; the
    archive gains only the new notes, and equals a one-shot ingest of the parts (nbcore.append's rule)."""
    import torch
    from nbcore import NoteBankConfig, ingest
    from notebank.pipeline.actors import load_archive
    from nbcore.backbones.loading import build_backbone
    docs = good_docs(3, chars=1400)
    cut = [500, 777, 1029]                       # inside chunks, mid-sentence
    first = [{"doc_id": d["doc_id"], "text": d["text"][:c]} for d, c in zip(docs, cut)]
    second = [{"doc_id": d["doc_id"], "text": d["text"][c:]} for d, c in zip(docs, cut)]
    write_jsonl(tmp_path / "a.jsonl", first)
    write_jsonl(tmp_path / "b.jsonl", second)
    out = tmp_path / "out"
    assert run_ingest(cfg_for(tmp_path / "a.jsonl", out))["docs_ok"] == 3
    notes_before = pds.dataset(str(out / "notes"), format="parquet").to_table()
    s = run_ingest(cfg_for(tmp_path / "b.jsonl", out, mode="append"))
    assert s["docs_ok"] == 3 and s["docs_failed"] == 0, s
    again = run_ingest(cfg_for(tmp_path / "b.jsonl", out, mode="append"))   # idempotent rerun
    assert again["docs_skipped"] == 3 and again["docs_ok"] == 0
    write_jsonl(tmp_path / "c.jsonl", [{"doc_id": "d0", "text": "More text. For d0."}])
    bad = run_ingest(cfg_for(tmp_path / "c.jsonl", out))                     # without mode: append: refused
    assert bad["docs_failed"] == 1 and "mode: append" in bad["failures"][0]["error"]
    notes = pds.dataset(str(out / "notes"), format="parquet").to_table()
    assert notes.num_rows > notes_before.num_rows
    old = notes.filter(pds.field("generation") == 0).sort_by([("doc_id", "ascending"), ("note_index", "ascending")])
    assert old.equals(notes_before.sort_by([("doc_id", "ascending"), ("note_index", "ascending")]))
    bb = build_backbone(TINY_MODEL)
    nb = NoteBankConfig(**TINY_NB)
    store = Archive(str(out))
    from notebank.pipeline.dataplane import committed_documents
    _, committed, _ = committed_documents(store, verify=True, repair=False)
    for d, a, b in zip(docs, first, second):
        ref = ingest(bb, None, nb, parts=[a["text"], b["text"]], block_size=512)
        c = committed[d["doc_id"]]
        assert c["generation"] == 1
        got = load_archive(store, d["doc_id"], c["notes_files"], 1, nb, bb.fingerprint(), c["n_tokens"], bb.n_channels)
        assert got.starts.tolist() == ref.archive.starts.tolist() and got.ends.tolist() == ref.archive.ends.tolist()
        assert all((x == y).all() for x, y in zip(got.token_ids, ref.archive.token_ids))
        diff = (got.addresses.float() - ref.archive.addresses.float()).abs().max().item() if len(got) else 0.0
        assert diff <= 0.02, diff                 # bf16 addresses: within one bf16 step of the one-shot ones
        st = store.read_state([__import__("notebank.schemas.archive", fromlist=["FileRef"]).FileRef(**r) for r in c["state"]])
        ref_t = bb.state_to_tensors(ref.state)
        for k, v in ref_t.items():
            assert torch.allclose(st[k].float(), v.float(), atol=1e-5), k
    t = docs_table(out).to_pylist()
    latest = {r["doc_id"]: r for r in sorted(t, key=lambda r: r["generation"])}
    assert all(r["generation"] == 1 and r["n_tokens"] == len(d["text"]) for d, r in zip(docs, (latest[d["doc_id"]] for d in docs)))


def _lines(path: Path, lines: list[bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(l + b"\n" for l in lines))
    return path


def test_rerun_retries_fixed_rows_and_equals_a_fresh_ingest(ray_session, tmp_path):
    """Rows that failed (bad JSON, bad UTF-8, an empty document) and were fixed in place are tried
    again by a plain rerun: their groups are redone, and the archive equals a fresh ingest of the
    fixed corpus. A row that still fails the same way is not retried."""
    docs = good_docs(6, chars=500)
    js = [json.dumps(d).encode() for d in docs]
    broken = [js[0], b'{"doc_id": "d1", "text": ', js[2], json.dumps({"doc_id": "d3", "text": ""}).encode(),
              js[4], b'{"doc_id": "d5", "text": "bad \xff bytes"}', json.dumps({"doc_id": "e", "text": ""}).encode()]
    corpus = _lines(tmp_path / "c" / "part-0.jsonl", broken)
    out = tmp_path / "out"
    s = run_ingest(cfg_for(corpus, out, docs_per_group=2))
    assert (s["docs_ok"], s["docs_failed"], s["docs_retried"]) == (3, 4, 0), s
    same = run_ingest(cfg_for(corpus, out, docs_per_group=2))          # nothing changed: nothing retried
    assert (same["docs_ok"], same["docs_skipped"], same["docs_retried"], same["groups_redone"]) == (0, 3, 0, 0), same
    fixed = [js[0], js[1], js[2], js[3], js[4], js[5], broken[6]]       # "e" stays empty: fails the same way
    _lines(corpus, fixed)
    off = run_ingest(cfg_for(corpus, out, docs_per_group=2, retry_failed=False))
    assert (off["docs_ok"], off["docs_retried"]) == (0, 0), off
    s2 = run_ingest(cfg_for(corpus, out, docs_per_group=2))
    assert (s2["docs_retried"], s2["docs_retried_ok"], s2["docs_rewritten"], s2["groups_redone"]) == (3, 3, 3, 3), s2
    assert (s2["docs_ok"], s2["docs_failed"], s2["docs_skipped"]) == (6, 0, 0), s2     # group of "e" untouched
    recs = {e["source"]["row"]: e for c in commits(out) for e in json.loads(c.read_text())["documents"]}
    assert [r for r, e in sorted(recs.items()) if e["retried"]] == [1, 3, 5]
    assert recs[6]["status"] == "failed" and not recs[6]["retried"]
    fresh = tmp_path / "fresh"
    assert run_ingest(cfg_for(corpus, fresh, docs_per_group=2))["docs_ok"] == 6
    assert data_files(out) == data_files(fresh)
    drop = lambda c: {**c, "committed_at": None, "timings": None,
                      "documents": [{**e, "retried": False} for e in c["documents"]]}
    assert [drop(json.loads(c.read_text())) for c in commits(out)] == \
        [drop(json.loads(c.read_text())) for c in commits(fresh)]
    again = run_ingest(cfg_for(corpus, out, docs_per_group=2))
    assert (again["docs_ok"], again["docs_retried"], again["docs_skipped"]) == (0, 0, 6), again
