"""The lab trainer of the tiny backbones (lab/backbone.py): inits, growth, training, model cards."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nbcore.tasks.tokenizer import build_tokenizer
from lab.backbone import ModelConfig, build_model


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _taps(model, layer=0):
    m = model.model.layers[layer].linear_attn
    return m.conv1d.weight[:, 0].detach(), m.key_dim, m.key_dim // m.num_k_heads   # [C, K]


@pytest.mark.parametrize("bigram", [0, 1, 4], ids=["unigram", "bigram1", "bigram-all"])
def test_induction_taps(tok, bigram):
    """q reads t (and t-1 in bigram heads); k reads t-1 (and t-2); v reads t. Index K-1 = token t."""
    w, kd, hd = _taps(build_model(ModelConfig(heads=4, bigram_heads=bigram), tok))
    K = w.shape[1]
    lag = lambda *ls: torch.tensor([1.0 if K - 1 - j in ls else 0.0 for j in range(K)])  # noqa: E731
    lo = kd - bigram * hd
    for c in range(kd):
        assert torch.equal(w[c], lag(0, 1) if c >= lo else lag(0)), c
        assert torch.equal(w[kd + c], lag(1, 2) if c >= lo else lag(1)), c
    assert torch.equal(w[2 * kd], lag(0))


@pytest.mark.parametrize("bigram", [0, 2], ids=["unigram", "bigram-half"])
def test_mamba2_induction_taps(tok, bigram):
    """Mamba-2: x and C read t, B reads t-1; with model.bigram_heads=2 of 4 the last half of the B/C
    state dims read C = t, t-1 and B = t-1, t-2 (one B/C group is shared by all heads)."""
    m = build_model(ModelConfig(family="mamba2", heads=4, bigram_heads=bigram, state=16, layers=1), tok)
    mix = m.backbone.layers[0].mixer
    w, inter, st = mix.conv1d.weight[:, 0], mix.intermediate_size, mix.ssm_state_size
    K = w.shape[1]
    lag = lambda *ls: torch.tensor([1.0 if K - 1 - j in ls else 0.0 for j in range(K)])  # noqa: E731
    uni = st - bigram * st // 4
    assert torch.equal(w[0], lag(0)) and torch.equal(w[inter - 1], lag(0))      # x
    for c in range(st):
        assert torch.equal(w[inter + c], lag(1, 2) if c >= uni else lag(1)), c            # B
        assert torch.equal(w[inter + st + c], lag(0, 1) if c >= uni else lag(0)), c       # C
    with pytest.raises(ValueError, match="bigram_heads"):
        build_model(ModelConfig(family="mamba2", heads=4, bigram_heads=5, layers=1), tok)


def test_bigram_heads_out_of_range(tok):
    with pytest.raises(ValueError, match="bigram_heads"):
        build_model(ModelConfig(heads=4, bigram_heads=5), tok)


def test_collide_uuid_examples(tok):
    """The training-only collision-rich uuids: uuid-shaped, from a 4-8 symbol hex alphabet, put in
    the needle and the answer of a niah_single_3 example (nothing else changes); deterministic."""
    import random
    import re
    from nbcore.tasks import ruler
    from lab.backbone import COLLIDE_TASK, PHASES, collide_uuid, generate_train
    for i in range(20):
        u = collide_uuid(random.Random(i))
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", u)
        assert 1 <= len(set(u) - {"-"}) <= 8
    ex = generate_train(COLLIDE_TASK, 512, 3, tok, 0)
    ref = ruler.generate("niah_single_3", 512, 3, tok, seed=0, split="train")
    (new,), (old,) = ex["answers"], ref["answers"]
    assert new != old and new in ex["context"] and old not in ex["context"]
    assert ex["context"].replace(new, old) == ref["context"] and ex["question"] == ref["question"]
    assert generate_train(COLLIDE_TASK, 512, 3, tok, 0) == ex
    assert generate_train("niah_single_3", 512, 3, tok, 0) == ref
    assert COLLIDE_TASK in PHASES["uuid-collide"][0][2] and COLLIDE_TASK not in ruler.TASKS


def test_train_checkpoints_and_resumes(tok, tmp_path):
    """A short run leaves a complete checkpoint (no temp file) and an HF dir; a rerun resumes it."""
    from lab.backbone import TrainConfig, train
    mc = ModelConfig(hidden=32, layers=1, heads=1, mlp=64, bigram_heads=1)
    tc = TrainConfig(minutes=0.05, tokens_per_step=256, threads=1)
    _, meta = train(mc, tc, tmp_path / "model", tmp_path / "run", tok, log=lambda s: None)
    ck = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)
    assert ck["step"] == meta["steps"] >= 1 and not (tmp_path / "run" / "ckpt.pt.tmp").exists()
    assert (tmp_path / "model" / "model.safetensors").is_file()
    _, meta2 = train(mc, TrainConfig(minutes=0.1, tokens_per_step=256, threads=1), tmp_path / "model",
                     tmp_path / "run", tok, log=lambda s: None)
    assert meta2["steps"] > meta["steps"]
    from lab.backbone import write_readme
    meta2["limits"] = "multi-key recall needs key binding"
    write_readme(tmp_path / "model", meta2, [{"length": 64, "n": 1, "scores": {"niah_single_1": 0.0}}])
    text = (tmp_path / "model" / "README.md").read_text()
    assert "| 64 | niah_single_1 | 1 | 0.0 |" in text and text.endswith("needs key binding\n")


@pytest.mark.parametrize("window,conv", [(1, 4), (2, 7)], ids=["w1-conv4", "w2-conv7"])
def test_window_taps(tok, window, conv):
    """Window heads: q sums tokens t..t-(K-1), k sums t-1..t-(K-1); other heads keep their taps."""
    w, kd, hd = _taps(build_model(ModelConfig(heads=4, conv=conv, window_heads=window, bigram_heads=1), tok))
    K = w.shape[1]
    assert K == conv
    hi, lo = window * hd, kd - hd
    for c in range(kd):
        q, k = w[c], w[kd + c]
        if c < hi:
            assert torch.equal(q, torch.ones(K)) and torch.equal(k, torch.tensor([1.0] * (K - 1) + [0.0])), c
        else:
            assert q[-1] == 1.0 and k[-1] == 0.0 and k[-2] == 1.0, c        # induction (t-1 -> t)
            assert (q[:-2].abs().sum() == 0) and (c >= lo or q[-2] == 0), c


def test_offset_taps(tok):
    """Offset head (a, b): q reads exactly t-a, k exactly t-b, v t; placed after the window heads."""
    w, kd, hd = _taps(build_model(ModelConfig(heads=4, conv=8, window_heads=1, offset_heads=((6, 3),)), tok))
    one = lambda lag: torch.eye(8)[7 - lag]  # noqa: E731
    for c in range(hd, 2 * hd):
        assert torch.equal(w[c], one(6)) and torch.equal(w[kd + c], one(3)), c
    assert torch.equal(w[2 * hd], one(0)) and torch.equal(w[kd + 2 * hd], one(1))  # head 2: induction
    with pytest.raises(ValueError, match="conv size"):
        build_model(ModelConfig(heads=4, conv=4, offset_heads=((6, 3),)), tok)


def test_window_and_bigram_heads_must_fit(tok):
    with pytest.raises(ValueError, match="window_heads"):
        build_model(ModelConfig(heads=4, window_heads=3, bigram_heads=2), tok)


@pytest.fixture(scope="module")
def small_source(tok, tmp_path_factory):
    """A trained-looking 2-layer GDN saved as an HF dir (random weights are enough to compare)."""
    d = tmp_path_factory.mktemp("src")
    torch.manual_seed(0)
    m = build_model(ModelConfig(hidden=32, layers=2, heads=2, mlp=64, bigram_heads=1), tok)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))  # move off the init so copying is really tested
    m.save_pretrained(d)
    return d, m


@pytest.mark.parametrize("prepend", [0, 1], ids=["append", "prepend"])
def test_grow_from_keeps_the_logits(tok, small_source, prepend):
    """Deeper (2 -> 3 layers, the new one last or first) and a longer conv (4 -> 7 taps): same
    logits as the source, and the new layer really is new (nonzero grads into its zeroed
    projections)."""
    from lab.backbone import grow_from
    src_dir, src = small_source
    big = build_model(ModelConfig(hidden=32, layers=3, heads=2, mlp=64, conv=7, bigram_heads=1,
                                  offset_heads=((6, 3),)), tok)
    rep = grow_from(big, src_dir, prepend=prepend)
    new = 0 if prepend else 2
    assert rep["conv_padded"] == 2 and {n.split(".")[2] for n in rep["new"]} == {str(new)}
    ids = torch.randint(5, len(tok), (2, 63))
    with torch.no_grad():
        a = src(input_ids=ids, use_cache=False).logits
        b = big(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    big(input_ids=ids, use_cache=False).logits.sum().backward()
    assert big.model.layers[new].linear_attn.out_proj.weight.grad.abs().sum() > 0


def test_grow_from_refuses_a_narrower_model(tok, small_source):
    from lab.backbone import grow_from
    src_dir, _ = small_source
    with pytest.raises(ValueError, match="cannot grow"):
        grow_from(build_model(ModelConfig(hidden=32, layers=2, heads=2, mlp=32), tok), src_dir)


def test_write_gate_fits_number_starts(tok):
    """After the fit, the offset head writes (beta > 0.5) at every " <digit>" token and nowhere else
    in a sentence without numbers; the other heads' gates are untouched."""
    from lab.backbone import fit_write_gate, number_start_ids
    torch.manual_seed(0)
    m = build_model(ModelConfig(hidden=64, layers=1, heads=2, mlp=64, conv=8, offset_heads=((6, 3),)), tok)
    ids = number_start_ids(tok)
    assert len(ids) == 10 and all(tok.convert_ids_to_tokens(i)[1:].isdigit() for i in ids)
    other = m.model.layers[0].linear_attn.in_proj_b.weight[1].clone()
    with torch.no_grad():  # as in a trained table: a common direction (in_proj_b has no bias, this
        emb = m.get_input_embeddings().weight   # is what lets beta be ~0 by default) and a shared
        emb += 0.05 * torch.randn(64)          # direction of the number tokens
        emb[ids] += 0.05 * torch.randn(64)
    leak = fit_write_gate(m.model.layers[0], m.get_input_embeddings().weight.detach(), ids, [0])
    assert leak < 0.5
    layer = m.model.layers[0]
    text = tok(" The grass is green, the sky is blue; go home.", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        beta = lambda t: layer.linear_attn.in_proj_b(layer.input_layernorm(  # noqa: E731
            m.get_input_embeddings().weight[t]))[..., 0].sigmoid()
        assert (beta(torch.tensor(ids)) > 0.5).all() and (beta(torch.tensor(text)) < 0.5).all()
    assert torch.equal(layer.linear_attn.in_proj_b.weight[1], other)


def test_train_grows_a_source_and_trains_new_layers_faster(tok, small_source, tmp_path):
    from lab.backbone import TrainConfig, train
    src_dir, _ = small_source
    mc = ModelConfig(hidden=32, layers=3, heads=2, mlp=64, conv=8, bigram_heads=1, offset_heads=((6, 3),))
    from lab.backbone import PHASES
    tc = TrainConfig(minutes=0.03, tokens_per_step=256, threads=1, init_from=str(src_dir), grow_prepend=1,
                     new_layer_lr_mult=10.0, phases=list(PHASES["grow"]))
    logs = []
    _, meta = train(mc, tc, tmp_path / "model", tmp_path / "run", tok, log=logs.append)
    assert meta["init_from"]["path"] == str(src_dir) and meta["steps"] >= 1
    assert any("grown from" in s for s in logs) and any("write at number starts" in s for s in logs)
    groups = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)["opt"]["param_groups"]
    assert [g["lr_mult"] for g in groups] == [1.0, 10.0]
    assert groups[1]["lr"] == pytest.approx(10 * groups[0]["lr"])
    from lab.backbone import write_readme
    write_readme(tmp_path / "model", meta, [])
    text = (tmp_path / "model" / "README.md").read_text()
    assert f"--set train.init_from={src_dir}" in text and "--set 'model.offset_heads=[[6,3]]'" in text
    assert "--set train.grow_prepend=1" in text and "--set train.new_layer_lr_mult=10" in text
    assert "--set curriculum=grow" in text and "grown from" in text and "1 new layer(s) placed first" in text


