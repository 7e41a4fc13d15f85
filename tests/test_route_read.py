"""Route (Eq. 5), read (Eq. 6) and the end-to-end reader on real tiny backbones."""
import numpy as np
import pytest
import torch

from nbcore import NoteBankConfig, ReadConfig, answer, ingest, load_backbone
from nbcore.backbones import RawTap
from nbcore.notebank.features import reference_features
from nbcore.notebank.route import native_votes, native_votes_naive, top_r
from nbcore.notebank.routers import ROUTERS
from nbcore.notebank.sentences import sentence_ids_from_offsets, tokenize_with_sentences
from nbcore.notebank.write import ArchiveWriter
from nbcore.reader import coords_for, encode_context
from nbcore.testing import byte_tokenizer, needle_text, tiny_gdn_config, tiny_mamba2_config

CFG = NoteBankConfig(chunk_size=256, note_budget=64, window=48, tail=32, addr_dim=8)


# ---- Eq. 5 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("Q,N,J", [(1, 1, 1), (7, 13, 5), (64, 63, 12)], ids=lambda v: str(v))
def test_native_votes_fast_equals_naive(Q, N, J):
    g = torch.Generator().manual_seed(Q + N)
    u = torch.randn(Q, J, 8, generator=g).to(torch.bfloat16)
    a = torch.randn(N, J, 8, generator=g).to(torch.bfloat16)
    v = native_votes(u, a)
    assert torch.equal(v, native_votes_naive(u, a))
    assert int(v.sum()) == J                        # every channel votes once


def test_votes_tie_to_earlier_note_and_ignore_magnitude():
    u = torch.tensor([[[1.0, 0.0]]])                # Q=1, J=1
    a = torch.tensor([[[2.0, 0.0]], [[5.0, 0.0]], [[0.0, 1.0]]])   # notes 0 and 1 tie (cosine 1)
    assert native_votes(u, a).tolist() == [1, 0, 0]


def test_top_r_order_ties_and_zero_votes():
    starts = np.array([50, 10, 30, 20])
    assert top_r(np.array([3, 3, 1, 0]), 2, starts) == [1, 0]       # tie -> earlier insert; doc order out
    assert top_r(np.array([0, 5, 0, 0]), 4, starts) == [1]           # zero-vote notes never retrieved
    assert top_r(np.array([1, 1, 1, 1]), 3, starts) == [1, 2, 0]


# ---- sentences ----------------------------------------------------------------------------------
def test_sentence_boundaries_from_offsets():
    tok = byte_tokenizer()
    text = "Pi is 3.14 here. Next one!\nLine 3。尾"
    ids, sent = tokenize_with_sentences(tok, text, add_special_tokens=False)
    pieces = {}
    for i, s in enumerate(sent):
        pieces.setdefault(int(s), []).append(int(ids[i]))
    texts = [tok.decode(v) for _, v in sorted(pieces.items())]
    assert texts == ["Pi is 3.14 here.", " Next one!", "\n", "Line 3。", "尾"]
    assert sentence_ids_from_offsets("", np.zeros((0, 2))).shape == (0,)


# ---- end to end on real backbones ----------------------------------------------------------------
@pytest.fixture(scope="module", params=["gdn", "gdn-hybrid", "mamba2"])
def bb(request):
    cfg = {"gdn": tiny_gdn_config(), "gdn-hybrid": tiny_gdn_config(hybrid=True),
           "mamba2": tiny_mamba2_config()}[request.param]
    return load_backbone(cfg, tokenizer=byte_tokenizer())


@pytest.fixture(scope="module")
def doc():
    return needle_text(3000, n_needles=3, seed=1)


def _random_text(n, seed=0):
    g = np.random.default_rng(seed)
    return "".join(g.choice(list("abcdefghij klmnop. qrstuvwxyz!\n")) for _ in range(n))


def test_ingest_fast_equals_naive_writer(bb):
    text = _random_text(2600)
    res = ingest(bb, text, CFG, block_size=1024)
    # naive: full q/k of the whole document, reference reductions, one feed
    ids, sent = encode_context(bb, text)
    tap = RawTap(len(bb.rec_layers))
    bb.forward(bb.new_state(), torch.from_numpy(ids), tap=tap)
    q, k = tap.result()
    dist, qc = reference_features(q, k, coords_for(bb, CFG), CFG.chunk_size)
    w = ArchiveWriter(CFG, ids, sent, bb.n_channels, bb.fingerprint())
    w.feed(dist, qc)
    ref = w.finish()
    assert np.array_equal(res.archive.starts, ref.starts) and np.array_equal(res.archive.ends, ref.ends)
    assert torch.equal(res.archive.addresses, ref.addresses)


