"""nbcore.kernels: the fast CPU kernels against transformers' own pure-torch reference functions.

Tolerances (fp32, as documented in nbcore/kernels/gdn_cpu.py and mamba2_cpu.py):
- kernel level: max |fast - reference| <= 1e-5 * max(1, max |reference|), outputs and final states;
- whole model: logits and every cached state tensor within 1e-4 * max(1, max |reference|).
The differences are float rounding only (same maths, different association).
"""
import inspect
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mamba2 import modeling_mamba2
from transformers.models.qwen3_5 import modeling_qwen3_5

from nbcore import kernels
from nbcore.backbones import RawTap, load_backbone
from nbcore.kernels import gdn_cpu, mamba2_cpu
from nbcore.testing import byte_tokenizer, tiny_gdn_config, tiny_mamba2_config

REF_GDN = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
REF_CONV = inspect.unwrap(modeling_qwen3_5.causal_conv1d_fn)
REF_MAMBA = inspect.unwrap(modeling_mamba2.mamba2_chunk_scan)
KERNEL_TOL = 1e-5
MODEL_TOL = 1e-4


def _close(a, b, tol):
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(1.0, b.float().abs().max().item())
    diff = (a.float() - b.float()).abs().max().item()
    assert diff <= tol * scale, f"max abs diff {diff:.3g} > {tol:g} x {scale:.3g}"


