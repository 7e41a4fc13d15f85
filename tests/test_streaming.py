"""The `streaming` family (nbcore.backbones.streaming): a real transformers LlamaForCausalLM with a
tiny random config, read with 4 attention sinks + a sliding window of 16 tokens.

Invariants, as for the recurrent families (tests/test_backbones.py):
  (a) chunked prefill with carried state == the naive reference `naive_windowed_logits` (the whole
      sequence at once, each query's windowed attention computed on its own by the position rule);
      and with a window that holds the whole sequence, the naive reference == the transformers
      model's own forward;
  (b) a copied state is independent;
  (c) positions continue at replay (state + more tokens == the naive reference over the
      concatenation); the reset (lam = 0) == a fresh read of [sink tokens, new tokens];
  (d) the state's size does not grow with T.
Tolerance: fp32 logits atol 2e-5 (the kernel tiles queries, rotates in a relative frame and
sums the sink and window parts of the softmax separately, the reference does one softmax per query;
measured max |diff| 3.0e-7 over the four splits, torch 2.13 CPU).
Then NoteBank end to end on the same model: ingest, route (native, embmax_centered, BM25), replay,
the reset; append == ingest(parts); the memory backend's files round trip.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import nbcore.backbones.streaming as streaming
from nbcore import NoteBankConfig, load_backbone
from nbcore.backbones.base import RawTap
from nbcore.backbones.streaming import StreamingBackbone, naive_windowed_logits
from nbcore.config import ReadConfig
from nbcore.testing import byte_tokenizer, sentence_text

ATOL = 2e-5
SINKS, WINDOW = 4, 16


def tiny_llama_config(max_pos: int = 512):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_pos,
                       rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _bb(window=WINDOW, sinks=SINKS, **kw) -> StreamingBackbone:
    torch.set_num_threads(1)
    return load_backbone(tiny_llama_config(**kw), tokenizer=byte_tokenizer(), seed=0,
                         streaming={"sinks": sinks, "window": window})


@pytest.fixture(scope="module")
def bb():
    return _bb()


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 262, (n,), generator=g)


def _prefill(bb, ids, cuts):
    """Forward ids in pieces ending at `cuts` (+ the end): -> (state, {end: last logits})."""
    st, out, a = bb.new_state(), {}, 0
    for b in [*cuts, len(ids)]:
        out[b] = bb.forward(st, ids[a:b])
        a = b
    return st, out


def test_family_and_channels(bb):
    assert bb.family == "streaming" and isinstance(bb, StreamingBackbone)
    assert (bb.n_channels, bb.heads_per_layer, bb.key_dim) == (2 * 2, 2, 16)


def test_naive_reference_with_whole_window_is_the_transformers_model():
    bb = _bb(window=200)
    ids = _ids(60)
    ref = bb.model(input_ids=ids[None]).logits[0].float()
    naive = naive_windowed_logits(bb, ids)
    assert (naive - ref).abs().max() < ATOL
    _, out = _prefill(bb, ids, [7, 31])
    for end, logits in out.items():
        assert (logits - ref[end - 1]).abs().max() < ATOL


@pytest.mark.parametrize("cuts", [[], [1, 2, 3, 9], [5, 21, 40], [16, 17, 70]])
def test_chunked_prefill_equals_naive_reference(bb, cuts):
    ids = _ids(90, seed=1)
    naive = naive_windowed_logits(bb, ids)
    _, out = _prefill(bb, ids, cuts)
    for end, logits in out.items():
        assert (logits - naive[end - 1]).abs().max() < ATOL, end
    # and the sliding window really bounds attention: full attention differs
    full = _bb(window=200).model(input_ids=ids[None]).logits[0, -1].float()
    assert (full - naive[-1]).abs().max() > 1e-3


def test_tiles_and_pieces_equal_one_tile(monkeypatch):
    """The kernel's query tiles and layer-major pieces (QUERY_TILE, PIECE) change nothing."""
    ids = _ids(100, seed=2)
    ref_state, ref = _prefill(_bb(), ids, [50])
    monkeypatch.setattr(streaming, "QUERY_TILE", 3)
    monkeypatch.setattr(streaming, "PIECE", 8)
    st, out = _prefill(_bb(), ids, [50])
    for end in ref:
        assert (out[end] - ref[end]).abs().max() < ATOL
    a, b = _bb().state_to_tensors(ref_state), _bb().state_to_tensors(st)
    assert a.keys() == b.keys() and all((a[k].float() - b[k].float()).abs().max() < ATOL for k in a)


def test_copied_state_is_independent(bb):
    ids = _ids(60, seed=3)
    st, _ = _prefill(bb, ids, [])
    before = {k: v.clone() for k, v in bb.state_to_tensors(st).items()}
    cp = bb.copy_state(st)
    bb.forward(cp, _ids(25, seed=4))
    bb.reset_state(cp, 0.0)
    after = bb.state_to_tensors(st)
    assert all(torch.equal(before[k], after[k]) for k in before) and st.n_tokens == 60
    assert cp.n_tokens == 85


