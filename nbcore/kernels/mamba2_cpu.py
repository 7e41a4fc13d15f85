"""Faster CPU chunked scan for transformers' Mamba-2 (`mamba2_chunk_scan`, the SSD algorithm).

Same contract as transformers' pure-torch `mamba2_chunk_scan` (modeling_mamba2), same maths
(Mamba-2's state-space dual form), reorganised for a CPU:

* The reference carries the state between chunks with a [chunks x chunks] decay matrix and an
  einsum over it: quadratic in the number of chunks (at 64K tokens and chunk 128, 512^2 per head).
  Here the chunk-to-chunk carry is a loop of one fused multiply-add per chunk
  (``S_c = exp(sum a) S_{c-1} + states_c``), linear in length.
* Per chunk, everything else is batched matmuls on chunk-major fp32 copies made one segment (a
  couple of thousand tokens) at a time: ``C B^T`` once per B/C group (the reference repeats B and C
  to every head first), decays clamped at e^-80 before exp (x86 exp is ~40x slower on results
  that would be denormal), no sequence-sized temporaries.

Tolerance (fp32; tests/test_cpu_kernels.py, bench/prefill_cpu.py): output and final state agree
with the reference to max |diff| <= 1e-5 x max(1, max |reference|) at the test sizes; a whole
model's logits and states to <= 1e-4 x max(1, max |reference|) (tiny-mamba2-p5 at 16K tokens:
~1e-6 logits, ~3e-7 states, relative). Float rounding only: cumulative log decays are taken in
fp64 (their differences cancel; the reference's segment sums do not), and the internal chunk need
not be the caller's `chunk_size` (the result does not depend on it beyond rounding).

Shapes: B batch, T tokens, H heads, P head dim, G B/C groups (H a multiple of G), N state size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nbcore.kernels.gdn_cpu import _EXP_MIN, _chunked_f32, _gates_f32, _lower, _no_grad_check, _unchunk_into

__all__ = ["mamba2_chunk_scan", "CHUNK", "SEGMENT"]

CHUNK = 64        # internal chunk (tokens)
SEGMENT = 2048    # tokens per segment of the batched precompute


def _segment(x, a, Bm, Cm, S, r):
    """n chunks of L tokens. x: [n, B*H, L, P] (already times dt); a: [n, B*H, L] (A * dt, log decay);
    Bm, Cm: [n, B*G, L, N]; S: [B*H, P, N] carried state, updated in place; r = H // G.
    -> y [n, B*H, L, P] (without the D skip)."""
    n, BH, L, P = x.shape
    BG, N = Bm.shape[1], Bm.shape[-1]
    # Cumulative log decays in fp64: their differences cancel (|acs| reaches hundreds inside a
    # chunk), and fp32 there would cost ~1e-5 relative in every decay; the reference's segment
    # sums do not cancel. Only [n, BH, L(, L)] values: cheap.
    acs = a.double().cumsum(-1)                                          # [n, BH, L]
    last = acs[..., -1:]                                                 # [n, BH, 1]
    Dm = (acs[..., :, None] - acs[..., None, :]).clamp_(_EXP_MIN, 0.0).float().exp_().mul_(_lower(L, x.device))
    CB = torch.matmul(Cm, Bm.mT)                                         # [n, BG, L, L], per group
    M = Dm.view(n, BG, r, L, L).mul_(CB[:, :, None])                     # [n, BG, r, L, L]
    xg = x.view(n, BG, r, L, P)
    y = torch.matmul(M, xg)                                              # intra-chunk
    del Dm, M, CB
    # chunk states: sum_l exp(acs_last - acs_l) x_l B_l^T  -> [n, BG, r, P, N]
    xd = xg * (last - acs).clamp_(min=_EXP_MIN).float().exp_().view(n, BG, r, L, 1)
    st = torch.matmul(xd.mT, Bm[:, :, None])
    del xd
    gam = last.clamp(min=_EXP_MIN).float().exp_().view(n, BH, 1, 1)
    Sall = torch.empty((n + 1, BH, P, N), dtype=torch.float32, device=x.device)
    Sall[0].copy_(S)
    St, Gs, Ss = st.view(n, BH, P, N).unbind(0), gam.unbind(0), Sall.unbind(0)
    for c in range(n):
        torch.addcmul(St[c], Gs[c], Ss[c], out=Ss[c + 1])
    S.copy_(Ss[n])
    # inter-chunk: exp(acs_l) C_l S_prev^T
    yo = torch.matmul(Cm[:, :, None], Sall[:n].view(n, BG, r, P, N).mT)  # [n, BG, r, L, P]
    yo.mul_(acs.clamp(min=_EXP_MIN).float().exp_().view(n, BG, r, L, 1))
    return y.add_(yo).view(n, BH, L, P)


def mamba2_chunk_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int = CHUNK,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    segment: int | None = None,
    **kwargs,
):
    """Mamba-2 selective scan over a whole sequence, chunked; same contract as transformers'
    `mamba2_chunk_scan` (z is ignored, as there).

    hidden_states: [B, T, H, P]; dt: [B, T, H]; A: [H]; B, C: [B, T, G, N]; D, dt_bias: [H] or
    None; initial_states: [B, H, P, N] or None. `chunk_size` is accepted for compatibility; the
    internal chunk is CHUNK (the result is the same up to rounding).
    -> output [B, T, H, P] fp32, and the final state [B, H, P, N] fp32 if return_final_states."""
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        raise ValueError("mamba2_chunk_scan (CPU) does not support packed sequences")
    _no_grad_check("mamba2_chunk_scan", hidden_states, dt, A, B, C, D, dt_bias, initial_states)
    Bsz, T, H, P = hidden_states.shape
    G, N = B.shape[2], B.shape[3]
    r = H // G
    L = CHUNK
    seg = max(L, (int(segment or SEGMENT) // L) * L)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    dt = dt.float()
    a_all = A.float() * dt                                                # [B, T, H]
    S = torch.zeros((Bsz * H, P, N), dtype=torch.float32, device=hidden_states.device) if initial_states is None \
        else initial_states.to(device=hidden_states.device, dtype=torch.float32).reshape(Bsz * H, P, N).clone()
    out = torch.empty((Bsz, T, H, P), dtype=torch.float32, device=hidden_states.device)
    for s0 in range(0, T, seg):
        s1 = min(T, s0 + seg)
        x = _chunked_f32(hidden_states[:, s0:s1], H, L)                   # [n, B*H, L, P]
        d = _gates_f32(dt[:, s0:s1], L)                                   # [n, B*H, L]
        x.mul_(d[..., None])
        y = _segment(x, _gates_f32(a_all[:, s0:s1], L), _chunked_f32(B[:, s0:s1], G, L),
                     _chunked_f32(C[:, s0:s1], G, L), S, r)
        _unchunk_into(out[:, s0:s1], y)
    if D is not None:
        out.addcmul_(hidden_states, D.float()[:, None])
    if return_final_states:
        return out, S.view(Bsz, H, P, N)
    return out
