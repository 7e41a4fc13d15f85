"""The commit protocol and integrity checks of pipeline/archive.py, without Ray: create-only commit
records (a retried batch's same record counts, another writer's is refused), files written once under
their final names on object stores, orphans deleted only under the lease, and damaged notes parts
refused before their rows are used (open_archive, the query actor and an append here; the whole query
job on S3 in test_s3.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import TINY_MODEL, TINY_NB
from nbcore.testing import needle_text
from notebank.pipeline.archive import Archive, CommitConflict, IntegrityError
from notebank.schemas import archive as S


def flip_bytes(fs, path: str, n: int = 8) -> bytes:
    """Overwrite n bytes in the middle of a file with their complement (same size). -> the original."""
    data = fs.cat_file(path)
    mid = len(data) // 2
    fs.pipe_file(path, data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + n]) + data[mid + n:])
    return data


def _group(store: Archive, group: str = "g", doc: str = "d") -> S.CommitRecord:
    t = {"rec.0": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    refs = store.write_state(doc, 0, t, doc_id=doc, model_fingerprint="m")
    entry = S.DocEntry(doc_id=doc, key=doc, status="ok", n_tokens=5, state=refs)
    row = {"doc_id": doc, "generation": 0, "status": "ok", "memory": "notebank", "n_tokens": 5, "n_notes": 0,
           "n_archived_tokens": 0, "model_fingerprint": "m", "group": group}
    return store.write_group(group, [entry], [], [row], n_slots=2, addr_dim=2, fp_digest="f",
                             timings={"group_s": 1.0})


@pytest.mark.parametrize("where", ["LOCAL", "memory://integrity-commit"])
def test_commit_record_is_create_only(where, tmp_path):
    import uuid
    url = str(tmp_path / "a") if where == "LOCAL" else f"{where}-{uuid.uuid4().hex[:6]}"
    store = Archive(url)
    first = _group(store)
    raw = store.fs.cat_file(store.path(store.rel_commit("g")))
    # the same batch again (its actor died after the commit, before its reply): the record counts
    again = dataclasses.replace(first, committed_at="2000-01-01T00:00:00+00:00", timings={"group_s": 9.0})
    assert store.write_commit(again).committed_at == first.committed_at
    assert store.fs.cat_file(store.path(store.rel_commit("g"))) == raw
    # another writer's record of the same group (other files): refused, the first one stays
    other = dataclasses.replace(first, documents=[dataclasses.replace(first.documents[0], n_tokens=6)])
    with pytest.raises(CommitConflict, match="another writer"):
        store.write_commit(other)
    assert store.fs.cat_file(store.path(store.rel_commit("g"))) == raw
    assert not [p for p in store.fs.find(store.root) if ".tmp-" in p]


def test_object_store_writes_final_names_only(tmp_path):
    """memory:// is not local: no temporary names, no moves (the S3 byte count is in test_s3.py)."""
    import uuid
    store = Archive(f"memory://integrity-final-{uuid.uuid4().hex[:6]}")
    assert not store.local and Archive(str(tmp_path)).local
    moved = []
    real_mv = store.fs.mv
    store.fs.mv = lambda *a, **k: moved.append(a) or real_mv(*a, **k)
    try:
        rec = _group(store)
    finally:
        del store.fs.mv
    assert not moved
    names = sorted(p.split(store.root + "/", 1)[1] for p in store.fs.find(store.root))
    assert names == sorted([rec.documents_file.path, store.rel_commit("g")] + [r.path for r in rec.documents[0].state])


def test_clean_unreferenced_needs_the_lease(tmp_path):
    from notebank.pipeline.safety import OutputBusy, acquire_lease
    out = tmp_path / "a"
    store = Archive(str(out))
    rec = _group(store)
    orphan = store.write_state("lost", 0, {"x": torch.zeros(3)}, doc_id="lost", model_fingerprint="m")[0]
    commits, _ = store.load_commits()
    with acquire_lease(str(out), {"job": "test"}) as lease:
        assert store.clean_unreferenced(commits, store.file_sizes(), lease) == [orphan.path]
    assert not (out / orphan.path).exists()
    assert all((out / r.path).exists() for r in rec.files())
    store.write_state("lost", 0, {"x": torch.zeros(3)}, doc_id="lost", model_fingerprint="m")
    with pytest.raises(OutputBusy):              # released: no longer ours, nothing deleted
        store.clean_unreferenced(commits, store.file_sizes(), lease)
    assert (out / orphan.path).exists()


