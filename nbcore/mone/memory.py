"""MoNe fast-weight memory (arXiv 2608.17616, Sec. 2.2-2.3): a per-layer, multi-head SwiGLU MLP

    M(x; W) = W_out^T (SiLU(W_in x) * (W_gate x))        (per head; W_in, W_gate, W_out: [F, D])

and its test-time write rule. Pure torch, no transformers here.

Shapes: fast weights carry a leading batch dim ``B`` (one document per row) and a head dim ``H``:
``w_in, w_gate, w_out: [B, H, F, D]``; tokens are ``[B, T, H, D]``.

Write rule for one segment of T tokens (keys k, values v already featurised by the caller):

    l_j   = - v_j^T M(k_j; W_{s-1})                       (associative inner-product loss)
    G_s   = sum_j omega_j * grad_W l_j,  omega_j = eta_j * valid_j / T_valid
            (the segment loss L = (1/T) sum_j l_j, each token's term scaled by its learned rate eta_j)
    mu_s  = beta_s * mu_{s-1} + G_s                        (momentum, content-dependent decay)
    W_s   = renorm(W_{s-1} - mu_s)                         (each channel = row of each matrix over D
                                                            rescaled to L2 norm ``rho``)

The gradient is the hand-derived closed form (``swiglu_grads``); tests compare it with autograd.
Every quantity is a differentiable torch expression of (k, v, eta, beta), so meta-training
back-propagates through the whole write chain without ``create_graph``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

WEIGHTS = ("w_in", "w_gate", "w_out")
MOMENTA = ("m_in", "m_gate", "m_out")


@dataclass
class FastWeights:
    """One layer's fast-weight state: three weight tensors and their momenta, [B, H, F, D]."""
    w_in: torch.Tensor
    w_gate: torch.Tensor
    w_out: torch.Tensor
    m_in: torch.Tensor
    m_gate: torch.Tensor
    m_out: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in WEIGHTS + MOMENTA}

    def clone(self) -> "FastWeights":
        return FastWeights(**{k: v.clone() for k, v in self.tensors().items()})

    def detach(self) -> "FastWeights":
        return FastWeights(**{k: v.detach() for k, v in self.tensors().items()})


def renorm_rows(w: torch.Tensor, rho: float, eps: float = 1e-6) -> torch.Tensor:
    """Channel-wise L2 re-normalisation: every row (over the last dim D) gets norm ``rho``."""
    return w * (rho / w.norm(dim=-1, keepdim=True).clamp_min(eps))


