"""MoNe memory that carries the example: after brief meta-training on a tiny random base, reading
memory A vs memory B changes the logits and the answer loss (and a disabled write is caught); the
held-out memory diagnostics equal the naive ingest path; the curriculum's batches and optimizer
groups. CPU, seconds."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nbcore.mone import memory as mem
from nbcore.mone.model import MoNeConfig, MoNeModel
from nbcore.training import mone as tm

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny-qwen2"

T = 16
VALUES = list(range(40, 48))      # the answer is one of 8 tokens
QUERY = [5, 6, 7]


def _tiny_base(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, use_sliding_window=False)
    return Qwen2ForCausalLM(cfg).eval()


def _contexts(g: torch.Generator, b: int):
    """b one-segment contexts: half the tokens are the example's value token c, the rest filler;
    the query is QUERY followed by c (the target)."""
    c = torch.tensor(VALUES)[torch.randint(0, len(VALUES), (b,), generator=g)]
    ctx = torch.randint(8, 40, (b, T), generator=g)
    ctx = torch.where(torch.rand(b, T, generator=g) < 0.5, c[:, None], ctx)
    q = torch.cat([torch.tensor([QUERY] * b), c[:, None]], 1)
    return ctx.view(b, 1, T), q


def _briefly_trained(steps: int = 120) -> MoNeModel:
    torch.set_num_threads(1)
    model = MoNeModel(_tiny_base(), MoNeConfig(segment_len=T, mem_heads=2, lora_rank=4, lora_alpha=4,
                                               gate_init=1.0))
    tc = tm.MetaTrainConfig(lr=1e-2, rate_lr_mult=10.0)
    opt = torch.optim.AdamW(tm.param_groups(model, tc), lr=tc.lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ctx, q = _contexts(g, 8)
        fast = model.write(model.fresh(8), ctx, torch.ones_like(ctx, dtype=torch.bool))
        loss = F.cross_entropy(model.logits(q, fast)[:, -2], q[:, -1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model


def assert_memory_carries_the_example(model: MoNeModel) -> dict:
    """On 32 held-out contexts: the query's logits reading its own memory differ from those reading
    another example's memory, and the own memory's answer CE is lower by at least 0.4 nats (measured:
    0.27 after 40 steps, 0.52 after 100, 0.55 after 120; exactly 0 when the write is disabled)."""
    g = torch.Generator().manual_seed(123)
    ctx, q = _contexts(g, 32)
    with torch.no_grad():
        fast = model.write(model.fresh(32), ctx, torch.ones_like(ctx, dtype=torch.bool))
        own = model.logits(q, fast)[:, -2]
        # example i reads example i+1's memory (rolled batch); contexts with the same value are
        # kept in: they bound the gap from above, not below
        other_fast = [mem.FastWeights(**{k: v.roll(1, 0) for k, v in fw.tensors().items()}) for fw in fast]
        other = model.logits(q, other_fast)[:, -2]
    ce_own = float(F.cross_entropy(own, q[:, -1]))
    ce_other = float(F.cross_entropy(other, q[:, -1]))
    diff = float((own - other).abs().max())
    assert diff > 1e-3, f"memory A and memory B give the same logits (max |diff| {diff:.2e})"
    assert ce_other - ce_own >= 0.4, f"own-memory CE {ce_own:.3f} vs other {ce_other:.3f}: no example-specific gap"
    return {"own": ce_own, "other": ce_other, "diff": diff}


@pytest.fixture(scope="module")
def trained():
    return _briefly_trained()


def test_memory_a_and_memory_b_give_different_answers(trained):
    assert_memory_carries_the_example(trained)


def test_a_disabled_write_is_caught(monkeypatch):
    """The mutation the test above must catch: the write returns the state unchanged, so every
    context's memory is W_0 (briefly trained the same way)."""
    monkeypatch.setattr(mem, "write_segment", lambda state, *a, **k: state)
    model = _briefly_trained()
    with pytest.raises(AssertionError, match="same logits"):
        assert_memory_carries_the_example(model)


# ------------------------------------------------------------------------------------------------
# the held-out diagnostics and the curriculum, on the shipped tiny base and tokenizer

@pytest.fixture(scope="module")
def tiny():
    from nbcore.tasks.tokenizer import load_tokenizer
    torch.set_num_threads(1)
    model = MoNeModel.from_pretrained(TINY, cfg=MoNeConfig(segment_len=64, mem_heads=2, lora_rank=4,
                                                           lora_alpha=4, gate_init=1.0))
    with torch.no_grad():   # non-zero LoRA B, so the adapters take part
        for p in model.mone.parameters():
            if p.dim() == 2 and p.abs().sum() == 0:
                p.normal_(std=0.05)
    return model.eval(), load_tokenizer(TINY)


