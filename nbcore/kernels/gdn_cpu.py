"""Faster CPU kernels for transformers' Gated DeltaNet layers (qwen3_5 / qwen3_next).

Drop-in replacements, same signatures and return values, for the pure-torch fallbacks that
transformers uses when flash-linear-attention / causal-conv1d are not installed:

- `chunk_gated_delta_rule` for `torch_chunk_gated_delta_rule`,
- `causal_conv1d_fn` for `causal_conv1d_fn` (depthwise causal short conv + optional SiLU).

Same maths, reorganised for a CPU (all fp32, like the reference):

* Chunked delta rule. Per chunk of C tokens the reference solves the UT system, then runs a
  Python loop over chunks doing four small matmuls, a subtraction and a strided write each. Here
  everything that does not depend on the carried state is computed for all chunks at once (one
  triangular solve with the value and key right-hand sides side by side, then batched matmuls),
  and the carried-state recurrence is folded into one affine map per chunk,
  ``S_i = M_i S_{i-1} + B_i`` with ``M_i = g_i I - Kd_i^T W_i`` and ``B_i = Kd_i^T U_i``, so the
  sequential loop is a single small ``baddbmm`` per chunk. The outputs are then one batched
  ``O = A U + (Qd - A W) S_prev``. Work is done in segments of a few thousand tokens so the
  per-chunk [C, C] tensors stay in cache and memory stays bounded at any length.
* Short conv. ``F.conv1d`` with ``groups=channels`` (mkldnn) is slow on CPU for this shape
  (kernel 4-10, hundreds of channels, very long T). Here it is W shifted multiply-adds over tiles
  of a few hundred tokens (cache resident), with the SiLU applied per tile, in the input's memory
  layout (time-major for the prefill's transposed projection, channel-major after a cat). With
  ``inplace=True`` (what `nbcore.kernels.installed` asks for inside the backbone's forward) the
  result overwrites the input: no new sequence-sized buffer, whose first touch alone costs more
  than the conv on a VM.
* q/k preparation (transformers' l2norm, then q times K^-1/2): one C pass per row
  (`nbcore.kernels.native.l2norm_`, ~5% of a layer call less on the tiny models) instead of
  square / sum / rsqrt / two multiplies over the segment; it reproduces the torch ops' bits
  (ATen's summation order, checked once per head size at first use, else those torch ops run).
* exp() arguments are clamped at -80 (e^-80 ~ 2e-35 stands for 0): x86 exp is ~40x slower when
  its result would be denormal, or its input is -inf (the reference's masking).

Tolerance (fp32; checked by tests/test_cpu_kernels.py and bench/prefill_cpu.py): outputs and
final states agree with transformers' reference to max |diff| <= 1e-5 x max(1, max |reference|)
at the test sizes (typically ~1e-6); a whole model's logits and cached states agree to
<= 1e-4 x max(1, max |reference|) (tiny-gdn-v5 at 64K tokens: ~2e-6 logits, ~1e-5 states). The
difference is float rounding only (same products, associated differently; chunk size 32 here vs
64 there).

Shapes: B batch, T tokens, H heads (Hk key heads, Hv value heads, Hv a multiple of Hk), K / V
head dims.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunk_gated_delta_rule", "causal_conv1d_fn", "CHUNK", "SEGMENT", "L2_EPS"]

CHUNK = 32        # tokens per chunk (the UT-transform block)
SEGMENT = 2048    # tokens per segment of the batched precompute (bounded memory, cache locality)


_EXP_MIN = -80.0   # exp() clamps its argument here: e^-80 ~ 1.8e-35 is 0 for every purpose here, and
#                    x86 exp is ~40x slower when the result is denormal (or the input -inf)


def _chunked_f32(x: torch.Tensor, Hv: int, C: int) -> torch.Tensor:
    """[B, T, H, D] (any strides, any float dtype) -> [N, B*Hv, C, D] fp32 contiguous, chunk-major
    (N = ceil(T / C)), in one copy: heads repeated for grouped value heads (key head h serves value
    heads h*r .. h*r+r-1, as transformers' repeat_interleave), padding rows zero."""
    B, T, H, D = x.shape
    r = Hv // H
    N = -(-T // C)
    out = torch.empty((N, B, H, r, C, D), dtype=torch.float32, device=x.device)
    dst = out.permute(0, 4, 1, 2, 3, 5)                      # [N, C, B, H, r, D]
    src = x.transpose(0, 1)[:, :, :, None]                    # [T, B, H, 1, D]
    nf, tail = divmod(T, C)
    if nf:
        dst[:nf].copy_(src[:nf * C].view(nf, C, B, H, 1, D))
    if tail:
        dst[nf, :tail].copy_(src[nf * C:])
        dst[nf, tail:].zero_()
    return out.view(N, B * Hv, C, D)


def _gates_f32(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, Hv] -> [N, B*Hv, C] fp32 contiguous, chunk-major, zero padded."""
    B, T, H = x.shape
    N = -(-T // C)
    out = torch.empty((N, B, H, C), dtype=torch.float32, device=x.device)
    dst = out.permute(0, 3, 1, 2)                             # [N, C, B, H]
    src = x.transpose(0, 1)                                   # [T, B, H]
    nf, tail = divmod(T, C)
    if nf:
        dst[:nf].copy_(src[:nf * C].view(nf, C, B, H))
    if tail:
        dst[nf, :tail].copy_(src[nf * C:])
        dst[nf, tail:].zero_()
    return out.view(N, B * H, C)


L2_EPS = 1e-6       # transformers' `l2norm` eps (qwen3_5 / qwen3_next)


def _l2norm_(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """In place, as transformers' `l2norm`: x * rsqrt(sum(x^2) + eps) over the last dim."""
    return x.mul_(torch.rsqrt(x.square().sum(-1, keepdim=True).add_(eps)))


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, K: int, l2norm: bool) -> None:
    """In place: q, k L2-normalised over the head dim (if l2norm), then q scaled by K^-1/2.
    One C pass per tensor where `nbcore.kernels.native` runs and reproduces these torch ops'
    bits (checked once per head size), else the torch ops: the same numbers either way."""
    if l2norm:
        from nbcore.kernels import native
        if native.l2norm_(q, L2_EPS, K ** -0.5):        # q done (scale included): never normalised twice
            if not native.l2norm_(k, L2_EPS):
                _l2norm_(k)
            return
        _l2norm_(q)
        _l2norm_(k)
    q.mul_(K ** -0.5)


def _segment(q, k, v, g, beta, S, C):
    """n consecutive chunks, all heads at once. q, k: [n, BH, C, K]; v: [n, BH, C, V]; g, beta:
    [n, BH, C]; S: [BH, K, V] carried state, updated in place. -> output [n, BH, C, V].
    q and k are private copies and are overwritten."""
    n, BH, _, K = k.shape
    V = v.shape[-1]
    gc = g.cumsum(-1)                                                  # log decay since chunk start
    last = gc[..., -1:]                                                # [n, BH, 1]
    beta = beta[..., None]
    # decay between positions j <= i of a chunk, 0 above the diagonal
    D = (gc[..., :, None] - gc[..., None, :]).clamp_(_EXP_MIN, 0.0).exp_().mul_(_lower(C, g.device))
    egc = gc.clamp(min=_EXP_MIN).exp_()[..., None]                     # [n, BH, C, 1]
    # UT system: (I + strictly_lower(Kb K^T * D)) X = [V*beta | K*beta*exp(gc)] -> X = [U | W]
    kb = k * beta
    Akk = torch.matmul(kb, k.mT).mul_(D)
    rhs = torch.empty((n, BH, C, V + K), dtype=torch.float32, device=k.device)
    torch.mul(v, beta, out=rhs[..., :V])
    torch.mul(kb, egc, out=rhs[..., V:])
    del kb
    # solved as X^T (I + L)^-T = rhs^T: the right-side form runs ~3x faster in LAPACK on these layouts
    X = torch.linalg.solve_triangular(Akk.mT, rhs.mT, upper=True, left=False, unitriangular=True).mT
    del Akk, rhs
    Aqk = torch.matmul(q, k.mT).mul_(D)                                # intra-chunk attention
    del D
    AX = torch.matmul(Aqk, X)                                          # [A U | A W]
    del Aqk
    Qp = q.mul_(egc).sub_(AX[..., V:])                                 # Qd - A W: reads S_prev
    kd = k.mul_((last - gc).clamp_(min=_EXP_MIN).exp_()[..., None])    # keys decayed to chunk end
    KX = torch.matmul(kd.mT, X)                                        # [Kd^T U | Kd^T W]: [n, BH, K, V+K]
    del X, kd
    # affine chunk map S_i = M_i S_{i-1} + B_i
    M = KX[..., V:].neg()
    M.diagonal(dim1=-2, dim2=-1).add_(last.clamp(min=_EXP_MIN).exp_())
    Bm = KX[..., :V]
    Sall = torch.empty((n + 1, BH, K, V), dtype=torch.float32, device=k.device)
    Sall[0].copy_(S)
    Ms, Bs, Ss = M.unbind(0), Bm.unbind(0), Sall.unbind(0)
    for i in range(n):
        torch.baddbmm(Bs[i], Ms[i], Ss[i], out=Ss[i + 1])
    S.copy_(Ss[n])
    # O = A U + (Qd - A W) S_prev
    return torch.matmul(Qp, Sall[:n]).add_(AX[..., :V])


def _no_grad_check(name: str, *tensors) -> None:
    """These kernels are inference-only (in-place ops, out= writes): refuse autograd inputs
    clearly instead of failing deep inside (nbcore.kernels.installed never installs them then)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(f"nbcore.kernels {name} is inference-only; run under torch.no_grad() or use "
                           "transformers' reference (nbcore.kernels.reference_kernels())")


_LOWER: dict = {}


def _lower(C: int, device) -> torch.Tensor:
    """[C, C] fp32, 1 on and below the diagonal, 0 above (multiplying is ~15x faster than masked_fill)."""
    key = (C, str(device))
    m = _LOWER.get(key)
    if m is None:
        m = _LOWER[key] = torch.ones(C, C, dtype=torch.float32, device=device).tril_()
    return m


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = CHUNK,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    segment: int | None = None,
    feature_sink=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over a whole sequence, chunked; same contract as transformers'
    `torch_chunk_gated_delta_rule`.

    query, key: [B, T, Hk, K]; value: [B, T, Hv, V] (Hv a multiple of Hk); g (log decay, <= 0),
    beta: [B, T, Hv]; initial_state: [B, Hv, K, V] or None.
    -> (output [B, T, Hv, V] in query's dtype, final state [B, Hv, K, V] fp32 or None).
    `segment`: tokens per precompute segment (a multiple of chunk_size; default SEGMENT).
    `feature_sink(a, t, q, k)`: called per segment with the raw query/key of tokens a .. a+t-1 as
    this kernel lays them out, [n, B*Hv, C, K] fp32 chunk-major (zero padding rows, key heads
    repeated), before the L2 norm; it may read but not keep or modify them. NoteBank's feature
    capture reduces them there (`ChunkReducer.on_segment`) instead of re-reading q/k."""
    if kwargs.get("cu_seqlens") is not None:
        raise ValueError("chunk_gated_delta_rule (CPU) does not support packed sequences (cu_seqlens)")
    _no_grad_check("chunk_gated_delta_rule", query, key, value, g, beta, initial_state)
    dtype = query.dtype
    B, T, Hk, K = key.shape
    Hv, V = value.shape[-2:]
    C = int(chunk_size)
    seg = max(C, (int(segment or SEGMENT) // C) * C)
    BH = B * Hv
    S = torch.zeros((BH, K, V), dtype=torch.float32, device=value.device) if initial_state is None \
        else initial_state.to(device=value.device, dtype=torch.float32).reshape(BH, K, V).clone()
    out = torch.empty((B, T, Hv, V), dtype=dtype, device=value.device)
    # Segment by segment (inputs copied to chunk-major fp32 per segment: small buffers, no
    # sequence-sized temporaries, whose first touch is costly)
    for a in range(0, T, seg):
        b = min(T, a + seg)
        q = _chunked_f32(query[:, a:b], Hv, C)
        k = _chunked_f32(key[:, a:b], Hv, C)
        if feature_sink is not None:
            feature_sink(a, b - a, q, k)
        _prepare_qk(q, k, K, use_qk_l2norm_in_kernel)
        o = _segment(q, k, _chunked_f32(value[:, a:b], Hv, C), _gates_f32(g[:, a:b], C),
                     _gates_f32(beta[:, a:b], C), S, C)             # [n, BH, C, V]
        _unchunk_into(out[:, a:b], o)
    return out, (S.view(B, Hv, K, V) if output_final_state else None)


chunk_gated_delta_rule.accepts_feature_sink = True   # see `feature_sink` (nbcore.backbones.hf)


def _unchunk_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """src [n, B*H, C, V] chunk-major -> dst [B, L, H, V] (L <= n*C: padding rows dropped)."""
    B, L, H, V = dst.shape
    n, _, C, _ = src.shape
    src = src.view(n, B, H, C, V).permute(1, 0, 3, 2, 4)      # [B, n, C, H, V]
    nf, tail = divmod(L, C)
    if nf:
        dst[:, :nf * C].view(B, nf, C, H, V).copy_(src[:, :nf])
    if tail:
        dst[:, nf * C:].copy_(src[:, nf, :tail])


CONV_TILE = 512   # tokens per tile of the short conv (tile x channels stays in L2)


def causal_conv1d_fn(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    inplace: bool = False,
    **kwargs,
) -> torch.Tensor:
    """Depthwise causal conv along time, then the activation; same contract as transformers'
    `causal_conv1d_fn` (zero left context, output length = input length).

    hidden_states: [B, D, T] (any strides: transformers passes a transposed [B, T, D] buffer);
    weight: [D, W]; bias: [D] or None; activation: None, "silu" or "swish".
    -> [B, D, T] in hidden_states' dtype, with the same memory layout as the input when it is
    dense (a transposed view of a [B, T, D] buffer for the prefill path).

    `inplace=True` writes the result over `hidden_states` and returns it (tiles last to first, so
    every tile still reads unmodified inputs): no new sequence-sized buffer, whose first touch
    costs more than the conv on a VM. Only for callers that never read the input again;
    `nbcore.kernels.installed` decides that (transformers' GDN and Mamba-2 mixers, when the cache
    does not record past conv inputs)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d_fn (CPU): unsupported activation {activation!r}")
    if kwargs.get("seq_idx") is not None:
        raise ValueError("causal_conv1d_fn (CPU) does not support packed sequences (seq_idx)")
    _no_grad_check("causal_conv1d_fn", hidden_states, weight, bias)
    dtype = hidden_states.dtype
    x = hidden_states.transpose(1, 2)                     # [B, T, D]
    if x.dtype != weight.dtype:
        x, inplace = x.to(weight.dtype), False
    B, T, D = x.shape
    W = weight.shape[-1]
    w = weight.reshape(D, W).t().contiguous()             # [W, D]: tap j multiplies x[t - (W-1) + j]
    if inplace:
        # scratch tile in x's layout (time-major or channel-major), so every op streams both alike
        n = min(T, CONV_TILE)
        buf = torch.empty((B, D, n), dtype=x.dtype, device=x.device).transpose(1, 2) if x.stride(1) == 1 \
            else torch.empty((B, n, D), dtype=x.dtype, device=x.device)
        out = x
        starts = range((T - 1) // CONV_TILE * CONV_TILE, -1, -CONV_TILE)
    else:
        out, buf = torch.empty_like(x), None              # keeps x's layout when dense
        starts = range(0, T, CONV_TILE)
    for a in starts:
        b = min(T, a + CONV_TILE)
        o = out[:, a:b] if buf is None else buf[:, :b - a]
        if a >= W - 1:                                    # oldest tap first (the reference's order)
            torch.mul(x[:, a - (W - 1):b - (W - 1)], w[0], out=o)
            j0 = 1
        else:
            o.zero_()
            j0 = 0
        for j in range(j0, W):
            s = a - (W - 1) + j                           # input row feeding output row a
            lo = max(s, 0)                                # rows before 0 are the zero left padding
            hi = b - (W - 1) + j
            if lo < hi:
                o[:, lo - s:].addcmul_(x[:, lo:hi], w[j])
        if bias is not None:
            o.add_(bias.to(o.dtype))
        if activation is not None:
            F.silu(o, inplace=True)
        if buf is not None:
            out[:, a:b].copy_(o)
    out = out.transpose(1, 2)
    return out if out.dtype == dtype else out.to(dtype)
