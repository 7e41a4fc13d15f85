"""Addressing (top-R): channel voting over native query features (paper Eq. 5, App. B.3).

s_i^{l,h} = max_tau cos(u_tau^{l,h}, rho_i^{l,h}); each channel votes for its argmax note;
top-R notes by votes, ties to the earlier-inserted note; replay in document order.
Both sides arrive as BF16 and are cast to FP32 and L2-normalised before matching.

Choice where the paper is silent: a note that receives no vote is never retrieved ("up to R").
"""
from __future__ import annotations

import numpy as np
import torch

from nbcore.notebank.features import l2_normalize


def native_votes_naive(u: torch.Tensor, addresses: torch.Tensor) -> torch.Tensor:
    """Reference Eq. 5 with explicit loops. u: [Q, J, d_rho]; addresses: [N, J, d_rho] -> votes [N]."""
    Q, J, _ = u.shape
    N = addresses.shape[0]
    votes = torch.zeros(N, dtype=torch.int64)
    for j in range(J):
        best_i, best_s = 0, -float("inf")
        for i in range(N):
            a = addresses[i, j].float()
            a = a / a.norm().clamp_min(1e-12)
            s = max(float((u[t, j].float() / u[t, j].float().norm().clamp_min(1e-12)) @ a) for t in range(Q))
            if s > best_s:                              # strict: ties stay with the earlier note
                best_i, best_s = i, s
        votes[best_i] += 1
    return votes


def normalized_keys(addresses: torch.Tensor) -> torch.Tensor:
    """[N, J, d] addresses -> [J, N, d] FP32 unit vectors (what Archive.routing_keys caches)."""
    return l2_normalize(addresses.float()).transpose(0, 1).contiguous()


def channel_scores(u: torch.Tensor, keys: torch.Tensor, note_block: int = 1024) -> torch.Tensor:
    """s: [J, N] = max over question tokens of cosine similarity.

    u: [Q, J, d_rho] question features (bf16/fp32); keys: [J, N, d_rho] normalised FP32 addresses.
    Notes are matched in blocks so the [J, block, Q] similarity tile stays cache-sized."""
    uh = l2_normalize(u.float()).permute(1, 2, 0).contiguous()             # [J, d, Q]
    J, N, _ = keys.shape
    out = torch.empty(J, N, dtype=torch.float32)
    for n0 in range(0, N, note_block):
        torch.amax(torch.bmm(keys[:, n0:n0 + note_block], uh), dim=2, out=out[:, n0:n0 + note_block])
    return out


def slot_scores(u: torch.Tensor, keys: torch.Tensor, m: int = 1) -> torch.Tensor:
    """s: [J, N] with m address slots per channel: max over slots and question tokens.
    u: [Q, J, d]; keys: [J*m, N, d] (channel-major slots)."""
    if m == 1:
        return channel_scores(u, keys)
    s = channel_scores(u.repeat_interleave(m, dim=1), keys)                 # [J*m, N]
    return s.view(-1, m, s.shape[1]).amax(dim=1)


def channel_winners(u: torch.Tensor, keys: torch.Tensor, m: int = 1) -> torch.Tensor:
    """Eq. 5's per-channel choice: winners [J] (int64) = the note each channel votes for,
    the earlier-inserted note on ties. u: [Q, J, d]; keys: [J*m, N, d] with N >= 1."""
    return slot_scores(u, keys, m).argmax(dim=1)                             # first max on ties


def native_votes(u: torch.Tensor, addresses: torch.Tensor | None = None, keys: torch.Tensor | None = None,
                 m: int = 1) -> torch.Tensor:
    """Vectorised Eq. 5 -> votes [N] (int64). Pass `keys` (Archive.routing_keys()) to skip
    re-normalising the archive for every question."""
    if keys is None:
        keys = normalized_keys(addresses)
    N = keys.shape[1]
    if N == 0:
        return torch.zeros(0, dtype=torch.int64)
    return torch.bincount(channel_winners(u, keys, m), minlength=N)


def margin_votes(u: torch.Tensor, keys: torch.Tensor, m: int = 1) -> torch.Tensor:
    """Variant beyond the paper: each channel's vote weighs (best - second best) score, so channels that
    cannot tell near-identical notes apart (template matches, repeated haystack) add ~nothing."""
    s = slot_scores(u, keys, m)                                               # [J, N]
    N = s.shape[1]
    if N == 0:
        return torch.zeros(0, dtype=torch.float64)
    if N == 1:
        return torch.ones(1, dtype=torch.float64)
    top = torch.topk(s, 2, dim=1)                                            # values [J, 2]
    winners = s.argmax(dim=1)                                                # first max on ties
    # + 1e-6: a channel whose best notes tie still casts a (negligible) vote, so some note is
    # always retrieved and exact ties fall back to the paper's count-then-earlier rule.
    w = (top.values[:, 0] - top.values[:, 1]).double() + 1e-6
    return torch.zeros(N, dtype=torch.float64).scatter_add_(0, winners, w)


def sum_scores(u: torch.Tensor, keys: torch.Tensor, m: int = 1) -> torch.Tensor:
    """Variant beyond the paper: soft voting, score_i = sum_j s_i^j (late interaction over channels),
    shifted by J + 1 so every note scores > 0."""
    s = slot_scores(u, keys, m)
    return s.sum(dim=0).double() + s.shape[0] + 1.0


def top_r(scores: torch.Tensor | np.ndarray, r: int, starts: np.ndarray) -> list[int]:
    """Up to R notes with the highest score (> 0), ties to the earlier-inserted note;
    returned in document order (by start position, then insertion)."""
    s = np.asarray(scores.cpu().numpy() if isinstance(scores, torch.Tensor) else scores, dtype=np.float64)
    order = np.lexsort((np.arange(len(s)), -s))          # by -score, then insertion index
    chosen = [int(i) for i in order[:r] if s[i] > 0]
    return sorted(chosen, key=lambda i: (int(starts[i]), i))
