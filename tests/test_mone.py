"""MoNe (nbcore.mone): write rule vs hand-derived gradient, layer-locality, incremental ingest,
context-independent query cost, frozen-model equivalence. Tiny random Qwen2 (GQA), CPU, fast."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nbcore.mone import memory as mem
from nbcore.mone.model import LayerCache, MoNeConfig, MoNeModel
from nbcore.mone.state import MoNeState, append, finalized, ingest, new_state

T = 16


def _tiny(seed=0, **kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, use_sliding_window=False)
    base = Qwen2ForCausalLM(cfg).eval()
    mc = MoNeConfig(segment_len=T, mem_heads=2, lora_rank=4, lora_alpha=4, write_batch=2, **kw)
    model = MoNeModel(base, mc)
    # non-zero LoRA B so every adapter path is exercised
    with torch.no_grad():
        for p in model.mone.parameters():
            if p.dim() == 2 and p.abs().sum() == 0:
                p.normal_(std=0.05)
    return model


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return _tiny()


def _ids(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 64, (n,), generator=g).tolist()


# ------------------------------------------------------------------------------------------------
# the update rule

def test_swiglu_grads_equal_autograd():
    g = torch.Generator().manual_seed(0)
    B, Tn, H, Fw, D = 2, 5, 3, 4, 6
    k, v = torch.randn(B, Tn, H, D, generator=g), torch.randn(B, Tn, H, D, generator=g)
    omega = torch.rand(B, Tn, H, generator=g)
    w = [torch.randn(B, H, Fw, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3)]
    k, v, omega = k.double(), v.double(), omega.double()
    auto = torch.autograd.grad(mem.assoc_loss(k, v, omega, *w), w)
    closed = mem.swiglu_grads(k, v, omega, *[x.detach() for x in w])
    for a, c in zip(auto, closed):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


def test_update_equals_hand_derived_gradient():
    """One head, F=1, D=2, two tokens (one padded), two segments: momentum and renorm by hand."""
    w_in, w_gate, w_out = [0.6, -0.8], [0.3, 0.4], [1.0, 0.5]
    rho = 1.3
    k1, v1, eta = [0.2, 0.9], [0.7, -0.4], 0.8
    st = mem.FastWeights(*(torch.tensor(w, dtype=torch.float64).view(1, 1, 1, 2) for w in (w_in, w_gate, w_out)),
                         *(torch.zeros(1, 1, 1, 2, dtype=torch.float64) for _ in range(3)))
    kk = torch.tensor([k1, [5.0, 5.0]], dtype=torch.float64).view(1, 2, 1, 2)
    vv = torch.tensor([v1, [1.0, 1.0]], dtype=torch.float64).view(1, 2, 1, 2)
    etas = torch.tensor([[eta, 9.0]], dtype=torch.float64).view(1, 2, 1)
    mask = torch.tensor([[True, False]])

    # by hand: a = w_in.k, g = w_gate.k, u = silu(a) g, l = -(v.w_out) u
    a = w_in[0] * k1[0] + w_in[1] * k1[1]
    gg = w_gate[0] * k1[0] + w_gate[1] * k1[1]
    s = 1 / (1 + math.exp(-a))
    silu, dsilu = a * s, s * (1 + a * (1 - s))
    u = silu * gg
    du = -(v1[0] * w_out[0] + v1[1] * w_out[1])
    grad = {"w_out": [-u * v1[0], -u * v1[1]],
            "w_gate": [du * silu * k1[0], du * silu * k1[1]],
            "w_in": [du * gg * dsilu * k1[0], du * gg * dsilu * k1[1]]}
    om = eta / 1  # one valid token: L = (1/T_valid) sum_j eta_j l_j
    expect = {}
    for name, w in (("w_in", w_in), ("w_gate", w_gate), ("w_out", w_out)):
        step = [w[i] - om * grad[name][i] for i in range(2)]
        n = math.hypot(*step)
        expect[name] = [rho * x / n for x in step]

    beta = torch.tensor([[0.25]], dtype=torch.float64)
    new = mem.write_segment(st, kk, vv, etas, beta, mask, rho)
    for name in expect:
        torch.testing.assert_close(getattr(new, name).flatten(), torch.tensor(expect[name], dtype=torch.float64))
        mname = "m_" + name[2:]
        torch.testing.assert_close(getattr(new, mname).flatten(),
                                   torch.tensor([om * g for g in grad[name]], dtype=torch.float64))
    # second segment: mu_2 = beta mu_1 + G_2 (G_2 by the closed form, checked above vs autograd)
    new2 = mem.write_segment(new, kk, vv, etas, beta, mask, rho)
    g2 = mem.swiglu_grads(kk, vv, etas * mask.double().unsqueeze(-1), new.w_in, new.w_gate, new.w_out)
    for name, mname, gr in zip(mem.WEIGHTS, mem.MOMENTA, g2):
        mu = 0.25 * getattr(new, mname) + gr
        torch.testing.assert_close(getattr(new2, mname), mu)
        torch.testing.assert_close(getattr(new2, name), mem.renorm_rows(getattr(new, name) - mu, rho))
    # an all-padding segment leaves the state unchanged
    same = mem.write_segment(new, kk, vv, etas, beta, torch.zeros_like(mask), rho)
    for x, y in zip(same.tensors().values(), new.tensors().values()):
        assert torch.equal(x, y)


def test_layer_loss_gradient_is_the_update():
    """With eta = 1 and zero momentum, W_1 = renorm(W_0 - grad L_1) where L_1 is layer l's own
    segment loss -(1/T) sum v^T M(k), differentiated by autograd."""
    model = _tiny()
    ids = torch.tensor(_ids(T)).view(1, 1, T)
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        for ml in model.mone:
            ml.lr_proj.weight.zero_()
            ml.lr_proj.bias.fill_(mem.inv_softplus(1.0))
    xs = model.segment_inputs(ids.view(1, T))
    fresh = model.fresh(1)
    new = model.write(fresh, ids, mask)
    for l in range(model.n_layers):
        w = {k: getattr(fresh[l], k).clone().requires_grad_() for k in mem.WEIGHTS}
        loss = model.layer_loss(l, w, xs[l].detach(), mask[:, 0])
        grads = torch.autograd.grad(loss, [w[k] for k in mem.WEIGHTS])
        for name, gr in zip(mem.WEIGHTS, grads):
            ref = mem.renorm_rows(getattr(fresh[l], name) - gr, model.rho)
            torch.testing.assert_close(getattr(new[l], name).detach(), ref, rtol=1e-5, atol=1e-6)


def test_gradients_are_layer_local(model):
    """d W_s^(l) / d W_{s-1}^(l') = 0 for l' != l, and the frozen activations feeding the write
    do not depend on any fast weight."""
    ids = torch.tensor(_ids(2 * T, seed=3)).view(1, 2, T)
    mask = torch.ones_like(ids, dtype=torch.bool)
    L = model.n_layers
    base = model.fresh(1)
    for l in range(L):
        inp = [mem.FastWeights(**{k: v.clone().requires_grad_() for k, v in fw.tensors().items()})
               for fw in base]
        out = model.write(inp, ids, mask)
        target = sum((t * torch.randn_like(t)).sum() for t in out[l].tensors().values())
        leaves = [t for fw in inp for t in fw.tensors().values()]
        grads = torch.autograd.grad(target, leaves, allow_unused=True)
        per_layer = [grads[i * 6:(i + 1) * 6] for i in range(L)]
        for lp in range(L):
            nz = any(g is not None and g.abs().sum() > 0 for g in per_layer[lp])
            assert nz == (lp == l), f"layer {l} update depends on layer {lp}: {nz}"
    # perturbing other layers' fast weights changes nothing at layer l
    perturbed = [mem.FastWeights(**{k: v + 0.3 * torch.randn_like(v) for k, v in fw.tensors().items()})
                 for fw in base]
    a = model.write(base, ids, mask)
    for l in range(L):
        mixed = [base[i] if i == l else perturbed[i] for i in range(L)]
        b = model.write(mixed, ids, mask)
        for x, y in zip(a[l].tensors().values(), b[l].tensors().values()):
            assert torch.equal(x, y)


# ------------------------------------------------------------------------------------------------
# state: incremental ingest, persistence

@pytest.mark.parametrize("split", [5, 2 * T, 2 * T + 7])
def test_two_part_ingest_equals_one(model, split, tmp_path):
    ids = _ids(3 * T + 9, seed=4)
    one = ingest(model, ids)
    part = ingest(model, ids[:split])
    part.save(tmp_path / "s.safetensors")
    two = append(model, MoNeState.load(tmp_path / "s.safetensors"), ids[split:])
    assert one.pending == two.pending and one.n_segments == two.n_segments == 3
    assert one.n_tokens == two.n_tokens == len(ids)
    for (k, x), y in zip(one.tensors().items(), two.tensors().values()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=k)
    fa, fb = finalized(model, one), finalized(model, two)
    for x, y in zip(fa, fb):
        torch.testing.assert_close(x.w_out, y.w_out, rtol=1e-5, atol=1e-6)


def test_state_is_fixed_size_and_roundtrips(model, tmp_path):
    short, long = ingest(model, _ids(T)), ingest(model, _ids(9 * T, seed=5))
    assert short.nbytes() == long.nbytes()
    long.save(tmp_path / "x.safetensors")
    back = MoNeState.load(tmp_path / "x.safetensors")
    for x, y in zip(long.tensors().values(), back.tensors().values()):
        assert torch.equal(x, y)
    # pure state: fresh state = W_0, zero momentum
    fresh = new_state(model)
    assert torch.equal(fresh.layers[0].w_in[0], model.w0(0)["w_in"])
    assert fresh.layers[0].m_in.abs().sum() == 0


# ------------------------------------------------------------------------------------------------
# query pass

def test_memory_off_equals_frozen_hf_model(model):
    ids = torch.tensor([_ids(23, seed=6)])
    with torch.no_grad():
        ref = model.base(input_ids=ids).logits
        ours = model.logits(ids, fast=None)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_causal_fast_path_equals_the_masked_reference(model):
    """Plain prompts at positions 0..n-1 take SDPA's is_causal kernel; shifted positions take the
    explicit-mask path, and RoPE makes the scores depend on offsets only, so both must agree."""
    ids = torch.tensor([_ids(37, seed=9)])
    with torch.no_grad():
        fast_path = model.logits(ids, fast=None)
        masked = model.logits(ids, fast=None, positions=torch.arange(37) + 11)
        last = model.logits(ids, fast=None, last_only=True)
    torch.testing.assert_close(fast_path, masked, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, fast_path[:, -1:], rtol=1e-5, atol=1e-5)


def test_cached_generation_matches_full_recompute(model):
    fast = finalized(model, ingest(model, _ids(2 * T + 3, seed=7)))
    prompt = _ids(6, seed=8)
    out, cache = model.generate(prompt, fast, max_new=5, return_cache=True)
    with torch.no_grad():
        seq = prompt + out
        full = model.logits(torch.tensor([seq]), fast)[0]
    pred = full[len(prompt) - 1:-1].argmax(-1).tolist()
    assert pred == out
    assert cache.n_entries() == 2 * (len(seq) - 1)  # own + one memory token per processed token


def test_query_cost_does_not_depend_on_context_length(model):
    from torch.utils.flop_counter import FlopCounterMode
    prompt = _ids(7, seed=9)
    res = []
    for n in (T + 1, 12 * T + 5):
        fast = finalized(model, ingest(model, _ids(n, seed=10)))
        with FlopCounterMode(display=False) as fc:
            out, cache = model.generate(prompt, fast, max_new=4, eos=None, return_cache=True)
        res.append((fc.get_total_flops(), cache.n_entries(), len(out)))
    assert res[0] == res[1], res
    assert res[0][1] == 2 * (len(prompt) + 3)  # memory tokens = processed query tokens


def test_memory_changes_answers_and_meta_gradients_flow(model):
    """The read path is live (memory changes logits), and answer loss reaches every MoNe parameter
    (through the write chain) but no base parameter."""
    ctx = torch.tensor(_ids(2 * T, seed=11)).view(1, 2, T)
    q = torch.tensor([_ids(8, seed=12)])
    fast = model.write(model.fresh(1), ctx, torch.ones_like(ctx, dtype=torch.bool))
    logits = model.logits(q, fast)
    with torch.no_grad():
        plain = model.logits(q, None)
    assert (logits - plain).abs().max() > 1e-4
    loss = F.cross_entropy(logits[0, :-1], q[0, 1:])
    model.zero_grad(set_to_none=True)
    loss.backward()
    for name, p in model.mone.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(p.grad is None for p in model.base.parameters())