def _gdn_inputs(T, B=1, Hk=2, Hv=2, K=16, V=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # q/k/v as transformers passes them: strided views of one [B, T, channels] conv output
    mixed = torch.randn(B, T, 2 * Hk * K + Hv * V, generator=g)
    mixed[..., :2 * Hk * K] *= K ** -0.5                # |k| ~ 1: a stable delta rule without the l2 norm too
    q, k, v = torch.split(mixed, [Hk * K, Hk * K, Hv * V], dim=-1)
    q, k, v = q.reshape(B, T, Hk, K), k.reshape(B, T, Hk, K), v.reshape(B, T, Hv, V)
    decay = torch.rand(B, T, Hv, generator=g) * 0.3
    decay[..., 0] *= 20.0                              # one strongly decaying head: exercises the clamps
    beta = torch.rand(B, T, Hv, generator=g)
    s0 = torch.randn(B, Hv, K, V, generator=g) * 0.5
    return [t.to(dtype) for t in (q, k, v)] + [-decay, beta.to(dtype), s0]


GDN_CASES = [
    dict(T=1), dict(T=31), dict(T=63), dict(T=64), dict(T=65), dict(T=129), dict(T=300, B=2),
    dict(T=65, Hk=2, Hv=4), dict(T=129, Hk=1, Hv=3, K=8, V=16),        # grouped value heads
    dict(T=97, B=2, Hk=2, Hv=4),
]


@pytest.mark.parametrize("case", GDN_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("init", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("l2", [True, False], ids=["l2norm", "no-l2norm"])
def test_chunk_gated_delta_rule_matches_reference(case, init, l2):
    q, k, v, g, beta, s0 = _gdn_inputs(**case)
    kw = dict(initial_state=s0 if init else None, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    ro, rs = REF_GDN(q, k, v, g, beta, **kw)
    fo, fs = gdn_cpu.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert fo.dtype == ro.dtype and fo.is_contiguous()
    _close(fo, ro, KERNEL_TOL)
    _close(fs, rs, KERNEL_TOL)


@pytest.mark.parametrize("chunk,segment", [(16, 32), (32, 64), (64, 2048)])
def test_chunk_and_segment_sizes_do_not_change_the_result(chunk, segment):
    q, k, v, g, beta, s0 = _gdn_inputs(T=200)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ro, rs = REF_GDN(q, k, v, g, beta, **kw)
    fo, fs = gdn_cpu.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, segment=segment, **kw)
    _close(fo, ro, KERNEL_TOL)
    _close(fs, rs, KERNEL_TOL)


def test_chunk_gated_delta_rule_bf16_and_no_final_state():
    q, k, v, g, beta, _ = _gdn_inputs(T=70, dtype=torch.bfloat16)
    ro, rs = REF_GDN(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    fo, fs = gdn_cpu.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert rs is None and fs is None and fo.dtype == torch.bfloat16
    _close(fo, ro, 2e-2)                                 # bf16 output rounding


def test_chunk_gated_delta_rule_split_carries_state():
    q, k, v, g, beta, s0 = _gdn_inputs(T=150)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    full, s_full = gdn_cpu.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, **kw)
    a, s_mid = gdn_cpu.chunk_gated_delta_rule(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37],
                                              initial_state=s0, **kw)
    b, s_end = gdn_cpu.chunk_gated_delta_rule(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:],
                                              initial_state=s_mid, **kw)
    _close(torch.cat([a, b], 1), full, KERNEL_TOL)
    _close(s_end, s_full, KERNEL_TOL)


@pytest.mark.parametrize("T,D,W,bias,act,layout", [
    (1, 6, 4, False, "silu", "channels_last"), (3, 6, 4, True, None, "contiguous"),
    (5, 6, 8, False, "silu", "channels_last"), (700, 40, 8, True, "silu", "contiguous"),
    (1100, 40, 10, False, "silu", "channels_last"), (1024, 8, 4, True, "silu", "channels_last"),
])
@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
def test_causal_conv1d_matches_reference(T, D, W, bias, act, layout, inplace):
    g = torch.Generator().manual_seed(T)
    # transformers passes a transposed [B, T, D] projection (channels last) or a cat (contiguous)
    x = torch.randn(2, T, D, generator=g).transpose(1, 2) if layout == "channels_last" \
        else torch.randn(2, D, T, generator=g)
    w = torch.randn(D, W, generator=g)
    b = torch.randn(D, generator=g) if bias else None
    ref = REF_CONV(x, w, b, activation=act)
    x_in = x.clone(memory_format=torch.preserve_format)
    out = gdn_cpu.causal_conv1d_fn(x_in, w, b, activation=act, inplace=inplace)
    assert out.stride() == x.stride()
    _close(out, ref, KERNEL_TOL)
    if inplace:
        assert out.data_ptr() == x_in.data_ptr()
    else:
        assert torch.equal(x_in, x)                      # input untouched


def _mamba_inputs(T, B=1, H=8, P=16, G=2, N=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(B, T, H * P + 2 * G * N, generator=g)
    x, b, c = torch.split(proj, [H * P, G * N, G * N], dim=-1)
    return dict(hidden_states=x.reshape(B, T, H, P), dt=torch.randn(B, T, H, generator=g) - 1,
                A=-torch.rand(H, generator=g) * 4 - 0.1, B=b.reshape(B, T, G, N), C=c.reshape(B, T, G, N),
                D=torch.randn(H, generator=g), dt_bias=torch.randn(H, generator=g) * 0.5,
                s0=torch.randn(B, H, P, N, generator=g) * 0.3)


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 129, 300])
@pytest.mark.parametrize("init", [False, True], ids=["zero-state", "initial-state"])
def test_mamba2_chunk_scan_matches_reference(T, init):
    inp = _mamba_inputs(T, B=2 if T == 65 else 1, G=1 if T == 129 else 2)
    s0 = inp.pop("s0")
    args = [inp.pop(n) for n in ("hidden_states", "dt", "A", "B", "C")]
    kw = dict(inp, initial_states=s0 if init else None, dt_softplus=True, return_final_states=True)
    ro, rs = REF_MAMBA(*args, 64, **kw)
    fo, fs = mamba2_cpu.mamba2_chunk_scan(*args, 64, **kw)
    assert fo.dtype == ro.dtype
    _close(fo, ro, KERNEL_TOL)
    _close(fs, rs, KERNEL_TOL)
    # without final state / D / dt_bias, as the reference
    r1 = REF_MAMBA(*args, 32)
    f1 = mamba2_cpu.mamba2_chunk_scan(*args, 32)
    assert isinstance(f1, torch.Tensor)
    _close(f1, r1, KERNEL_TOL)