def test_flipped_notes_part_fails_its_readers_until_repaired(tmp_path):
    """Same size, other bytes: the sizes check passes, the sha256 check before reading does not."""
    import nbcore
    from notebank.pipeline.actors import IngestActor
    out = tmp_path / "out"
    actor = IngestActor(model=TINY_MODEL, nb=TINY_NB, block_size=512, output=str(out), fp_digest="x",
                        tokenizer_name="byte")
    store = Archive(str(out))
    store.check_or_write_run({"model": actor.fp, "notebank": TINY_NB})
    for g in range(2):
        docs = [{"row": 0, "shard": "c.jsonl", "action": "ingest", "reason": None, "doc_id": f"d{g}", "key": f"d{g}",
                 "generation": 0, "group_id": f"g{g}", "text": needle_text(1500 + 100 * g, 2, seed=g)[0],
                 "metadata": {}}]
        actor.ingest_group(f"g{g}", docs)
    arc = nbcore.open_archive(str(out))
    good = arc.notes("d0")
    assert good and arc.notes("d1")
    part = out / Archive.rel_notes("g0")
    original = flip_bytes(store.fs, str(part))
    fresh = nbcore.open_archive(str(out))                  # sizes match: nothing looks damaged
    assert not fresh.problems and [d["doc_id"] for d in fresh.documents()] == ["d0", "d1"]
    with pytest.raises(IntegrityError, match=r"integrity check failed: .*g0\.parquet has sha256 [0-9a-f]{64}, "
                                             r"its commit record says [0-9a-f]{64}"):
        fresh.notes("d0")
    assert fresh.notes("d1")                               # the other group's part is fine
    # the query job's actor, in this process: the questions on d0 fail with the error, d1's are answered
    import json
    from notebank.pipeline.actors import QueryActor
    from notebank.pipeline.dataplane import committed_documents
    _, committed, _ = committed_documents(store, verify=False, repair=False)
    needed = {d: {k: committed[d][k] for k in ("state", "notes_files", "generation", "n_tokens")} for d in committed}
    qa = QueryActor(model=TINY_MODEL, archive=str(out), output=str(tmp_path / "answers"),
                    read={"max_new_tokens": 4, "top_r": 2}, nb=TINY_NB, docs_ref=needed,
                    provenance={"archive": str(out), "model_fingerprint": actor.fp, "notebank": json.dumps(TINY_NB)})
    ask = lambda d: qa.answer_document([{"question_id": f"{d}-q", "doc_id": d, "question": "What number?",
                                         "methods": json.dumps(["notebank"]), "answers": json.dumps(["1"]),
                                         "source_shard": "q.jsonl", "source_row": 0}])
    r0, r1 = ask("d0"), ask("d1")
    assert r0["status"] == ["failed"] and "integrity check failed" in r0["error"][0] and "g0.parquet" in r0["error"][0]
    assert r1["status"] == ["ok"]
    # an append reads the document's notes first: it fails with the same error, and writes no state
    prev = {k: committed["d0"][k] for k in ("state", "notes_files", "generation", "n_tokens")}
    recs = actor.ingest_group("g2", [{"row": 0, "shard": "more.jsonl", "action": "append", "reason": None,
                                      "doc_id": "d0", "key": "d0", "generation": 1, "group_id": "g2",
                                      "text": "More text for d0.", "metadata": {}, "previous": prev}])
    assert recs[0]["status"] == "failed" and "integrity check failed" in recs[0]["error"], recs
    assert not (out / Archive.rel_state("d0", 1)).exists()
    part.write_bytes(original)                             # repaired
    key = lambda notes: [(n["note_index"], n["text"], list(n["token_ids"])) for n in notes]
    assert key(fresh.notes("d0")) == key(good)
    assert ask("d0")["status"] == ["ok"]                   # the failed check was not remembered
