"""Archive <-> bytes with a real tiny model (no Ray): exact round trips, determinism, clear errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import TINY_MODEL, TINY_NB
from nbcore import NoteBankConfig, ReadConfig, answer, ingest
from nbcore.testing import needle_text
from notebank.pipeline import archive_io
from notebank.pipeline.store import ArchiveError, FingerprintMismatch
from notebank.pipeline.worker import NoteBankWorker, build_backbone
from notebank.schemas._base import SchemaError


@pytest.fixture(scope="module")
def bb():
    torch.set_num_threads(1)
    return build_backbone(TINY_MODEL)


@pytest.fixture(scope="module")
def doc(bb):
    text, needles = needle_text(2500, 2, seed=1)
    return text, needles, ingest(bb, text, NoteBankConfig(**TINY_NB))


def test_notes_roundtrip_is_exact_and_deterministic(bb, doc):
    text, _, res = doc
    assert len(res.archive) > 0
    data = archive_io.archive_to_notes_bytes("d", res.archive, bb.n_channels)
    again = archive_io.archive_to_notes_bytes("d", ingest(bb, text, NoteBankConfig(**TINY_NB)).archive, bb.n_channels)
    assert data == again  # same inputs -> same bytes
    back = archive_io.notes_bytes_to_archive(data, "notes/d.parquet", expect_model=bb.fingerprint())
    a = res.archive
    assert torch.equal(back.addresses.view(torch.uint16), a.addresses.view(torch.uint16))
    assert all(np.array_equal(x, y) for x, y in zip(back.token_ids, a.token_ids))
    for f in ("starts", "ends", "chunk_index"):
        assert np.array_equal(getattr(back, f), getattr(a, f))
    assert back.config == a.config and back.n_tokens == a.n_tokens and back.fingerprint() == a.fingerprint()


@pytest.mark.parametrize("variant", ["m4", "m4qnovelmargin"])
def test_multi_slot_archives_roundtrip_and_route_identically(bb, doc, variant):
    """Addressing variants with m address slots per channel survive the Parquet round trip."""
    from nbcore.evals.methods import VARIANTS, method_config
    text, needles, _ = doc
    cfg = NoteBankConfig(**{**TINY_NB, **VARIANTS[variant][0]})
    a = ingest(bb, text, cfg).archive
    assert a.addresses.shape[1] == bb.n_channels * cfg.addr_positions
    back = archive_io.notes_bytes_to_archive(archive_io.archive_to_notes_bytes("d", a, bb.n_channels), "n")
    assert torch.equal(back.addresses.view(torch.uint16), a.addresses.view(torch.uint16))
    assert back.config == a.config
    res = ingest(bb, text, cfg)
    rc = method_config(f"nb-{variant}-top2", max_new_tokens=2)
    q = f"What is the special magic number for {needles[0][0]}?"
    assert answer(bb, res.state, back, q, rc).retrieved == answer(bb, res.state, a, q, rc).retrieved


def test_state_roundtrip_gives_identical_answers(bb, doc):
    text, needles, res = doc
    data = archive_io.state_to_bytes(bb.state_to_tensors(res.state), doc_id="d", model_fingerprint=bb.fingerprint())
    data2 = archive_io.state_to_bytes(bb.state_to_tensors(ingest(bb, text, NoteBankConfig(**TINY_NB)).state),
                                      doc_id="d", model_fingerprint=bb.fingerprint())
    assert data == data2
    state = bb.state_from_tensors(archive_io.bytes_to_state_tensors(data, "s", expect_model=bb.fingerprint()))
    notes = archive_io.notes_bytes_to_archive(archive_io.archive_to_notes_bytes("d", res.archive, bb.n_channels), "n")
    q = f"What is the special magic number for {needles[0][0]}?"
    for m in ("plain", "notebank"):
        rc = ReadConfig(method=m, max_new_tokens=6)
        a1, a2 = answer(bb, res.state, res.archive, q, rc), answer(bb, state, notes, q, rc)
        assert a1.token_ids == a2.token_ids and a1.retrieved == a2.retrieved


def test_corrupted_files_and_wrong_model_are_named(bb, doc):
    _, _, res = doc
    notes = archive_io.archive_to_notes_bytes("d", res.archive, bb.n_channels)
    state = archive_io.state_to_bytes(bb.state_to_tensors(res.state), doc_id="d", model_fingerprint=bb.fingerprint())
    with pytest.raises(SchemaError, match=r"memory://o/notes/d\.parquet: not a readable Parquet"):
        archive_io.notes_bytes_to_archive(notes[:-40], "memory://o/notes/d.parquet")
    with pytest.raises(ArchiveError, match=r"o/state/d\.safetensors: not a readable safetensors"):
        archive_io.bytes_to_state_tensors(state[: len(state) // 2], "o/state/d.safetensors")
    with pytest.raises(ArchiveError, match="not a readable safetensors"):
        archive_io.bytes_to_state_tensors(b"\x00" * 4, "o/state/d.safetensors")
    with pytest.raises(FingerprintMismatch, match=r"o/notes/d\.parquet: archive was written by model"):
        archive_io.notes_bytes_to_archive(notes, "o/notes/d.parquet", expect_model="other")
    with pytest.raises(FingerprintMismatch, match=r"o/state/d\.safetensors: state was written by model"):
        archive_io.bytes_to_state_tensors(state, "o/state/d.safetensors", expect_model="other")


def test_worker_without_ray_handles_bad_documents():
    w = NoteBankWorker(TINY_MODEL, 1)
    r = w.ingest_doc({"doc_id": "e", "text": ""}, TINY_NB, 8192)
    assert not r["ok"] and "empty document" in r["error"]
    r = w.ingest_doc({"doc_id": "s", "text": "Too short."}, TINY_NB, 8192)
    assert r["ok"] and r["n_notes"] == 0 and r["n_tokens"] == 10  # shorter than C: empty archive