def test_freeze_new_mixer_keeps_the_built_circuit(tok, small_source, tmp_path):
    """train.freeze_new_mixer: the new layer's q/k/v/conv/write gate end as built; its read-out trains."""
    from lab.backbone import TrainConfig, train
    src_dir, _ = small_source
    mc = ModelConfig(hidden=32, layers=3, heads=2, mlp=64, conv=8, bigram_heads=1, offset_heads=((6, 3),))
    tc = TrainConfig(minutes=0.03, tokens_per_step=256, threads=1, init_from=str(src_dir), grow_prepend=1,
                     new_layer_lr_mult=10.0, freeze_new_mixer=True)
    model, _ = train(mc, tc, tmp_path / "model", tmp_path / "run", tok, log=lambda s: None)
    a = model.model.layers[0].linear_attn
    w, kd, hd = _taps(model)
    assert torch.equal(w[0], torch.eye(8)[1]) and torch.equal(w[kd], torch.eye(8)[4])  # q t-6, k t-3
    assert not a.in_proj_qkv.weight.requires_grad and a.out_proj.weight.abs().sum() > 0


def test_continue_a_model_with_frozen_mixer_layers(tok, small_source, tmp_path):
    """Same shapes: a continuation (every tensor copied). freeze_mixer_layers=(0,) keeps layer 0's
    q/k/v/conv/gates exactly as loaded while layer 1 and layer 0's read-out train; the README says
    continued and repeats the flags (a non-default phase set and LM weight included)."""
    from lab.backbone import PHASES, TrainConfig, train, write_readme
    src_dir, src = small_source
    mc = ModelConfig(hidden=32, layers=2, heads=2, mlp=64, bigram_heads=1)
    tc = TrainConfig(minutes=0.03, tokens_per_step=256, threads=1, init_from=str(src_dir),
                     freeze_mixer_layers=(0,), phases=list(PHASES["uuid-long"]), lm_weight=0.05)
    model, meta = train(mc, tc, tmp_path / "model", tmp_path / "run", tok, log=lambda s: None)
    assert meta["steps"] >= 1
    new, old = model.model.layers[0].linear_attn, src.model.layers[0].linear_attn
    for name in ("in_proj_qkv", "in_proj_b", "in_proj_a", "conv1d"):
        assert torch.equal(getattr(new, name).weight, getattr(old, name).weight), name
    assert not torch.equal(new.out_proj.weight, old.out_proj.weight)
    assert not torch.equal(model.model.layers[1].linear_attn.in_proj_qkv.weight,
                           src.model.layers[1].linear_attn.in_proj_qkv.weight)
    write_readme(tmp_path / "model", meta, [])
    text = (tmp_path / "model" / "README.md").read_text()
    assert "continued from" in text and "--set 'train.freeze_mixer_layers=[0]'" in text
    assert "--set curriculum=uuid-long" in text
    assert "--set train.lm_weight=0.05" in text and "answer CE + 0.05 x LM CE" in text
    with pytest.raises(ValueError, match="out of range"):
        train(mc, TrainConfig(minutes=0.01, tokens_per_step=256, threads=1, init_from=str(src_dir),
                              freeze_mixer_layers=(5,)), tmp_path / "m2", tmp_path / "r2", tok, log=lambda s: None)