# ---- the switch ------------------------------------------------------------------------------

def test_switch(monkeypatch):
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert kernels.fast_kernels_enabled() and kernels.fast_kernels_enabled("cpu")
    assert not kernels.fast_kernels_enabled("cuda")             # never on GPU
    monkeypatch.setenv(kernels.ENV, "0")
    assert not kernels.fast_kernels_enabled("cpu")
    kernels.set_fast_kernels(True)
    try:
        assert kernels.fast_kernels_enabled("cpu") and not kernels.fast_kernels_enabled("cuda")
    finally:
        kernels.set_fast_kernels(None)
    monkeypatch.setenv(kernels.ENV, "1")
    with kernels.reference_kernels():
        assert not kernels.fast_kernels_enabled()
    assert kernels.fast_kernels_enabled()


def test_installed_sets_and_restores_module_functions():
    mod = modeling_qwen3_5
    before = (mod.torch_chunk_gated_delta_rule, mod.causal_conv1d_fn, mod.torch_recurrent_gated_delta_rule)
    with torch.no_grad():
        with kernels.installed(mod, "cpu") as on:
            assert on
            assert mod.torch_chunk_gated_delta_rule is gdn_cpu.chunk_gated_delta_rule
            assert mod.causal_conv1d_fn is gdn_cpu.causal_conv1d_fn
            assert mod.torch_recurrent_gated_delta_rule is before[2]   # decode step untouched
        with kernels.installed(mod, "cuda") as on:
            assert not on and mod.torch_chunk_gated_delta_rule is before[0]
        with kernels.reference_kernels(), kernels.installed(mod, "cpu") as on:
            assert not on and mod.torch_chunk_gated_delta_rule is before[0]
    with kernels.installed(mod, "cpu") as on:                           # autograd on: inference-only kernels stay out
        assert not on and mod.torch_chunk_gated_delta_rule is before[0]
    assert (mod.torch_chunk_gated_delta_rule, mod.causal_conv1d_fn, mod.torch_recurrent_gated_delta_rule) == before


def test_kernels_refuse_autograd_inputs():
    q, k, v, g, beta, _ = _gdn_inputs(T=10)
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match="inference-only"):
        gdn_cpu.chunk_gated_delta_rule(q, k, v, g, beta)
    with torch.no_grad():
        gdn_cpu.chunk_gated_delta_rule(q, k, v, g, beta)


