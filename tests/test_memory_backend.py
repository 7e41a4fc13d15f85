"""nbcore.memory: one backend interface for NoteBank and MoNe (ingest / append / answer / to_files /
from_files), on real tiny models: a random-init pure-GDN backbone with the byte tokenizer, and the
shipped frozen Qwen2 with its meta-trained MoNe parameters (models/tiny-qwen2). No Ray."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nbcore.config import NoteBankConfig, ReadConfig
from nbcore.memory import (BACKENDS, Memory, MemoryBackend, MemoryFiles, MemoryMismatch, MoneBackend,
                           NoteBankBackend, get_backend, notebank_append_available)

REPO = Path(__file__).resolve().parents[1]
BASE = str(REPO / "models" / "tiny-qwen2")
HAVE_MONE = (Path(BASE) / "mone" / "mone_config.json").is_file()
needs_mone = pytest.mark.skipif(not HAVE_MONE, reason="models/tiny-qwen2/mone (meta-trained MoNe) not shipped")
needs_append = pytest.mark.skipif(not notebank_append_available(),
                                  reason="nbcore.append / WriterCarry (incremental NoteBank ingest) not in nbcore yet")

# small chunks so that a ~1.5K-token document writes notes (same as tests/conftest.py TINY_NB)
NB = NoteBankConfig(chunk_size=128, write_budget=2, note_budget=32, window=16, tail=8, addr_dim=8)
TIMING = ("probe_s", "route_s", "replay_generate_s")
ROW_KEYS = {"answer", "token_ids", "retrieved", "votes", "replay_len", *TIMING}
READS = [{"method": "notebank", "top_r": 2, "max_new_tokens": 6},
         {"method": "notebank", "router": "embmax_centered", "top_r": 1, "max_new_tokens": 6, "lam": 0.0},
         {"method": "plain", "max_new_tokens": 6},
         {"method": "clean_start", "max_new_tokens": 4}]


def no_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMING}


def saved(files: MemoryFiles) -> MemoryFiles:
    """Through real safetensors bytes and JSON, as a pipeline would persist them."""
    from safetensors.torch import load, save
    notes = None if files.notes is None else [
        {**{k: v for k, v in r.items() if k != "addresses"}, "addresses": np.asarray(r["addresses"]).tolist()}
        for r in files.notes]
    notes = None if notes is None else json.loads(json.dumps(notes))
    return MemoryFiles(load(save(files.tensors)), notes, json.loads(json.dumps(files.facts)))


# ------------------------------------------------------------------------------------------------
# NoteBank

@pytest.fixture(scope="module")
def nb():
    """The shipped tiny GDN (it reads this needle, so answers depend on state and replay)."""
    from nbcore import load_backbone
    from nbcore.tasks import ruler
    torch.set_num_threads(1)
    bb = load_backbone(str(REPO / "models" / "tiny-gdn"))
    ex = ruler.generate("niah_single_1", 1500, 0, bb.tokenizer, seed=3, split="test")
    return NoteBankBackend(bb, NB, block_size=256), ex["context"], ex["question"], list(ex["answers"])


def test_notebank_files_round_trip_answers_equal(nb):
    from nbcore.reader import answer, ingest
    backend, text, q, answers = nb
    assert isinstance(backend, MemoryBackend) and backend.name == "notebank"
    assert backend.fingerprint() == backend.bb.fingerprint()
    assert backend.describe()["notebank"] == NB.to_dict()
    mem = backend.ingest("d1", text)
    ref = ingest(backend.bb, text, NB, block_size=256)          # what the worker does today
    assert len(mem.archive) > 0 and mem.n_tokens == ref.n_tokens
    files = backend.to_files(mem)
    f = files.facts
    assert (f["backend"], f["doc_id"], f["model"], f["n_tokens"]) == ("notebank", "d1", backend.fingerprint(), mem.n_tokens)
    assert (f["n_notes"], f["n_archived_tokens"]) == (len(mem.archive), mem.archive.n_archived_tokens)
    assert f["notebank"] == NB.to_dict() and {"prefill_s", "write_s", "ingest_s"} <= set(f["timings"])
    slots = backend.bb.n_channels * NB.addr_positions
    for i, r in enumerate(files.notes):
        assert r["note_index"] == i and r["token_ids"] == mem.archive.token_ids[i].tolist()
        assert r["addresses"].dtype == np.uint16 and r["addresses"].shape == (slots * NB.addr_dim,)
        assert r["text"] == backend.bb.tokenizer.decode(r["token_ids"])
        assert (r["start"], r["end"]) == (mem.archive.starts[i], mem.archive.ends[i])
    assert any(k.startswith("carry.") for k in files.tensors) == notebank_append_available()

    back = backend.from_files(saved(files))
    assert back.context_ids is None and back.parts == mem.parts
    assert torch.equal(back.archive.addresses.view(torch.int16), mem.archive.addresses.view(torch.int16))
    for read in READS:
        a = backend.answer(mem, q, read, answers=answers)
        b = backend.answer(back, q, read, answers=answers)
        assert set(a) == ROW_KEYS
        assert no_timing(a) == no_timing(b), read
        direct = answer(backend.bb, ref.state, ref.archive, q, ReadConfig(**read), answers=answers)
        assert (a["answer"], a["token_ids"], a["retrieved"], a["replay_len"]) == \
            (direct.text, list(direct.token_ids), list(direct.retrieved), direct.replay_len)
    # jrt needs the context: fine in the one-pass mode (fresh memory), an error after files
    assert backend.answer(mem, q, {"method": "jrt", "max_new_tokens": 2})["replay_len"] == 0
    with pytest.raises(ValueError, match="not persisted"):
        backend.answer(back, q, {"method": "jrt", "max_new_tokens": 2})
    assert backend.read_fields({"method": "plain", "stop": ["\n"]}) == {
        "method": "plain", "read_config": json.dumps({**ReadConfig().__dict__, "method": "plain", "stop": ["\n"]},
                                                     sort_keys=True)}


def test_notebank_to_files_is_deterministic(nb):
    from safetensors.torch import save
    backend, text, _, _ = nb
    mem = backend.ingest("d1", text)
    outs = [backend.to_files(mem), backend.to_files(mem), backend.to_files(backend.ingest("d1", text))]
    blobs = [save(o.tensors) for o in outs]
    assert blobs[0] == blobs[1] == blobs[2]

    def plain(rows):
        return [{**r, "addresses": r["addresses"].tobytes()} for r in rows]
    assert plain(outs[0].notes) == plain(outs[1].notes) == plain(outs[2].notes)
    # the files own their tensors: answering (which copies the state) or mutating them leaves mem alone
    t = next(v for v in outs[0].tensors.values() if v.is_floating_point())
    t.add_(1.0)
    assert save(backend.to_files(mem).tensors) == blobs[1]


@needs_append
def test_notebank_append_equals_nbcore_append(nb):
    from nbcore.reader import append, ingest
    backend, text, q, answers = nb
    cut = text.index(" ", len(text) // 2)
    a, b = text[:cut], text[cut:]
    mem = backend.append(backend.ingest("d1", a), b)
    ref0 = ingest(backend.bb, a, NB, block_size=256)
    ref = append(backend.bb, ref0.state, ref0.archive, ref0.carry, b, NB, block_size=256)
    assert mem.n_tokens == ref.archive.n_tokens == ref0.n_tokens + len(ref.token_ids)
    assert [p["n_tokens"] for p in mem.parts] == [ref0.n_tokens, len(ref.token_ids)]
    assert mem.context_ids.tolist() == ref0.token_ids.tolist() + ref.token_ids.tolist()
    assert len(ref.archive) > len(ref0.archive)
    assert [z.tolist() for z in mem.archive.token_ids] == [z.tolist() for z in ref.archive.token_ids]
    assert torch.equal(mem.archive.addresses.view(torch.int16), ref.archive.addresses.view(torch.int16))
    for k, v in backend.bb.state_to_tensors(ref.state).items():
        assert torch.equal(backend.bb.state_to_tensors(mem.state)[k], v), k
    # the carry survives files: appending after a round trip equals appending in memory
    mid = backend.ingest("d1", a)
    via_files = backend.append(backend.from_files(saved(backend.to_files(mid))), b)
    assert no_timing(backend.answer(via_files, q, READS[0], answers)) == no_timing(backend.answer(mem, q, READS[0], answers))
    x, y = backend.to_files(via_files), backend.to_files(mem)
    assert x.tensors.keys() == y.tensors.keys()
    for k in y.tensors:
        assert torch.equal(x.tensors[k], y.tensors[k]), k
    with pytest.raises(ValueError, match="empty"):
        backend.append(mid, "")


# ------------------------------------------------------------------------------------------------
# MoNe

@pytest.fixture(scope="module")
def mone():
    from nbcore.tasks import ruler
    torch.set_num_threads(1)
    backend = get_backend("mone", base_dir=BASE)
    ex = ruler.generate("niah_single_1", 420, 0, backend.tokenizer, seed=3, split="test")
    return backend, ex


def _ids(backend, text):
    return backend.tokenizer(text, add_special_tokens=False)["input_ids"]


def _assert_same_state(a, b):
    assert (a.pending, a.n_segments, a.n_tokens, a.segment_len) == (b.pending, b.n_segments, b.n_tokens, b.segment_len)
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


@needs_mone
def test_mone_files_round_trip_answers_equal(mone):
    from nbcore.mone import state as mstate
    from nbcore.mone.backend_support import model_fingerprint
    backend, ex = mone
    assert isinstance(backend, MemoryBackend) and backend.methods == ("mone",)
    assert backend.fingerprint() == model_fingerprint(BASE, f"{BASE}/mone")
    d = backend.describe()
    assert (d["memory"], d["model"], d["mone"]["segment_len"]) == ("mone", backend.fingerprint(), 128)
    in_memory = MoneBackend(backend.model, backend.tokenizer)        # no files: a digest of the weights
    assert in_memory.fingerprint() == MoneBackend(backend.model, backend.tokenizer).fingerprint() != backend.fingerprint()
    mem = backend.ingest("d1", ex["context"])
    ids = _ids(backend, ex["context"])
    _assert_same_state(mem.state, mstate.ingest(backend.model, ids))
    files = backend.to_files(mem)
    assert files.notes is None
    f = files.facts
    assert (f["backend"], f["model"], f["n_tokens"], f["n_segments"], f["n_pending"]) == \
        ("mone", backend.fingerprint(), len(ids), len(ids) // 128, len(ids) % 128)
    back = backend.from_files(saved(files))
    _assert_same_state(back.state, mem.state)
    read = {"max_new_tokens": 8, "stop": ["\n"], "stop_at_eos": True}
    a, b = backend.answer(mem, ex["question"], read), backend.answer(back, ex["question"], read)
    assert set(a) == ROW_KEYS and no_timing(a) == no_timing(b)
    assert (a["retrieved"], a["votes"], a["replay_len"], a["probe_s"]) == ([], [], 0, 0.0)
    # what the old pipeline MoneWorker computed (and the query actor now does, through the backend)
    fast = mstate.finalized(backend.model, mem.state)
    out = backend.model.generate(_ids(backend, ex["question"]), fast, 8, backend.tokenizer.eos_token_id)
    assert a["token_ids"] == out and a["answer"] == backend.tokenizer.decode(out).split("\n")[0]
    assert backend.answer(mem, ex["question"], {**read, "max_new_tokens": 0})["token_ids"] == []
    assert backend.read_fields(read) == {"method": "mone", "read_config": json.dumps(
        {"method": "mone", **read}, sort_keys=True)}
    with pytest.raises(ValueError, match="method"):
        backend.answer(mem, ex["question"], {"method": "notebank"})
    with pytest.raises(ValueError, match="empty"):
        backend.ingest("d2", "")


@needs_mone
def test_mone_append_equals_state_append(mone):
    from nbcore.mone import state as mstate
    backend, ex = mone
    text = ex["context"]
    cut = text.index(" ", len(text) // 3)
    a, b = text[:cut], text[cut:]
    first = backend.ingest("d1", a)
    mem = backend.append(first, b)
    ref = mstate.append(backend.model, mstate.ingest(backend.model, _ids(backend, a)), _ids(backend, b))
    _assert_same_state(mem.state, ref)
    assert [p["n_tokens"] for p in mem.parts] == [len(_ids(backend, a)), len(_ids(backend, b))]
    _assert_same_state(first.state, mstate.ingest(backend.model, _ids(backend, a)))      # input unchanged
    # append to a state read back from files: the same state
    _assert_same_state(backend.append(backend.from_files(saved(backend.to_files(first))), b).state, ref)


@needs_mone
def test_mone_moved_code_keeps_the_pipeline_values(mone):
    """backend_support / read_fields give the values pipeline/mone_pipeline.py (now removed) gave."""
    from nbcore.mone.backend_support import adapters_dir, cut_at_stop, files_digest
    assert adapters_dir(BASE, None) == f"{BASE}/mone" and adapters_dir(BASE, "x") == "x"
    base, ad = Path(BASE), Path(BASE) / "mone"
    files = [base / "config.json", *sorted(base.glob("*.safetensors")), ad / "mone_config.json",
             ad / "mone_adapters.safetensors"]
    backend, _ = mone
    assert backend.fingerprint() == files_digest(files)
    for text, stop, want in (("ab\ncd", ["\n"], "ab"), ("abc", [], "abc"), ("xyz.q\n", [".", "\n", ""], "xyz")):
        assert cut_at_stop(text, stop) == want
    gen = {"max_new_tokens": 3, "stop": ["\n"], "stop_at_eos": False}
    assert backend.read_fields(gen)["read_config"] == \
        '{"max_new_tokens": 3, "method": "mone", "stop": ["\\n"], "stop_at_eos": false}'


@needs_mone
def test_from_files_refuses_other_backend_or_model(nb, mone):
    nbb, text, _, _ = nb
    mb, ex = mone
    mfiles = mb.to_files(mb.ingest("d1", ex["context"]))
    nfiles = nbb.to_files(nbb.ingest("d1", text[:600]))
    with pytest.raises(MemoryMismatch, match="'mone' backend"):
        nbb.from_files(mfiles)
    with pytest.raises(MemoryMismatch, match="'notebank' backend"):
        mb.from_files(nfiles)
    with pytest.raises(MemoryMismatch, match="model"):
        mb.from_files(MemoryFiles(mfiles.tensors, None, {**mfiles.facts, "model": "other"}))
    with pytest.raises(ValueError, match="missing"):
        mb.from_files(MemoryFiles({k: v for k, v in mfiles.tensors.items() if not k.startswith("counters.")},
                                  None, mfiles.facts))
    with pytest.raises(ValueError, match="got a memory of 'notebank'"):
        mb.answer(Memory("notebank", "d1", None), "q", {})


# ------------------------------------------------------------------------------------------------
# registry

def test_unknown_backend_name_lists_valid_ones():
    assert set(BACKENDS) == {"notebank", "mone"}
    with pytest.raises(ValueError, match=r"unknown memory backend 'rag'; valid: \['mone', 'notebank'\]"):
        get_backend("rag")


def test_nbcore_exports_the_interface():
    import nbcore
    assert nbcore.get_backend is get_backend and nbcore.MemoryFiles is MemoryFiles