# ---- Mamba-2 offset layer (the GDN offset head's analogue; lab/probes/mamba2_offset_probe.py) ----

def _mamba2(tok, **kw):
    cfg = dict(family="mamba2", hidden=32, head_dim=16, state=16, heads=4, bigram_heads=2)
    return build_model(ModelConfig(**{**cfg, **kw}), tok)


def test_mamba2_offset_layer_taps(tok):
    """offset_heads=((6, 3),) on Mamba-2: layer 0's every B dim reads t-3 and C dim t-6 as sparse codes
    (gain 3, threshold 1); x reads t; the next layer keeps the induction init."""
    from lab.backbone import OFFSET_KEY_GAIN, OFFSET_KEY_THRESHOLD
    m = _mamba2(tok, layers=2, conv=8, offset_heads=((6, 3),))
    one = lambda lag, g=1.0: g * torch.eye(8)[7 - lag]  # noqa: E731
    mix = m.backbone.layers[0].mixer
    w, bias, inter, st = mix.conv1d.weight[:, 0], mix.conv1d.bias, mix.intermediate_size, mix.ssm_state_size
    for c in range(st):
        assert torch.equal(w[inter + c], one(3, OFFSET_KEY_GAIN)), c             # B
        assert torch.equal(w[inter + st + c], one(6, OFFSET_KEY_GAIN)), c        # C
    assert torch.all(bias[inter:] == -OFFSET_KEY_GAIN * OFFSET_KEY_THRESHOLD)
    assert torch.equal(w[0], one(0)) and bias[0] == 0                              # x
    w1 = m.backbone.layers[1].mixer.conv1d.weight[:, 0]
    assert torch.equal(w1[inter], one(1)) and torch.equal(w1[inter + st], one(0))  # induction
    with pytest.raises(ValueError, match="conv size"):
        _mamba2(tok, layers=1, conv=4, offset_heads=((6, 3),))
    with pytest.raises(ValueError, match="per layer"):
        _mamba2(tok, layers=1, conv=8, offset_heads=((6, 3), (6, 3)))