def init_weights(heads: int, ffn: int, dim: int, rho: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """W_0: seeded Gaussian rows rescaled to norm ``rho`` ([H, F, D] each; not meta-trained)."""
    g = torch.Generator().manual_seed(seed)
    return {k: renorm_rows(torch.randn(heads, ffn, dim, generator=g), rho) for k in WEIGHTS}


def fresh_state(w0: dict[str, torch.Tensor], batch: int = 1) -> FastWeights:
    """State before any segment: W = W_0, momentum 0 (a copy per batch row)."""
    w = {k: w0[k].unsqueeze(0).expand(batch, *w0[k].shape).clone() for k in WEIGHTS}
    m = {mk: torch.zeros_like(w[wk]) for mk, wk in zip(MOMENTA, WEIGHTS)}
    return FastWeights(**w, **m)


def swiglu_forward(x: torch.Tensor, w_in, w_gate, w_out) -> torch.Tensor:
    """M(x; W) per head. x [B, T, H, D] -> [B, T, H, D]."""
    a = torch.einsum("bthd,bhfd->bthf", x, w_in)
    g = torch.einsum("bthd,bhfd->bthf", x, w_gate)
    return torch.einsum("bthf,bhfd->bthd", F.silu(a) * g, w_out)


def assoc_loss(k, v, omega, w_in, w_gate, w_out) -> torch.Tensor:
    """sum_{b,t,h} omega * (-v^T M(k)) -- the weighted segment loss (for autograd checks)."""
    out = swiglu_forward(k, w_in, w_gate, w_out)
    return -(omega * (v * out).sum(-1)).sum()


def swiglu_grads(k, v, omega, w_in, w_gate, w_out) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form gradient of ``assoc_loss`` w.r.t. (w_in, w_gate, w_out), each [B, H, F, D].

    With a = W_in k, g = W_gate k, u = SiLU(a) * g, l = -v^T W_out^T u = -u^T (W_out v):
      dl/dW_out  = -u v^T
      dl/du      = -W_out v =: du
      dl/dW_gate = (du * SiLU(a)) k^T
      dl/dW_in   = (du * g * SiLU'(a)) k^T,   SiLU'(a) = s (1 + a (1 - s)),  s = sigmoid(a)
    summed over tokens with weights omega [B, T, H].
    """
    a = torch.einsum("bthd,bhfd->bthf", k, w_in)
    g = torch.einsum("bthd,bhfd->bthf", k, w_gate)
    s = torch.sigmoid(a)
    silu_a = a * s
    u = silu_a * g
    du = -torch.einsum("bthd,bhfd->bthf", v, w_out)
    om = omega.unsqueeze(-1)
    g_out = -torch.einsum("bthf,bthd->bhfd", om * u, v)
    g_gate = torch.einsum("bthf,bthd->bhfd", om * du * silu_a, k)
    g_in = torch.einsum("bthf,bthd->bhfd", om * du * g * (s * (1 + a * (1 - s))), k)
    return g_in, g_gate, g_out


def write_segment(state: FastWeights, k, v, eta, beta, mask, rho: float) -> FastWeights:
    """One MoNe update W_{s-1} -> W_s.

    k, v: [B, T, H, D] featurised keys/values; eta: [B, T, H] per-token rates (> 0);
    beta: [B, H] momentum decay in (0, 1); mask: [B, T] valid tokens (rows whose segment is
    entirely padding keep their state unchanged).
    """
    m = mask.to(k.dtype)
    n_valid = m.sum(1)  # [B]
    omega = eta * (m / n_valid.clamp_min(1).unsqueeze(1)).unsqueeze(-1)
    grads = swiglu_grads(k, v, omega, state.w_in, state.w_gate, state.w_out)
    keep = (n_valid == 0).view(-1, 1, 1, 1)
    bt = beta.unsqueeze(-1).unsqueeze(-1)  # [B, H, 1, 1]
    new = {}
    for wk, mk, gr in zip(WEIGHTS, MOMENTA, grads):
        w_old, m_old = getattr(state, wk), getattr(state, mk)
        mom = bt * m_old + gr
        w_new = renorm_rows(w_old - mom, rho)
        new[mk] = torch.where(keep, m_old, mom)
        new[wk] = torch.where(keep, w_old, w_new)
    return FastWeights(**new)


# ------------------------------------------------------------------------------------------------
# feature maps and segment-local RoPE (on the memory's own head dim D)

def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float = 10000.0):
    """cos/sin tables [T, 1, D] for positions [T] (rotate-half convention)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos()[:, None, :], emb.sin()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]."""
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


def key_features(k: torch.Tensor, positions: torch.Tensor | None, theta: float) -> torch.Tensor:
    """SiLU -> per-token (per-head) L2 norm -> RoPE at ``positions`` (None: no RoPE)."""
    k = l2norm(F.silu(k))
    if positions is not None:
        cos, sin = rope_cos_sin(positions, k.shape[-1], theta)
        k = apply_rope(k, cos, sin)
    return k


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def inv_softplus(y: float) -> float:
    return y + math.log(-math.expm1(-y))


def logit(p: float) -> float:
    return math.log(p / (1 - p))


# ------------------------------------------------------------------------------------------------
# analytic FLOP counts (matmul multiply-adds x 2), used to cross-check FlopCounterMode

def write_flops_per_token(heads: int, ffn: int, dim: int) -> int:
    """a, g, du (3 matvecs) + 3 outer-product accumulations, per token, all heads."""
    return heads * 6 * 2 * ffn * dim


def read_flops_per_token(heads: int, ffn: int, dim: int) -> int:
    """a, g, out (3 matvecs) per query token, all heads."""
    return heads * 3 * 2 * ffn * dim
