"""NB-LoRA read adapters (nbcore.lora), the Eq. 10 training step (nbcore.training.lora) and the QA
data loaders (nbcore.training.qa_data), on real tiny transformers models (random init)."""
import json
import types

import numpy as np
import pytest
import torch

from nbcore import NoteBankConfig, ReadConfig, answer, ingest, load_backbone
from nbcore.lora import (LoraSpec, attach_adapter, default_layers, load_adapter, lora_config_for, save_adapter,
                         trainable_parameters)
from nbcore.testing import byte_tokenizer, needle_text, tiny_gdn_config, tiny_mamba2_config
from nbcore.training.lora import (BadExample, LoraTrainConfig, ReadExample, answer_targets, examples_for_update,
                                  prepare, read_nll, train_local, train_update, make_optimizer)
from nbcore.training import qa_data

# one tokenizer instance: nbcore.testing.byte_tokenizer() assigns byte ids in a different order on
# every call, so two backbones must share the instance to see the same ids.
TOK = byte_tokenizer()
NB = NoteBankConfig(chunk_size=128, note_budget=32, window=16, tail=8, addr_dim=8)
CONFIGS = {"gdn": lambda: tiny_gdn_config(), "gdn-hybrid": lambda: tiny_gdn_config(hybrid=True),
           "mamba2": lambda: tiny_mamba2_config()}


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only spin (a 4-tap depthwise conv
    takes ~40 ms with 2 busy threads, 0.1 ms with 1). Restored after each test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_bb(kind="gdn"):
    return load_backbone(CONFIGS[kind](), tokenizer=TOK)