def test_importing_kernels_does_not_import_triton():
    code = ("import sys\nimport nbcore.kernels, nbcore.kernels.gdn_cpu, nbcore.kernels.mamba2_cpu\n"
            "nbcore.kernels.overrides_for('transformers.models.mamba2.modeling_mamba2')\n"
            "print('triton' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
    for mod in (kernels, gdn_cpu, mamba2_cpu):
        src = inspect.getsource(mod)
        assert "import triton" not in src and "from triton" not in src


# ---- whole models: fast path on vs off ------------------------------------------------------------

MODELS = {
    "tiny-gdn-v5": lambda: load_backbone("models/tiny-gdn-v5"),
    "gdn-gqa": lambda: load_backbone(tiny_gdn_config(), tokenizer=byte_tokenizer(), seed=0),
    "gdn-hybrid": lambda: load_backbone(tiny_gdn_config(hybrid=True), tokenizer=byte_tokenizer(), seed=0),
    "gdn-conv10": lambda: load_backbone(tiny_gdn_config(conv=10), tokenizer=byte_tokenizer(), seed=0),
    "mamba2": lambda: load_backbone(tiny_mamba2_config(), tokenizer=byte_tokenizer(), seed=0),
    "tiny-mamba2-p5": lambda: load_backbone("models/tiny-mamba2-p5"),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def bb(request):
    return MODELS[request.param]()


def _ids(bb, T, seed=0):
    vocab = bb.model.config.vocab_size
    return torch.randint(3, vocab, (T,), generator=torch.Generator().manual_seed(seed))


def _run(bb, ids, splits=None, tap=None):
    s = bb.new_state()
    a = 0
    for b in (splits or []) + [len(ids)]:
        logits = bb.forward(s, ids[a:b], tap=tap)
        a = b
    return logits, bb.state_to_tensors(s)


def _model_close(out_fast, out_ref):
    (lf, sf), (lr, sr) = out_fast, out_ref
    _close(lf, lr, MODEL_TOL)
    assert sf.keys() == sr.keys()
    for k in sf:
        _close(sf[k], sr[k], MODEL_TOL)


def test_model_fast_path_equals_reference(bb):
    ids = _ids(bb, 333)
    fast = _run(bb, ids)
    with kernels.reference_kernels():
        ref = _run(bb, ids)
    _model_close(fast, ref)


def test_model_fast_path_chunked_prefill_equals_one_pass(bb):
    ids = _ids(bb, 300, seed=1)
    one = _run(bb, ids)
    chunked = _run(bb, ids, splits=[1, 38, 130, 259])
    _model_close(chunked, one)
    with kernels.reference_kernels():
        ref_chunked = _run(bb, ids, splits=[1, 38, 130, 259])
    _model_close(chunked, ref_chunked)


def test_model_capture_same_with_fast_path(bb):
    ids = _ids(bb, 150, seed=2)
    tap_f, tap_r = RawTap(len(bb.rec_layers)), RawTap(len(bb.rec_layers))
    _run(bb, ids, splits=[70], tap=tap_f)
    with kernels.reference_kernels():
        _run(bb, ids, splits=[70], tap=tap_r)
    (qf, kf), (qr, kr) = tap_f.result(), tap_r.result()
    assert qf.shape == qr.shape == (150, bb.n_channels, bb.key_dim)
    _close(qf, qr, KERNEL_TOL)
    _close(kf, kr, KERNEL_TOL)


def test_model_env_switch_off_uses_reference(bb, monkeypatch):
    """NB_FAST_KERNELS=0: the forward never calls the fast functions."""
    calls = []
    names = kernels.overrides_for(bb._module.__name__)
    spies = {n: (lambda *a, _n=n, **k: calls.append(_n)) for n in names}
    monkeypatch.setattr(kernels, "overrides_for", lambda *a, **k: spies)
    monkeypatch.setenv(kernels.ENV, "0")
    _run(bb, _ids(bb, 20))
    assert calls == []
    monkeypatch.setenv(kernels.ENV, "1")
    with pytest.raises(Exception):
        _run(bb, _ids(bb, 20))                                   # spies return None: proves they ran
    assert calls


# ---- the benchmark script ---------------------------------------------------------------------

def test_prefill_benchmark_smoke(tmp_path):
    from bench import prefill_cpu
    out = tmp_path / "prefill.json"
    doc = prefill_cpu.main(["--lengths", "100,300", "--reps", "1", "--block", "256", "--also-block", "64",
                            "--out", str(out)])
    assert out.exists() and doc["speedup_at"] == "300" and doc["within_tolerance"]
    row = doc["lengths"]["300"]
    assert row["tokens"] == 300 and row["block"] == 256 and row["fast_tok_s"] > 0 and row["fallback_tok_s"] > 0
    assert doc["speedup"] == row["speedup"] and doc["ingest_block"]["block"] == 64
    assert {"machine", "date", "command", "threads", "tolerance"} <= set(doc)


@pytest.mark.parametrize("argv", [["--reps", "0"], ["--lengths", "12Q"], ["--threads", "0"]])
def test_prefill_benchmark_rejects_bad_args(argv):
    from bench import prefill_cpu
    with pytest.raises(SystemExit):
        prefill_cpu.main(argv)