def test_archive_is_deterministic_and_seeded(bb, doc):
    text, _ = doc
    a = ingest(bb, text, CFG).archive
    b = ingest(bb, text, CFG).archive
    assert torch.equal(a.addresses, b.addresses) and np.array_equal(a.starts, b.starts)
    assert all(np.array_equal(x, y) for x, y in zip(a.token_ids, b.token_ids))
    c = ingest(bb, text, NoteBankConfig(**{**CFG.to_dict(), "seed": 1})).archive
    assert np.array_equal(a.starts, c.starts) and not torch.equal(a.addresses, c.addresses)


def test_block_size_does_not_change_archive_on_pure_recurrent(doc):
    bb = load_backbone(tiny_gdn_config(), tokenizer=byte_tokenizer())
    text = _random_text(2600) + doc[0]
    a = ingest(bb, text, CFG, block_size=CFG.chunk_size).archive       # C-token streaming
    b = ingest(bb, text, CFG, block_size=4096).archive                 # one large block
    assert np.array_equal(a.starts, b.starts) and torch.equal(a.addresses, b.addresses)


def test_notebank_answer_replays_notes_and_leaves_state_untouched(bb, doc):
    text, needles = doc
    res = ingest(bb, text, CFG)
    before = {k: v.clone() for k, v in bb.state_to_tensors(res.state).items()}
    q = f"What is the special magic number for {needles[0][0]}?"
    ans = answer(bb, res.state, res.archive, q, ReadConfig(top_r=2, max_new_tokens=4))
    assert 1 <= len(ans.retrieved) <= 2
    assert ans.retrieved == sorted(ans.retrieved, key=lambda i: res.archive.starts[i])
    assert ans.replay_len == sum(len(res.archive.token_ids[i]) for i in ans.retrieved)
    after = bb.state_to_tensors(res.state)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Eq. 6 by hand: copy S_T, replay, question, greedy
    s = bb.copy_state(res.state)
    bb.forward(s, torch.from_numpy(np.concatenate([res.archive.token_ids[i] for i in ans.retrieved]).astype(np.int64)))
    qi = torch.tensor(bb.tokenizer(q, add_special_tokens=False)["input_ids"])
    logits = bb.forward(s, qi)
    assert bb.generate(s, logits, 4) == ans.token_ids


def test_notebank_answer_positions_continue_from_the_context_end(bb, doc, monkeypatch):
    """Replay, question and answer tokens are read at positions T, T+1, ... right after the
    context (App. B.4), from the retained state of a real ingest: the state answer() generates
    from, and the logits it generates with, equal ONE forward pass without cache over
    context + replay + question (+ answer, teacher-forced). On the hybrid a restart of the RoPE
    positions or of the KV cache changes these logits; on all families a replay read from
    another state than S_T does."""
    text, needles = doc
    res = ingest(bb, text, CFG)
    seen = {}
    real_generate = bb.generate

    def observe(state, first_logits, *args, **kwargs):       # the real generate, observed at entry
        seen["state"] = bb.copy_state(state)
        seen["logits"] = first_logits.clone()
        return real_generate(state, first_logits, *args, **kwargs)

    monkeypatch.setattr(bb, "generate", observe)
    q = f"What is the special magic number for {needles[0][0]}?"
    ans = answer(bb, res.state, res.archive, q, ReadConfig(top_r=2, max_new_tokens=4, stop_at_eos=False))
    monkeypatch.undo()
    assert ans.replay_len > 0 and len(ans.token_ids) == 4
    replay = np.concatenate([res.archive.token_ids[i] for i in ans.retrieved]).astype(np.int64)
    qi = np.asarray(bb.tokenizer(q, add_special_tokens=False)["input_ids"], np.int64)
    prompt = np.concatenate([res.token_ids, replay, qi])
    n_prompt = len(prompt)
    assert n_prompt == res.n_tokens + ans.replay_len + ans.n_question_tokens
    # the state the read path produced sits at the end of the prompt (KV rows = positions on the hybrid)
    st = seen["state"]
    assert st.n_tokens == n_prompt
    kv = [v for k, v in bb.state_to_tensors(st).items() if k.endswith(".keys")]
    assert (len(kv) > 0) == (len(bb.rec_layers) < bb.model.config.num_hidden_layers)   # hybrid: attention KV
    assert all(v.shape[-2] == n_prompt for v in kv)
    # ... and reads exactly as one pass over the concatenation does
    full = torch.from_numpy(np.concatenate([prompt, np.asarray(ans.token_ids[:-1], np.int64)]))
    with torch.no_grad():
        ref = bb.model(input_ids=full[None], use_cache=False).logits[0, n_prompt - 1:].float()
    assert torch.allclose(seen["logits"], ref[0], atol=1e-4), float((seen["logits"] - ref[0]).abs().max())
    assert ref.argmax(-1).tolist() == ans.token_ids               # greedy decode continues the positions too