def test_dt_gate_fits_number_starts(tok):
    """fit_dt_gate: every head's dt is large at " <digit>" tokens and small on a sentence without
    numbers (dt_bias carries the "off" default)."""
    import torch.nn.functional as F
    from lab.backbone import fit_dt_gate, number_start_ids
    torch.manual_seed(0)
    m = _mamba2(tok, layers=1, conv=8, offset_heads=((6, 3),))
    ids = number_start_ids(tok)
    with torch.no_grad():  # a shared direction of the number tokens, as in a trained table
        emb = m.get_input_embeddings().weight
        emb[ids] += 0.05 * torch.randn(32)
    block = m.backbone.layers[0]
    lo, leak = fit_dt_gate(block, m.get_input_embeddings().weight.detach(), ids)
    assert lo > 1.0 and leak < lo
    text = tok(" The grass is green, the sky is blue; go home.", add_special_tokens=False)["input_ids"]
    mix = block.mixer
    with torch.no_grad():
        dt = lambda t: F.softplus(mix.in_proj(block.norm(emb[torch.tensor(t)]))[:, -mix.num_heads:]  # noqa: E731
                                  + mix.dt_bias)
        assert dt(ids).min() > 1.0 and dt(text).max() < 0.5


@pytest.fixture(scope="module")
def mamba2_source(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("m2src")
    torch.manual_seed(0)
    m = _mamba2(tok, layers=2)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    m.save_pretrained(d)
    return d, m


def test_mamba2_grow_keeps_logits_and_frozen_offset_layer_stays_built(tok, mamba2_source, tmp_path):
    """Grow a 2-layer Mamba-2 by an offset layer placed first (conv 4 -> 8): same logits at step 0.
    Trained with freeze_new_mixer, the layer's x/B/C/dt rows of in_proj, conv and dt_bias end as
    built and fitted, while its output gate z rows and out_proj train (weight decay included)."""
    from lab.backbone import TrainConfig, fit_dt_gate, grow_from, mamba2_circuit_rows, number_start_ids, train
    src_dir, src = mamba2_source
    mc = ModelConfig(family="mamba2", hidden=32, head_dim=16, state=16, heads=4, bigram_heads=2,
                     layers=3, conv=8, offset_heads=((6, 3),))
    torch.manual_seed(0)
    built = build_model(mc, tok)
    grow_from(built, src_dir, prepend=1)
    ids = torch.randint(5, len(tok), (2, 63))
    with torch.no_grad():
        torch.testing.assert_close(built(input_ids=ids).logits, src(input_ids=ids).logits, rtol=0, atol=1e-5)
    fit_dt_gate(built.backbone.layers[0], built.get_input_embeddings().weight.detach(), number_start_ids(tok))
    tc = TrainConfig(minutes=0.03, tokens_per_step=256, threads=1, init_from=str(src_dir), grow_prepend=1,
                     new_layer_lr_mult=10.0, freeze_new_mixer=True)
    logs = []
    model, meta = train(mc, tc, tmp_path / "model", tmp_path / "run", tok, log=logs.append)
    assert meta["steps"] >= 1 and any("offset layer 0 writes at number starts" in s for s in logs)
    new, ref = model.backbone.layers[0].mixer, built.backbone.layers[0].mixer
    rows = mamba2_circuit_rows(new)
    assert torch.equal(new.in_proj.weight[rows], ref.in_proj.weight[rows])
    assert not torch.equal(new.in_proj.weight[:rows.start], ref.in_proj.weight[:rows.start])
    for name in ("conv1d", "dt_bias", "A_log"):
        a, b = getattr(new, name), getattr(ref, name)
        assert torch.equal(a.weight if hasattr(a, "weight") else a, b.weight if hasattr(b, "weight") else b), name
    assert new.out_proj.weight.abs().sum() > 0


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x: [T, D] -> row t holds x[t-k] (zeros before the start), as a causal conv tap reads it."""
    return torch.cat([x.new_zeros(k, x.shape[1]), x[:-k]])


@pytest.mark.parametrize("name", ["lag1", "lag12"])
def test_mamba2_product_layer_keeps_logits_and_writes_pair_codes(tok, mamba2_source, name):
    """product_layer on a grown Mamba-2: same logits at step 0 (its out_proj starts at 0), and its
    read-out equals the naive formula RMSNorm(silu(h_{t-lag}) * silu(z_t)), z = h_t | permuted h_t."""
    from lab.backbone import PRODUCT_LAGS, _init_mamba2_product, grow_from
    src_dir, src = mamba2_source
    torch.manual_seed(0)
    built = _mamba2(tok, layers=3)
    grow_from(built, src_dir, prepend=1)
    _init_mamba2_product(built.backbone.layers[0].mixer, PRODUCT_LAGS[name], seed=3)
    ids = torch.randint(5, len(tok), (1, 63))
    block = built.backbone.layers[0]
    seen = {}
    block.mixer.out_proj.register_forward_hook(lambda mod, inp, out: seen.__setitem__("readout", inp[0]))
    with torch.no_grad():
        torch.testing.assert_close(built(input_ids=ids).logits, src(input_ids=ids).logits, rtol=0, atol=1e-5)
        h = block.norm(built.get_input_embeddings()(ids))[0]                       # [T, hidden]
    hid = h.shape[1]
    lag_a, lag_b = PRODUCT_LAGS[name]
    x = torch.cat([F.silu(_shift(h, lag_a)), F.silu(_shift(h, lag_b))], 1)    # [T, 2 hidden]
    perm = torch.randperm(hid, generator=torch.Generator().manual_seed(3))
    y = x * F.silu(torch.cat([h, h[:, perm]], 1))
    ref = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + block.mixer.norm.variance_epsilon)
    torch.testing.assert_close(seen["readout"][0], ref, rtol=1e-4, atol=1e-5)


def test_train_with_a_product_layer_holds_its_circuit(tok, mamba2_source, tmp_path):
    """train(product_layer=...) builds the prepended layer, holds its x/B/C/dt rows, conv and D
    (freeze_mixer_layers), trains its gate z and out_proj; misuse is refused."""
    from lab.backbone import TrainConfig, mamba2_circuit_rows, train
    src_dir, _ = mamba2_source
    mc = ModelConfig(family="mamba2", hidden=32, head_dim=16, state=16, heads=4, bigram_heads=2, layers=3)
    tc = TrainConfig(minutes=0.03, tokens_per_step=256, threads=1, init_from=str(src_dir), grow_prepend=1,
                     new_layer_lr_mult=10.0, freeze_mixer_layers=(0,), product_layer="lag12")
    logs = []
    model, meta = train(mc, tc, tmp_path / "model", tmp_path / "run", tok, log=logs.append)
    assert meta["steps"] >= 1 and any("bigram product layer, x lags (1, 2)" in s for s in logs)
    mix = model.backbone.layers[0].mixer
    rows = mamba2_circuit_rows(mix)
    x_rows = mix.in_proj.weight[rows][:mix.intermediate_size]
    assert torch.equal(x_rows, torch.eye(32).repeat(2, 1))                    # x: two copies of h, held
    assert torch.equal(mix.in_proj.weight[rows][mix.intermediate_size:], torch.zeros_like(
        mix.in_proj.weight[rows][mix.intermediate_size:]))                   # B, C, dt rows stay 0
    assert torch.equal(mix.D, torch.ones_like(mix.D))
    assert mix.out_proj.weight.abs().sum() > 0
    assert not torch.equal(mix.in_proj.weight[:32], torch.eye(32))            # z trains
    with pytest.raises(ValueError, match="one prepended layer"):  # grown, but layer 0 is the source's
        train(mc, TrainConfig(minutes=0.01, tokens_per_step=256, threads=1, init_from=str(src_dir),
                              grow_prepend=0, product_layer="lag1"),
              tmp_path / "m2", tmp_path / "r2", tok, log=logs.append)



def test_train_from_scratch_with_a_product_layer(tok, tmp_path):
    """A fresh Mamba-2 with product_layer: layer 0 is built as the product layer (not the induction
    init) and held by freeze_mixer_layers; a GDN refuses it (the layer is Mamba-2's output gate)."""
    from lab.backbone import TrainConfig, mamba2_circuit_rows, train
    mc = ModelConfig(family="mamba2", hidden=32, head_dim=16, state=16, heads=4, bigram_heads=2, layers=2)
    tc = TrainConfig(minutes=0.03, tokens_per_step=256, threads=1, freeze_mixer_layers=(0,), product_layer="lag1")
    logs = []
    model, meta = train(mc, tc, tmp_path / "model", tmp_path / "run", tok, log=logs.append)
    assert meta["steps"] >= 1 and any("bigram product layer, x lags (1, 1)" in s for s in logs)
    mix = model.backbone.layers[0].mixer
    rows = mamba2_circuit_rows(mix)
    assert torch.equal(mix.in_proj.weight[rows][:mix.intermediate_size], torch.eye(32).repeat(2, 1))
    assert not mix.in_proj.weight[rows][mix.intermediate_size:].any()          # B, C, dt rows: 0
    assert not torch.equal(model.backbone.layers[1].mixer.in_proj.weight[rows][:mix.intermediate_size],
                           torch.eye(32).repeat(2, 1))                         # layer 1: the usual init
    from lab.backbone import write_readme
    write_readme(tmp_path / "model", meta, [])                # the card reproduces the built layer too
    text = (tmp_path / "model" / "README.md").read_text()
    assert "trained from scratch" in text and "--set train.product_layer=lag1" in text
    assert "--set 'train.freeze_mixer_layers=[0]'" in text
    assert "bigram *product* layer" in text and "train.init_from" not in text and "--set curriculum" not in text
    with pytest.raises(ValueError, match="family=gdn"):
        train(ModelConfig(family="gdn", hidden=32, heads=2, layers=1), TrainConfig(minutes=0.01, product_layer="lag1"),
              tmp_path / "g", tmp_path / "gr", tok, log=logs.append)

# ---- Mamba-2 B/C capacity: more groups, larger state (grow_from's _grow_bc) ----

def test_mamba2_groups_start_alike(tok):
    """groups=2: every group's B/C in_proj rows and conv taps equal group 0's (offset layer too);
    groups must divide the heads and are a Mamba-2 option only."""
    for offset in ((), ((6, 3),)):
        m = _mamba2(tok, layers=1, conv=8, groups=2, offset_heads=offset)
        mix = m.backbone.layers[0].mixer
        inter, st, G = mix.intermediate_size, mix.ssm_state_size, mix.n_groups
        assert G == 2 and mix.in_proj.weight.shape[0] == 2 * inter + 2 * G * st + mix.num_heads
        w, cw, cb = mix.in_proj.weight, mix.conv1d.weight, mix.conv1d.bias
        for i in (0, 1):  # B, C
            r, c = 2 * inter + i * G * st, inter + i * G * st
            assert torch.equal(w[r:r + st], w[r + st:r + 2 * st])
            assert torch.equal(cw[c:c + st], cw[c + st:c + 2 * st]) and torch.equal(cb[c:c + st], cb[c + st:c + 2 * st])
        one = build_model(ModelConfig(family="mamba2", hidden=32, head_dim=16, state=16, heads=4, bigram_heads=2,
                                      layers=1, conv=8, offset_heads=offset), tok).backbone.layers[0].mixer
        assert torch.equal(cw[inter:inter + st], one.conv1d.weight[inter:inter + st])  # same recipe as 1 group
    with pytest.raises(ValueError, match="divide"):
        _mamba2(tok, layers=1, groups=3)
    with pytest.raises(ValueError, match="Mamba-2 option"):
        build_model(ModelConfig(groups=2), tok)


def test_mamba2_grow_state_keeps_logits_and_new_dims_learn(tok, mamba2_source):
    """state 16 -> 32: the source's dims are copied into the first half of every B/C group, the new
    dims start at new_state_scale x the fresh induction init (conv bias 0), the logits barely move,
    and the new dims get a gradient (not the zero-init saddle)."""
    from lab.backbone import grow_from
    src_dir, src = mamba2_source
    torch.manual_seed(0)
    big = _mamba2(tok, layers=2, state=32)
    fresh = {k: v.clone() for k, v in big.state_dict().items()}
    rep = grow_from(big, src_dir, new_state_scale=0.01)
    assert rep["bc_grown"] == 6 and rep["new"] == []
    mix, smix = big.backbone.layers[1].mixer, src.backbone.layers[1].mixer
    inter = mix.intermediate_size
    for i in (0, 1):  # B, C rows of in_proj
        r_big, r_src = 2 * inter + 32 * i, 2 * inter + 16 * i
        assert torch.equal(mix.in_proj.weight[r_big:r_big + 16], smix.in_proj.weight[r_src:r_src + 16])
        key = "backbone.layers.1.mixer.in_proj.weight"
        assert torch.equal(mix.in_proj.weight[r_big + 16:r_big + 32], 0.01 * fresh[key][r_big + 16:r_big + 32])
        assert torch.all(mix.conv1d.bias[inter + 32 * i + 16:inter + 32 * (i + 1)] == 0)
    assert torch.equal(mix.in_proj.weight[-mix.num_heads:], smix.in_proj.weight[-smix.num_heads:])  # dt rows
    ids = torch.randint(5, len(tok), (2, 63))
    with torch.no_grad():
        a, b = src(input_ids=ids).logits, big(input_ids=ids).logits
    assert (a - b).abs().max() < 0.05 and not torch.equal(a, b)
    big(input_ids=ids).logits.sum().backward()
    g = mix.in_proj.weight.grad
    assert g[2 * inter + 16:2 * inter + 32].abs().sum() > 0 and g[2 * inter + 48:2 * inter + 64].abs().sum() > 0


def test_mamba2_grow_groups_copies_exactly_up_to_the_grouped_norm(tok, mamba2_source):
    """1 -> 2 groups: with the gated norm over all of d_inner (as with 1 group) the grown model's
    logits equal the source's, so the B/C copy is exact; transformers' real per-group norm changes
    them (the documented reason grow_from's group growth is not function-preserving)."""
    from lab.backbone import grow_from
    src_dir, src = mamba2_source
    big = _mamba2(tok, layers=2, groups=2)
    assert grow_from(big, src_dir)["bc_grown"] == 6
    ids = torch.randint(5, len(tok), (2, 63))
    with torch.no_grad():
        a, grouped = src(input_ids=ids).logits, big(input_ids=ids).logits
        for layer in big.backbone.layers:
            layer.mixer.norm.group_size = layer.mixer.intermediate_size
        torch.testing.assert_close(big(input_ids=ids).logits, a, rtol=0, atol=1e-5)
    assert (grouped - a).abs().max() > 1e-3
    with pytest.raises(ValueError, match="cannot grow"):  # fewer groups / smaller state than the source
        grow_from(_mamba2(tok, layers=2, state=8), src_dir)


def test_train_a_state_grown_mamba2_and_its_readme(tok, mamba2_source, tmp_path):
    """init_from a state-16 model with state=32: train runs, the model card names the growth
    and its reproduce command carries model.state."""
    from lab.backbone import TrainConfig, train, write_readme
    src_dir, _ = mamba2_source
    mc = ModelConfig(family="mamba2", hidden=32, head_dim=16, state=32, heads=4, bigram_heads=2, layers=2)
    tc = TrainConfig(minutes=0.02, tokens_per_step=256, threads=1, init_from=str(src_dir))
    model, meta = train(mc, tc, tmp_path / "model", tmp_path / "run", tok, log=lambda s: None)
    assert meta["steps"] >= 1 and model.config.state_size == 32
    write_readme(tmp_path / "model", meta, [])
    text = (tmp_path / "model" / "README.md").read_text()
    assert "state 16 -> 32" in text and "--set model.state=32" in text and "state 32, 1 B/C group(s)" in text


@pytest.mark.parametrize("key", ["train.grow_prepend=1", "train.new_layer_lr_mult=10", "train.freeze_new_mixer=true",
                                 "train.new_state_scale=0.1"], ids=lambda k: k.split("=")[0])
def test_cli_refuses_grow_only_options_without_init_from(key, tmp_path, capsys):
    """A grow-only key on a from-scratch run is an error, not silently dropped."""
    from lab import train_backbone as cli
    with pytest.raises(SystemExit) as e:
        cli.main(["--set", "model.family=mamba2", "--set", f"out={tmp_path / 'm'}", "--set", "train.minutes=0.01",
                  "--set", key])
    assert e.value.code == 2
    assert f"{key.split('=')[0]} only apply with train.init_from" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