def test_positions_continue_at_replay(bb):
    ctx, replay = _ids(70, seed=5), _ids(12, seed=6)
    st, _ = _prefill(bb, ctx, [33])
    logits = bb.forward(bb.copy_state(st), replay)
    naive = naive_windowed_logits(bb, torch.cat([ctx, replay]))
    assert (logits - naive[-1]).abs().max() < ATOL
    # token by token (generation) as well
    s2 = bb.copy_state(st)
    for t in range(len(replay)):
        lt = bb.forward(s2, replay[t:t + 1])
    assert (lt - naive[-1]).abs().max() < ATOL and s2.n_tokens == 82


def test_reset_drops_window_keeps_sinks(bb):
    """lam = 0: the next tokens see the sinks and themselves only, at positions from `sinks` on:
    a fresh read of [the first `sinks` tokens, new tokens]. The counter keeps running."""
    ctx, replay = _ids(50, seed=7), _ids(10, seed=8)
    st, _ = _prefill(bb, ctx, [])
    bb.reset_state(st, 0.0)
    assert st.cache.n_window() == 0 and st.cache.n_sinks() == SINKS and st.n_tokens == 50
    logits = bb.forward(st, replay)
    fresh = bb.forward(bb.new_state(), torch.cat([ctx[:SINKS], replay]))
    assert (logits - fresh).abs().max() < ATOL and st.n_tokens == 60
    st2, _ = _prefill(bb, ctx, [])
    bb.reset_state(st2, 1.0)
    assert st2.cache.n_window() == WINDOW
    with pytest.raises(ValueError, match="lam 0"):
        bb.reset_state(st2, 0.5)


def test_state_size_does_not_grow(bb):
    sizes = {}
    for T in (40, 200, 600):
        st, _ = _prefill(bb, _ids(T, seed=9), [])
        sizes[T] = bb.state_bytes(st)
        assert st.cache.n_window() == WINDOW and st.cache.n_sinks() == SINKS
    assert sizes[40] == sizes[200] == sizes[600] == 2 * 2 * (SINKS + WINDOW) * 2 * 16 * 4


def test_state_round_trip_through_tensors(bb):
    ids, more = _ids(45, seed=10), _ids(9, seed=11)
    st, _ = _prefill(bb, ids, [])
    bb.reset_state(st, 0.0)
    bb.forward(st, ids[:5])
    back = bb.state_from_tensors({k: v.clone() for k, v in bb.state_to_tensors(st).items()})
    assert back.n_tokens == st.n_tokens and back.cache.win_start == st.cache.win_start
    assert torch.equal(bb.forward(bb.copy_state(st), more), bb.forward(back, more))


def test_captured_features_are_pre_rope_keys_and_group_mean_queries():
    bb = _bb(window=200)
    ids = _ids(40, seed=12)
    tap = RawTap(len(bb.rec_layers))
    bb.forward(bb.new_state(), ids[:17], tap=tap)
    bb.forward(bb.new_state(), ids[:0 + 1])        # a second state does not disturb the tap
    st = bb.new_state()
    tap = RawTap(len(bb.rec_layers))
    bb.forward(st, ids[:17], tap=tap)
    bb.forward(st, ids[17:], tap=tap)
    q, k = tap.result()                                               # [T, J, d]
    hs = bb.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    for li, layer in enumerate(bb.model.model.layers):
        x = layer.input_layernorm(hs[li][0])
        kr = layer.self_attn.k_proj(x).view(40, 2, 16)
        qr = layer.self_attn.q_proj(x).view(40, 2, 2, 16).mean(2)
        assert (k[:, 2 * li:2 * li + 2] - kr).abs().max() < 1e-5
        assert (q[:, 2 * li:2 * li + 2] - qr).abs().max() < 1e-5