def test_empty_archive_means_no_probe_no_replay(bb):
    res = ingest(bb, "Too short. " * 5, CFG)
    assert len(res.archive) == 0
    ans_nb = answer(bb, res.state, res.archive, "Question?", ReadConfig(method="notebank", max_new_tokens=3))
    ans_plain = answer(bb, res.state, res.archive, "Question?", ReadConfig(method="plain", max_new_tokens=3))
    assert ans_nb.replay_len == 0 and ans_nb.timings["probe_s"] == 0.0
    assert ans_nb.token_ids == ans_plain.token_ids


def test_methods_clean_start_jrt_and_routers(bb, doc):
    text, needles = doc
    res = ingest(bb, text, CFG)
    q = f"What is the special magic number for {needles[1][0]}?"
    cs = answer(bb, res.state, res.archive, q, ReadConfig(method="clean_start", max_new_tokens=3))
    s = bb.copy_state(res.state)
    bb.reset_state(s, 0.0)
    qi = torch.tensor(bb.tokenizer(q, add_special_tokens=False)["input_ids"])
    assert bb.generate(s, bb.forward(s, qi), 3) == cs.token_ids
    jrt = answer(bb, res.state, res.archive, q, ReadConfig(method="jrt", max_new_tokens=3), context_ids=res.token_ids)
    assert len(jrt.token_ids) <= 3
    with pytest.raises(ValueError, match="context_ids"):
        answer(bb, res.state, res.archive, q, ReadConfig(method="jrt"))
    orc = answer(bb, res.state, res.archive, q, ReadConfig(router="oracle", max_new_tokens=1), answers=[needles[1][1]])
    for i in orc.retrieved:
        assert needles[1][1] in bb.tokenizer.decode(res.archive.token_ids[i].tolist())
    rnd = answer(bb, res.state, res.archive, q, ReadConfig(router="random", top_r=2, max_new_tokens=1))
    assert len(rnd.retrieved) == 2
    assert {"native", "random", "oracle"} <= set(ROUTERS)


def test_bad_input_is_explained(bb):
    with pytest.raises(ValueError, match="empty document"):
        ingest(bb, "", CFG)
    with pytest.raises(ValueError, match="empty question"):
        answer(bb, bb.new_state(), ingest(bb, "abc", CFG).archive, "", ReadConfig())
    with pytest.raises(ValueError, match="unknown router"):
        res = ingest(bb, "x. " * 200, CFG)
        answer(bb, res.state, res.archive, "q", ReadConfig(router="nope"))
    with pytest.raises(ValueError, match="method"):
        ReadConfig(method="magic").validate()
    with pytest.raises(ValueError, match="top_r"):
        ReadConfig(top_r=0).validate()


def test_fingerprint_mismatch_is_refused(doc):
    a = load_backbone(tiny_gdn_config(), tokenizer=byte_tokenizer(), seed=0)
    b = load_backbone(tiny_gdn_config(), tokenizer=byte_tokenizer(), seed=1)
    res = ingest(a, doc[0], CFG)
    with pytest.raises(ValueError, match="fingerprint"):
        answer(b, res.state, res.archive, "q?", ReadConfig())


@pytest.mark.parametrize("router", ["bm25", "dense", "mean_embedding"])
def test_comparison_routers_find_the_lexical_needle(router):
    bb = load_backbone(tiny_gdn_config(), tokenizer=byte_tokenizer())
    text, needles = needle_text(6000, 3, seed=0)
    res = ingest(bb, text, NoteBankConfig(chunk_size=256, note_budget=96))
    key, value = needles[0]
    holders = [i for i, z in enumerate(res.archive.token_ids) if value in bb.tokenizer.decode(z.tolist())]
    assert holders, "the writer should archive the needle here"
    ans = answer(bb, res.state, res.archive, f"What is the special magic number for {key}?",
                 ReadConfig(router=router, top_r=2, max_new_tokens=1))
    assert ans.timings["probe_s"] == 0.0            # no backbone probe for external routers
    if router in ("bm25", "dense"):                 # lexical/semantic match on the key words
        assert set(holders) & set(ans.retrieved)
    assert len(ans.retrieved) == 2