def randomize(bb, std=0.3, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainable_parameters(bb):
            p.copy_(torch.randn(p.shape, generator=g) * std)


def logits_of(bb, ids, read=True):
    s = bb.new_state()
    if read:
        with bb.reading():
            return bb.forward(s, ids)
    return bb.forward(s, ids)


IDS = torch.randint(3, 200, (70,), generator=torch.Generator().manual_seed(0))


# ---- adapters -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_zero_init_adapters_leave_outputs_unchanged(kind):
    bb = make_bb(kind)
    ref = logits_of(bb, IDS, read=False)
    fp = bb.fingerprint()
    names = attach_adapter(bb)
    assert names and bb.has_adapter
    assert torch.equal(logits_of(bb, IDS, read=True), ref)          # B = 0
    lora_b = [p for n, p in bb.model.named_parameters() if "lora_B" in n or "lora_out_B" in n]
    assert lora_b and all(float(p.detach().abs().max()) == 0.0 for p in lora_b)
    assert bb.fingerprint() == fp                                    # archives stay valid
    randomize(bb)
    assert not torch.allclose(logits_of(bb, IDS, read=True), ref)    # on in reading()
    assert torch.equal(logits_of(bb, IDS, read=False), ref)          # off outside it


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_adapters_off_during_context_ingest_and_retrieval(kind):
    text, needles = needle_text(900, 3, seed=2)
    base = make_bb(kind)
    res0 = ingest(base, text, NB)
    bb = make_bb(kind)
    attach_adapter(bb)
    randomize(bb)
    res1 = ingest(bb, text, NB)
    assert len(res0.archive) > 0
    assert [z.tolist() for z in res0.archive.token_ids] == [z.tolist() for z in res1.archive.token_ids]
    assert torch.equal(res0.archive.addresses, res1.archive.addresses)
    assert res0.archive.model_fingerprint == res1.archive.model_fingerprint
    t0, t1 = base.state_to_tensors(res0.state), bb.state_to_tensors(res1.state)
    assert t0.keys() == t1.keys() and all(torch.equal(t0[k], t1[k]) for k in t0)
    # answer(): routing identical (adapters off for the probe), generation changes (adapters on)
    q = f"\nWhat is the special magic number for {needles[0][0]}?"
    rc = ReadConfig(top_r=2, max_new_tokens=8)
    a0 = answer(base, res0.state, res0.archive, q, rc)
    a1 = answer(bb, res0.state, res0.archive, q, rc)                 # an archive written without adapters
    assert a0.retrieved == a1.retrieved and a0.votes == a1.votes and a0.replay_len == a1.replay_len
    assert a0.token_ids != a1.token_ids


def test_gdn_targets_and_default_layers():
    bb = load_backbone(tiny_gdn_config(hybrid=True, layers=8), tokenizer=TOK)
    names = attach_adapter(bb, LoraSpec(layers=[0, 5]))
    short = sorted(n.split("model.layers.", 1)[1] for n in names)
    assert short == ["0.linear_attn.in_proj_qkv", "0.linear_attn.out_proj",
                     "5.linear_attn.in_proj_qkv", "5.linear_attn.out_proj"]
    with pytest.raises(ValueError, match="not recurrent layers"):
        attach_adapter(make_bb(), LoraSpec(layers=[7]))

    def fake(family, n):
        return types.SimpleNamespace(family=family, rec_layers=list(range(n)))
    assert default_layers(fake("gdn", 24)) == [11, 15, 18, 22]        # App. C.4
    assert default_layers(fake("gdn", 18)) == [8, 11, 13, 16]
    assert default_layers(fake("mamba2", 48)) == [23, 31, 37, 45]
    assert default_layers(fake("gdn", 4)) == [0, 1, 2, 3]             # tiny: all recurrent layers
    assert default_layers(fake("gdn", 12)) == [5, 7, 9, 11]           # paper depths, rescaled
    hyb = types.SimpleNamespace(family="gdn", rec_layers=[i for i in range(32) if (i + 1) % 4])  # 24 GDN of 32
    assert default_layers(hyb) == [hyb.rec_layers[i] for i in (11, 15, 18, 22)]


def test_mamba2_adapters_touch_only_xbc_rows_and_out_proj():
    from peft import LoraConfig, get_peft_model
    from nbcore.backbones import model_from_config
    with pytest.raises(ValueError, match="incompatible"):            # why the custom layer exists
        get_peft_model(model_from_config(tiny_mamba2_config()), LoraConfig(target_modules=["out_proj"]))
    bb = make_bb("mamba2")
    attach_adapter(bb)
    randomize(bb)
    mixer_lora = bb.model.base_model.model.backbone.layers[0].mixer
    m = mixer_lora.base_layer
    lora_names = sorted({n.split(".")[-3] for n, _ in bb.model.named_parameters() if "lora_" in n})
    assert lora_names == ["lora_A", "lora_B", "lora_out_A", "lora_out_B"]
    seen = {}

    def grab(name):
        def hook(mod, inp, out):
            seen.setdefault(name, []).append((inp[0].detach().clone(), out.detach().clone()))
        return hook
    hs = [m.in_proj.register_forward_hook(grab("in")), m.out_proj.register_forward_hook(grab("out"))]
    logits_of(bb, IDS, read=False)
    logits_of(bb, IDS, read=True)
    for h in hs:
        h.remove()
    (x_off, y_off), (x_on, y_on) = seen["in"]
    assert torch.equal(x_off, x_on)                                   # layer 0: same input
    diff = (y_on - y_off).abs().amax(dim=(0, 1))                      # per in_proj output row
    d_inner, conv_dim = m.intermediate_size, m.conv_dim
    assert float(diff[:d_inner].max()) == 0.0                          # z (gate) untouched
    assert float(diff[d_inner + conv_dim:].max()) == 0.0               # dt untouched
    assert float(diff[d_inner:d_inner + conv_dim].min()) > 0.0         # every x/B/C row adapted
    (xo_off, _), (xo_on, yo_on) = seen["out"]
    assert not torch.allclose(yo_on, m.out_proj.weight.new_tensor(0) + torch.nn.functional.linear(xo_on, m.out_proj.weight))
    assert mixer_lora.lora_B["default"].weight.shape[0] == conv_dim
    # merged weights give the same outputs as the hooks
    ref = logits_of(bb, IDS, read=True)
    bb.model.base_model.merge_adapter()
    with bb.model.disable_adapter():
        merged = bb.model(input_ids=IDS[None], use_cache=False).logits[0, -1]
    bb.model.base_model.unmerge_adapter()
    assert torch.allclose(merged, ref, atol=1e-4)
    assert torch.allclose(logits_of(bb, IDS, read=True), ref, atol=1e-5)


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_save_load_roundtrip_peft_and_fsspec(kind, tmp_path):
    from peft import PeftModel
    from nbcore.backbones import model_from_config
    bb = make_bb(kind)
    attach_adapter(bb)
    randomize(bb)
    ref = logits_of(bb, IDS, read=True)
    save_adapter(bb, str(tmp_path / "ad"))
    meta = json.loads((tmp_path / "ad" / "notebank_adapter.json").read_text())
    assert meta["family"] == bb.family and meta["layers"] == bb.lora_layers
    # plain peft
    base = model_from_config(CONFIGS[kind]())
    if kind == "gdn":
        pm = PeftModel.from_pretrained(base, str(tmp_path / "ad"))
    else:                                   # Mamba-2: the custom layer must be registered again
        pm = PeftModel.from_pretrained(base, str(tmp_path / "ad"), config=lora_config_for(str(tmp_path / "ad")))
    out = pm(input_ids=IDS[None], use_cache=False).logits[0, -1]
    assert torch.allclose(out, ref, atol=1e-5)
    # via an fsspec URL into a Backbone
    url = f"memory://lora-test-{kind}/ad"
    save_adapter(bb, url)
    bb2 = make_bb(kind)
    load_adapter(bb2, url)
    assert torch.equal(logits_of(bb2, IDS, read=True), ref)
    assert torch.equal(logits_of(bb2, IDS, read=False), logits_of(make_bb(kind), IDS, read=False))
    # different base weights are refused
    other = load_backbone(CONFIGS[kind](), tokenizer=TOK, seed=5)
    with pytest.raises(ValueError, match="different base weights"):
        load_adapter(other, str(tmp_path / "ad"))
    with pytest.raises(FileNotFoundError):
        load_adapter(make_bb(kind), str(tmp_path / "missing"))


# ---- Eq. 10 -------------------------------------------------------------------------------------
def test_eq10_loss_counts_only_answer_tokens_and_eos():
    bb = make_bb("gdn")
    attach_adapter(bb)
    randomize(bb, std=0.05)
    eos = bb.tokenizer.eos_token_id
    y = answer_targets(bb, " " + "x" * 60, max_tokens=47)
    assert len(y) == 48 and int(y[-1]) == eos                         # 47 answer tokens + EOS
    state = bb.new_state()
    bb.forward(state, IDS, need_logits=False)
    replay = torch.tensor(bb.tokenizer("Note: 42.", add_special_tokens=False)["input_ids"])
    q = torch.tensor(bb.tokenizer(" Q?", add_special_tokens=False)["input_ids"])
    y = answer_targets(bb, " 42.", 47)
    rex = ReadExample(state, replay, q, y)
    loss = read_nll(bb, rex)
    # reference: every position's logits in one no-grad pass, CE on the answer positions only
    s = bb.copy_state(state)
    seq = torch.cat([replay, q, y])
    with torch.no_grad(), bb.reading():
        from nbcore.training.lora import _grad_safe_cache
        with _grad_safe_cache(s.cache):
            full = bb.model(input_ids=seq[None], cache=s.cache, use_cache=True).logits[0].float()
    start = len(replay) + len(q)
    pred = full[start - 1:start - 1 + len(y)]                          # predicts y_1..y_n (incl. EOS)
    ref = torch.nn.functional.cross_entropy(pred, y)
    assert torch.allclose(loss, ref, atol=1e-5)
    ctx_loss = torch.nn.functional.cross_entropy(full[:start - 1], seq[1:start])
    assert not torch.allclose(loss, ctx_loss)
    loss.backward()
    grads = {n: p.grad for n, p in bb.model.named_parameters() if p.requires_grad}
    assert grads and all(("lora_" in n) for n in grads)               # only adapters train
    assert any(float(g.abs().max()) > 0 for n, g in grads.items() if "lora_A" in n)
    # the state S_T is a constant and was not modified by the differentiable read
    s2 = bb.new_state()
    bb.forward(s2, IDS, need_logits=False)
    a, b = bb.state_to_tensors(state), bb.state_to_tensors(s2)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _adapter_grads(bb, rex):
    """Eq. 10 loss of one read and the gradient on every adapter parameter (zeros where none)."""
    named = [(n, p) for n, p in bb.model.named_parameters() if p.requires_grad]
    for _, p in named:
        p.grad = None
    loss = read_nll(bb, rex)
    loss.backward()
    return float(loss.detach()), {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in named}


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_gradients_flow_through_replay_tokens(kind):
    """The replayed note tokens are part of the differentiable read (Eq. 10): the adapters act on
    them and the loss back-propagates through them. Reference: the same read with the replay
    DETACHED (read into a copy of S_T under no_grad, then Q and Y~ differentiable from there) has
    the same loss; the difference of the two gradients is the part that comes through the replay
    tokens, and it must be non-zero on every adapter that writes the recurrent state."""
    bb = make_bb(kind)
    attach_adapter(bb)
    randomize(bb, std=0.05)
    state = bb.new_state()
    bb.forward(state, IDS, need_logits=False)
    q = torch.tensor([70, 71, 72])
    y = answer_targets(bb, " ab", 47)
    replay = torch.tensor([80, 81, 82, 83])
    loss, g = _adapter_grads(bb, ReadExample(state, replay, q, y))
    assert g and all("lora_" in n for n in g)
    s_pre = bb.copy_state(state)
    with bb.reading():                                 # adapters on, like the read; Backbone.forward is no_grad
        bb.forward(s_pre, replay, need_logits=False)
    loss_det, g_det = _adapter_grads(bb, ReadExample(s_pre, torch.zeros(0, dtype=torch.long), q, y))
    assert loss == pytest.approx(loss_det, abs=1e-5)   # the same read
    # adapters on what writes the recurrent state: GDN in_proj_qkv, Mamba-2 in_proj x/B/C rows
    # (lora_A/B); out_proj adapters (out_proj / lora_out_*) of the LAST layer see the replay only
    # through logits nobody reads, so they are not required to get a replay gradient
    state_writers = [n for n in g if "out_" not in n]
    assert state_writers
    for n in state_writers:
        via_replay = float((g[n] - g_det[n]).abs().max())
        assert via_replay > 1e-2 * float(g[n].abs().max()) > 0, (n, via_replay)
    # other replayed tokens -> another loss (the replay is read, not skipped)
    other = float(read_nll(bb, ReadExample(state, torch.tensor([90, 91, 92, 93]), q, y)))
    assert other != pytest.approx(loss, abs=1e-6)


# ---- training step, bad input ---------------------------------------------------------------------
def _ex(ctx, q="\nWhat is the special magic number for amber-otter? It is", a=("1234567",)):
    return {"context": ctx, "question": q, "answers": list(a)}


def test_prepare_short_empty_and_bad_examples():
    bb = make_bb("gdn")
    attach_adapter(bb)
    cfg = LoraTrainConfig(updates=1, nb=NB.to_dict(), top_r=2)
    text, needles = needle_text(500, 1, seed=3)
    key, val = needles[0]
    long = prepare(bb, _ex(text, f"\nWhat is the special magic number for {key}?", (val,)), cfg)
    assert long.n_notes > 0 and 0 < len(long.replay) <= 2 * NB.note_budget
    short = prepare(bb, _ex("A short context. " * 3), cfg)               # < C tokens: empty archive
    assert short.n_notes == 0 and len(short.replay) == 0 and short.n_context < NB.chunk_size
    empty = prepare(bb, _ex(""), cfg)                                    # no context: plain read
    assert empty.n_context == 0 and len(empty.replay) == 0
    plain = prepare(bb, _ex(text), LoraTrainConfig(updates=1, nb=NB.to_dict(), replay=False))
    assert len(plain.replay) == 0
    for bad in (_ex(text, a=("",)), _ex(text, a=()), _ex(text, q="  ")):
        with pytest.raises(BadExample):
            prepare(bb, bad, cfg)
    # a batch with bad rows updates on the good ones and reports the skips
    params = trainable_parameters(bb)
    opt = make_optimizer(params, cfg)
    batch = [_ex(text, a=("",)), _ex("Short."), _ex(text, q=""), _ex(text)]
    m = train_update(bb, params, opt, batch, cfg)
    assert m["examples"] == 2 and m["skipped"] == 2 and m["updated"] and np.isfinite(m["loss"])
    m = train_update(bb, params, opt, [_ex(text, a=("",))], cfg)         # nothing valid: no step
    assert m["examples"] == 0 and not m["updated"]


def test_example_sharding_covers_each_update_once():
    cfg = LoraTrainConfig(examples_per_update=4, seed=0)
    n = 10
    for u in range(6):
        both = examples_for_update(u, n, cfg, 0, 2) + examples_for_update(u, n, cfg, 1, 2)
        assert sorted(both) == sorted(examples_for_update(u, n, cfg, 0, 1))
    first_epoch = [i for u in range(3) for i in examples_for_update(u, 12, cfg)]
    assert sorted(first_epoch) == list(range(12))                       # without replacement


def test_local_training_lowers_the_loss():
    torch.manual_seed(0)
    bb = make_bb("gdn")
    attach_adapter(bb)
    text, needles = needle_text(300, 1, seed=4)
    data = [_ex(text, f"\nThe special magic number for {needles[0][0]} is", (needles[0][1],))] * 2
    cfg = LoraTrainConfig(updates=6, examples_per_update=1, lr=3e-2, nb=NB.to_dict())
    hist = train_local(bb, data, cfg)
    assert len(hist) == 6 and all(h["replay_tokens_mean"] > 0 for h in hist)
    assert hist[-1]["loss"] < hist[0]["loss"] - 0.5


# ---- data -------------------------------------------------------------------------------------------
def test_load_qa_jsonl_parquet_and_bad_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"context": "c1", "question": "q1", "answers": ["a1"]},
            {"context": "c2", "question": "q2", "answers": "a2"},
            {"context": "c3", "question": "q3", "answers": [""]},
            {"context": "c4", "question": "", "answers": ["a4"]},
            {"question": "q5", "answers": ["a5"]}]
    p = tmp_path / "qa.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    d = qa_data.load_qa(str(p))
    assert [r["question"] for r in d.rows] == ["q1", "q2", "q5"] and d.n_bad == 3
    assert d.rows[1]["answers"] == ["a2"] and d.rows[2]["context"] == ""
    assert any("empty answer" in k for k in d.reasons)
    with pytest.raises(ValueError, match=r"qa.jsonl:3: empty answer"):
        qa_data.load_qa(str(p), on_bad="error")
    prow = [dict(r, answers=[r["answers"]] if isinstance(r["answers"], str) else r["answers"]) for r in rows[:3]]
    pq.write_table(pa.Table.from_pylist(prow), tmp_path / "qa.parquet")
    d2 = qa_data.load_qa(str(tmp_path / "qa.parquet"))
    assert [r["answers"] for r in d2.rows] == [["a1"], ["a2"]] and d2.n_bad == 1
    assert len(qa_data.load_qa(str(tmp_path))) == 5                      # a folder: both files
    with pytest.raises(FileNotFoundError):
        qa_data.load_qa(str(tmp_path / "nope.jsonl"))