def test_loader_options_and_errors(tmp_path):
    from notebank.pipeline.config import ConfigError, ModelSpec
    bb = _bb(window=32, sinks=2)
    assert (bb.sinks, bb.window) == (2, 32)
    bb.model.save_pretrained(tmp_path)
    bb.tokenizer.save_pretrained(tmp_path)
    from nbcore.backbones.loading import build_backbone
    b2 = build_backbone({"path": str(tmp_path), "device": "cpu", "streaming": {"window": 32, "sinks": 2}})
    ids = _ids(50, seed=13)
    assert torch.equal(bb.forward(bb.new_state(), ids), b2.forward(b2.new_state(), ids))
    assert b2.fingerprint() == bb.fingerprint() != _bb(window=33, sinks=2).fingerprint()
    assert load_backbone(tiny_llama_config(max_pos=2048)).window == streaming.DEFAULT_WINDOW
    with pytest.raises(ValueError, match="unknown option"):
        load_backbone(tmp_path, streaming={"windw": 8})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load_backbone(tiny_llama_config(max_pos=64), streaming={"window": 100})
    from nbcore.testing import tiny_gdn_config
    with pytest.raises(ValueError, match="streaming options given"):
        load_backbone(tiny_gdn_config(), streaming={"window": 8})
    with pytest.raises(ConfigError, match="streaming"):
        ModelSpec(path=str(tmp_path), streaming={"window": 0}).validate()
    with pytest.raises(ConfigError, match="streaming"):
        ModelSpec(path=str(tmp_path), streaming={"size": 3}).validate()
    ModelSpec(path=str(tmp_path), streaming={"sinks": 4, "window": 1024}).validate()


# ------------------------------------------------------------------------------------------------
# NoteBank on the streaming model

NB = NoteBankConfig(chunk_size=64, write_budget=2, note_budget=16, window=8, tail=8, addr_dim=8)
TEXT = sentence_text(900, seed=4)


@pytest.fixture(scope="module")
def nbb():
    return _bb(window=64)