def test_diagnostics_equal_the_naive_ingest_path(tiny, tmp_path, monkeypatch):
    """Cached frozen inputs + write chain == state.ingest + finalized + answer_nll, for own memory,
    another example's memory (i reads i+1) and no memory; the inputs saved to disk give the same
    result, and a file made for another batch is rebuilt."""
    model, tok = tiny
    cache = tmp_path / "diag.safetensors"
    diag = tm.MemoryDiagnostics(model, tok, lengths=(300,), ns=(3,), seed=0, cache_dtype=torch.float32,
                                cache_file=cache)
    got = diag.evaluate(model)["300"]
    with monkeypatch.context() as m:    # loaded, not recomputed
        m.setattr(model, "segment_inputs", lambda *a: pytest.fail("frozen forward rerun"))
        again = tm.MemoryDiagnostics(model, tok, lengths=(300,), ns=(3,), seed=0, cache_dtype=torch.float32,
                                     cache_file=cache)
    assert again.evaluate(model)["300"] == got
    other = tm.MemoryDiagnostics(model, tok, lengths=(300,), ns=(2,), seed=0, cache_dtype=torch.float32,
                                 cache_file=cache)
    assert other.evaluate(model)["300"]["n"] == 2
    from nbcore.tasks import ruler
    exs = [ruler.generate("niah_single_1", 300, 1000 + i, tok, seed=0, split="test") for i in range(3)]
    ref = {"own_ce": [tm.answer_nll(model, tok, e, "mone") for e in exs],
           "other_ce": [tm.answer_nll(model, tok, e, "mone_other", other=exs[(i + 1) % 3]) for i, e in enumerate(exs)],
           "none_ce": [tm.answer_nll(model, tok, e, "question") for e in exs]}
    assert got["n"] == 3
    for k, v in ref.items():
        assert got[k] == pytest.approx(sum(v) / 3, abs=2e-4), k


def test_curriculum_batches_and_stages(tiny):
    _, tok = tiny
    st = [tm.CurriculumStage(steps=2, segment_len=32, min_segments=1, max_segments=1, batch_size=3),
          tm.CurriculumStage(steps=1, segment_len=64, min_segments=2, max_segments=2, batch_size=2,
                             needle_window=False)]
    tc = tm.MetaTrainConfig(tasks=("s_niah", "mk_niah"), curriculum=st, max_steps=10)
    assert [tm.stage_at(s, tc)[0] for s in range(5)] == [0, 0, 1, 1, 1]
    seg, msk, q, ans, S = tm.make_batch(0, tc, tok)
    assert seg.shape[0] == 3 and seg.shape[2] == 32
    for i in range(3):
        ctx = tok.decode(seg[i][msk[i]].tolist()).replace(" ", "")
        value = re.search(r"\d{7}", tok.decode(q[i][1:][ans[i][:-1]].tolist()).replace(" ", "")).group()
        assert value in ctx   # the window holds the needle whose value the question asks for
    seg, msk, q, ans, S = tm.make_batch(2, tc, tok)
    assert seg.shape == (2, 2, 64) and S == 2


def test_data_seed_draws_other_examples_and_defaults_to_seed(tiny):
    _, tok = tiny
    tc = tm.MetaTrainConfig(tasks=("s_niah",), min_segments=1, max_segments=1, batch_size=2,
                            mone=tm.MoNeConfig(segment_len=64))
    base = tm.make_batch(0, tc, tok)[2]   # the questions and answers (the haystack's start repeats)
    assert torch.equal(tm.make_batch(0, replace(tc, data_seed=tc.seed), tok)[2], base)
    other = tm.make_batch(0, replace(tc, data_seed=7), tok)[2]
    assert other.shape != base.shape or not torch.equal(other, base)


def test_rate_parameters_get_their_own_learning_rate(tiny):
    model, _ = tiny
    groups = tm.param_groups(model, tm.MetaTrainConfig(lr=1e-3, rate_lr_mult=10.0))
    rates = {id(p) for p in groups[1]["params"]}
    named = dict(model.mone.named_parameters())
    assert rates == {id(named[f"{l}.{n}"]) for l in range(model.n_layers)
                     for n in ("lr_proj.bias", "mom_proj.bias", "gate")}
    assert groups[1]["lr"] == pytest.approx(1e-2) and groups[0]["lr"] == pytest.approx(1e-3)
    assert sum(len(g["params"]) for g in groups) == len(model.trainable_parameters())


@pytest.mark.parametrize("flag", ["center_keys", "center_values"])
def test_centring_ablations_remove_the_segment_mean(tiny, flag):
    model, tok = tiny
    ids = torch.tensor([tok("a b c d e f g h " * 8, add_special_tokens=False)["input_ids"][:64]])
    xs = model.segment_inputs(ids)
    mask = torch.ones(1, 64, dtype=torch.bool)
    old = getattr(model.cfg, flag)
    try:
        setattr(model.cfg, flag, True)
        k, v, _, _ = model.write_inputs(0, xs[0], mask)
    finally:
        setattr(model.cfg, flag, old)
    if flag == "center_values":
        assert v.mean(1).abs().max() < 1e-5
    else:   # centred before the L2 norm and RoPE: keys still unit norm, and less alike than without
        k0, _, _, _ = model.write_inputs(0, xs[0], mask)
        assert torch.allclose(k.norm(dim=-1), torch.ones(()), atol=1e-5)
        cos = lambda t: (l := mem.l2norm(t)) @ l.transpose(-1, -2)  # noqa: E731
        kh, k0h = k[0].transpose(0, 1), k0[0].transpose(0, 1)
        assert cos(kh).mean() < cos(k0h).mean()