def _nq_row(answer, docs, gold, q="who wrote the song"):
    body = "".join(f"Document [{i}](Title: T{i}) {t}\n" for i, t in enumerate(docs, 1))
    prompt = ("Write a high-quality answer for the given question using only the provided search results "
              f"(some of which might be irrelevant).\n\n{body}\nQuestion: {q}\nAnswer:")
    completion = f" Answer: {answer}\nLong Answer: {docs[gold - 1]}\nGold Document ID: {gold}"
    return {"prompt": prompt, "completion": completion, "text": prompt + completion}


def test_nq_importer(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    filler = "lorem ipsum dolor sit amet " * 800                            # ~21,600 chars
    rows = [
        _nq_row("Bob Dylan", ["The song was written by Bob Dylan in 1965.", "Other text."], 1),
        _nq_row("Joni Mitchell", [filler, "It was written by Joni Mitchell."], 2),   # gold beyond the cap
        _nq_row(" ".join(["w"] * 30), ["x"], 1),                                     # answer too long
        {"prompt": "Summarise the book.", "completion": "A summary.", "text": "..."},  # not NQ
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "lc.parquet")
    out = qa_data.import_nq(str(tmp_path / "lc.parquet"), dest=str(tmp_path / "nq.jsonl"))
    st = out["stats"]
    assert st == {"rows": 4, "not_nq": 1, "answer_words_out_of_range": 1, "kept": 2, "supported": 1,
                  "no_support": 1}
    a, b = out["rows"]
    assert a["answers"] == ["Bob Dylan"] and a["supported"] and a["question"] == "Question: who wrote the song\nAnswer:"
    assert "Gold Document ID" not in json.dumps(out["rows"]) and "Long Answer" not in json.dumps(out["rows"])
    assert len(b["context"]) <= qa_data.NQ_MAX_CONTEXT_CHARS and not b["supported"]
    assert b["answers"] == ["Joni Mitchell"]                              # no-support keeps the gold answer
    back = qa_data.load_qa(str(tmp_path / "nq.jsonl"), on_bad="error")
    assert len(back) == 2
    assert qa_data.main(["nq", str(tmp_path / "lc.parquet"), str(tmp_path / "one.jsonl"), "--select", "1"]) == 0
    assert len(qa_data.load_qa(str(tmp_path / "one.jsonl"))) == 1
    assert qa_data.select(list(range(10)), 4, seed=0) == qa_data.select(list(range(10)), 4, seed=0)


def test_synthetic_qa_uses_train_keys():
    from nbcore.tasks import ruler
    tok = TOK
    rows = qa_data.synthetic_qa(tok, 6, lengths=(300,), seed=0)
    lazy = qa_data.synthetic_qa(tok, 6, lengths=(300,), seed=0, lazy=True)
    assert len(lazy) == 6 and lazy[3] == rows[3]
    test_keys = set(ruler.split_keys("test"))
    for r in rows:
        assert r["target"] == ruler.answer_text(r["answers"]) and r["split"] == "train"
        assert not any(k in r["question"] for k in test_keys)
    assert {r["task"] for r in rows} == set(ruler.PAPER_SIX)


def test_query_model_spec_loads_adapter(tmp_path):
    """`model.adapter` in the ingest/query/evaluate configs loads a saved adapter into the actors'
    backbone; routing is unchanged, reading uses it."""
    import torch
    from nbcore.lora import attach_adapter, save_adapter
    from nbcore.backbones.loading import build_backbone
    from conftest import TINY_MODEL
    bb = build_backbone(dict(TINY_MODEL))
    attach_adapter(bb)
    with torch.no_grad():
        for n, p in bb.model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)
    save_adapter(bb, str(tmp_path / "adapter"))
    plain = build_backbone(dict(TINY_MODEL))
    adapted = build_backbone({**TINY_MODEL, "adapter": str(tmp_path / "adapter")})
    assert adapted.has_adapter and not plain.has_adapter
    assert adapted.fingerprint() == plain.fingerprint()
    ids = torch.arange(3, 60)
    with adapted.reading():
        on = adapted.forward(adapted.new_state(), ids)
    off = adapted.forward(adapted.new_state(), ids)
    assert torch.allclose(off, plain.forward(plain.new_state(), ids), atol=1e-6)
    assert not torch.allclose(on, off)