def test_notebank_end_to_end(nbb):
    from nbcore.reader import answer, ingest
    res = ingest(nbb, TEXT, NB, block_size=128)
    assert len(res.archive) >= 2 * (res.n_tokens // 64) - 2 and tuple(res.archive.addresses.shape[1:]) == (nbb.n_channels, 8)
    assert res.state.cache.n_window() == 64
    q = "What is the special number?"
    outs = {}
    for rc in [ReadConfig(max_new_tokens=4), ReadConfig(router="embmax_centered", max_new_tokens=4),
               ReadConfig(router="embmax_centered", lam=0.0, max_new_tokens=4),
               ReadConfig(router="bm25", max_new_tokens=4), ReadConfig(method="plain", max_new_tokens=4),
               ReadConfig(method="clean_start", max_new_tokens=4)]:
        before = nbb.state_to_tensors(res.state)
        a = answer(nbb, res.state, res.archive, q, rc)
        assert all(torch.equal(before[k], v) for k, v in nbb.state_to_tensors(res.state).items())
        outs[(rc.method, rc.router, rc.lam)] = a
        if rc.method == "notebank" and rc.router != "bm25":     # BM25 finds no word of q here
            assert len(a.retrieved) == 2 and a.replay_len == sum(len(res.archive.token_ids[i]) for i in a.retrieved)
    # replay after the reset == a fresh read of [sinks, notes, question] (the reset's meaning)
    a = outs[("notebank", "embmax_centered", 0.0)]
    notes = np.concatenate([res.archive.token_ids[i] for i in a.retrieved])
    q_ids = nbb.tokenizer(q, add_special_tokens=False)["input_ids"]
    fresh = nbb.new_state()
    lg = nbb.forward(fresh, torch.as_tensor(np.concatenate([res.token_ids[:SINKS], notes, q_ids])))
    assert a.token_ids[:1] == [int(lg.argmax())]


def test_append_equals_ingest_parts(nbb):
    from nbcore.reader import append, ingest
    cut = TEXT.index(" ", 400)
    one = ingest(nbb, None, NB, parts=[TEXT[:cut], TEXT[cut:]], block_size=128)
    first = ingest(nbb, TEXT[:cut], NB, block_size=128)
    two = append(nbb, first.state, first.archive, first.carry, TEXT[cut:], NB, block_size=128)
    assert two.n_tokens == one.n_tokens
    assert np.array_equal(one.archive.starts, two.archive.starts) and np.array_equal(one.archive.ends, two.archive.ends)
    assert all(np.array_equal(a, b) for a, b in zip(one.archive.token_ids, two.archive.token_ids))
    d = (one.archive.addresses.float() - two.archive.addresses.float()).abs()
    assert (d <= 2 ** -7 * one.archive.addresses.float().abs() + 1e-6).all()
    s1, s2 = nbb.state_to_tensors(one.state), nbb.state_to_tensors(two.state)
    assert all((s1[k].float() - s2[k].float()).abs().max() < 1e-5 for k in s1)


def test_memory_backend_files_round_trip(nbb):
    """The backend the pipeline's actors and the notebook API (nbcore.open_archive) answer with."""
    from safetensors.torch import load, save

    from nbcore.memory import MemoryFiles, NoteBankBackend
    backend = NoteBankBackend(nbb, NB, block_size=128)
    mem = backend.ingest("d1", TEXT)
    files = backend.to_files(mem)
    back = backend.from_files(MemoryFiles(load(save(files.tensors)), files.notes, files.facts))
    mem2 = backend.append(back, " The end is near. Numbers are 5.")
    assert mem2.n_tokens > mem.n_tokens
    for read in [{"method": "notebank", "top_r": 2, "max_new_tokens": 4},
                 {"method": "notebank", "router": "embmax_centered", "lam": 0.0, "max_new_tokens": 4}]:
        a = backend.answer(mem, "What is it?", read)
        b = backend.answer(back, "What is it?", read)
        assert (a["answer"], a["retrieved"], a["token_ids"]) == (b["answer"], b["retrieved"], b["token_ids"])


def test_forward_hidden_rows_are_the_logits(bb):
    ids = _ids(40, seed=14)
    st = bb.new_state()
    h = bb.forward_hidden(st, ids)
    last = bb.forward(bb.new_state(), ids)
    assert h.shape == (40, 64) and st.n_tokens == 40
    assert (bb.model.lm_head(h[-1]).float() - last).abs().max() < ATOL


def test_sweep_runner_on_a_tiny_streaming_model(tmp_path):
    """A RULER config whose model is a (random) Llama with `streaming:` options, run by the Ray-free
    runner: the cells land where jobs/evaluate.py puts them, a rerun skips them, the summary reads them."""
    import json

    import pandas as pd

    from bench.streaming_summary import main as summary
    from bench.streaming_sweep import main as sweep
    model = {"hf_config": {"model_type": "llama", "vocab_size": 262, "hidden_size": 64, "intermediate_size": 128,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                           "max_position_embeddings": 2048, "tie_word_embeddings": True, "bos_token_id": 1,
                           "eos_token_id": 2, "pad_token_id": 0},
             "tokenizer": "byte", "device": "cpu", "streaming": {"sinks": 4, "window": 128}}
    args = ["-c", str(Path(__file__).resolve().parents[1] / "configs" / "eval_streaming_smollm2.yaml"),
            "--set", f"output={tmp_path}/ruler",
            "--set", f"backbones=[{{name: rand-stream, model: {json.dumps(model)}, notebank: {{chunk_size: 256}}}}]",
            "--set", "tasks=[niah_single_2]", "--set", "lengths=[1K]", "--set", "n_examples=1",
            "--set", "methods=[plain, nb-tf-top2-reset, nb-oracle-top2]", "--set", "max_new_tokens=2"]
    res = sweep(args)
    assert len(res) == 1 and res[0]["error"] is None
    rows = pd.read_parquet(res[0]["path"])
    assert list(rows.method) == ["plain", "nb-tf-top2-reset", "nb-oracle-top2"] and (rows.n_notes > 0).all()
    assert sweep(args) == []                                       # resumable: the finished cell is skipped
    s = summary(["--ruler", f"{tmp_path}/ruler", "--out", str(tmp_path)])
    assert set(s) == {f"rand-stream/{m}/niah_single_2/1K" for m in ("plain", "nb-tf-top2-reset", "nb-oracle-top2")}
    # two processes on the same cells: --reverse starts from the last one, and a cell that the other
    # process finished meanwhile is skipped, not run again
    import notebank.pipeline.evaluate as ev
    more = [a if a != "n_examples=1" else "n_examples=3" for a in args]
    real, ran = ev.run_cell, []

    def run_and_meanwhile_the_other_process(cell):
        ran.append(Path(cell["path"]).name)
        r = real(cell)
        if len(ran) == 1:                        # the forward process finishes example 1 meanwhile
            ev.run_cell = real
            assert [Path(x["path"]).name for x in sweep(more + ["--max-cells", "1"])] == ["0001.parquet"]
        return r
    ev.run_cell = run_and_meanwhile_the_other_process
    try:
        res = sweep(more + ["--reverse"])
    finally:
        ev.run_cell = real
    assert ran == ["0002.parquet"] and [Path(r["path"]).name for r in res] == ["0002.parquet"]
    assert pd.read_parquet(Path(res[0]["path"]).with_name("0001.parquet")).shape[0] == 3


def test_ingest_over_several_pieces_per_block(nbb, monkeypatch):
    """A block longer than PIECE reaches the tap as one call per layer per piece (chunk-aligned):
    the archive equals the one written with a piece per block."""
    from nbcore.reader import ingest
    ref = ingest(nbb, TEXT, NB, block_size=256)
    monkeypatch.setattr(streaming, "PIECE", 128)
    nbb._rope = None                                   # the RoPE table is sized by PIECE
    got = ingest(nbb, TEXT, NB, block_size=256)
    nbb._rope = None
    assert np.array_equal(ref.archive.starts, got.archive.starts)
    assert all(np.array_equal(a, b) for a, b in zip(ref.archive.token_ids, got.archive.token_ids))
    d = (ref.archive.addresses.float() - got.archive.addresses.float()).abs()
    assert (d <= 2 ** -7 * ref.archive.addresses.float().abs() + 1e-6).all()