def test_answer_only_lm_head_equals_the_full_logits_loss(tiny):
    """meta_loss (LM head on answer positions only) == meta_loss_reference: loss, gradients of every
    MoNe parameter, and teacher-forced exact match."""
    model, tok = tiny
    tc = tm.MetaTrainConfig(tasks=("s_niah", "mk_niah"), curriculum=[
        tm.CurriculumStage(steps=1, segment_len=32, min_segments=1, max_segments=2, batch_size=3)])
    batch = tm.make_batch(0, tc, tok)[:4]
    res = []
    for fn in (tm.meta_loss, tm.meta_loss_reference):
        model.zero_grad(set_to_none=True)
        loss, em = fn(model, *batch)
        loss.backward()
        res.append((loss.item(), em, {n: p.grad.clone() for n, p in model.mone.named_parameters()}))
    model.zero_grad(set_to_none=True)
    assert res[0][0] == pytest.approx(res[1][0], rel=1e-5) and res[0][1] == res[1][1]
    for n, g in res[0][2].items():
        torch.testing.assert_close(g, res[1][2][n], rtol=1e-4, atol=1e-6, msg=n)


def test_checkpointed_write_gives_the_same_loss_and_gradients():
    """MoNeModel.write(checkpoint=True) recomputes each (segment, layer) update in the backward pass:
    the same answer loss and the same gradient for every MoNe parameter as the stored-activation
    write, at odd sizes (3 rows, 3 segments of 16 tokens, a padded tail), and identical states
    without grad."""
    torch.manual_seed(0)
    model = MoNeModel(_tiny_base(), MoNeConfig(segment_len=T, mem_heads=2, lora_rank=4, lora_alpha=4,
                                               gate_init=1.0))
    for p in model.mone.parameters():                  # away from the init so every LoRA path carries grad
        p.data.add_(0.05 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    seg = torch.randint(8, 48, (3, 3, T), generator=g)
    msk = torch.ones_like(seg, dtype=torch.bool)
    msk[1, 2, 9:] = False
    msk[2, 2, :] = False
    q = torch.randint(8, 48, (3, 5), generator=g)
    res = []
    for ck in (False, True):
        model.zero_grad(set_to_none=True)
        fast = model.write(model.fresh(3), seg, msk, checkpoint=ck)
        loss = F.cross_entropy(model.logits(q, fast)[:, -2], q[:, -1])
        loss.backward()
        res.append((loss.item(), {n: p.grad.clone() for n, p in model.mone.named_parameters()
                                  if p.grad is not None}))
    assert res[0][0] == pytest.approx(res[1][0], rel=1e-6)
    assert res[0][1].keys() == res[1][1].keys() and len(res[0][1]) > 10
    for n, gr in res[0][1].items():
        torch.testing.assert_close(res[1][1][n], gr, rtol=1e-5, atol=1e-7, msg=n)
    with torch.no_grad():
        a = model.write(model.fresh(3), seg, msk)
        b = model.write(model.fresh(3), seg, msk, checkpoint=True)
    for la, lb in zip(a, b):
        for k, v in la.tensors().items():
            assert torch.equal(v, lb.tensors()[k]), k


def test_write_and_query_keep_every_tensor_on_the_models_device():
    """No GPU here: the model on PyTorch's `meta` device stands in for one. Any tensor the write chain
    (stored or recomputed), the query pass, its backward or the ingest path made on the CPU would meet
    the model's tensors and raise "Tensor on device cpu is not on the expected device meta"."""
    from nbcore.mone import state as mstate
    model = MoNeModel(_tiny_base(), MoNeConfig(segment_len=T, mem_heads=2, lora_rank=4, lora_alpha=4,
                                               gate_init=1.0)).to("meta")
    assert model.device.type == "meta"
    seg = torch.randint(8, 48, (2, 3, T), device="meta")
    msk = torch.ones(2, 3, T, dtype=torch.bool, device="meta")
    q = torch.randint(8, 48, (2, 5), device="meta")
    for ck in (False, True):
        fast = model.write(model.fresh(2), seg, msk, checkpoint=ck)
        loss = F.cross_entropy(model.logits(q, fast)[:, -2], q[:, -1])
        loss.backward()
        assert loss.device.type == "meta"
    st = mstate.ingest(model, list(range(8, 8 + 2 * T + 3)))
    assert all(v.device.type == "meta" for fw in mstate.finalized(model, st) for v in fw.tensors().values())


def test_training_device_names():
    assert tm.resolve_device("cpu").type == "cpu"
    assert tm.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            tm.resolve_device("cuda")
    from notebank.pipeline.config import ConfigError, load_config
    from notebank.pipeline.train_mone import TrainMoneJobConfig
    with pytest.raises(ConfigError, match="train.device must be"):
        load_config(TrainMoneJobConfig, REPO / "configs" / "train_mone.yaml", ["train.device=gpu"]).validate()
