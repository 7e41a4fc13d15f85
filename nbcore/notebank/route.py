"""Addressing (top-R): channel voting over native query features (paper Eq. 5, App. B.3).

s_i^{l,h} = max_tau cos(u_tau^{l,h}, rho_i^{l,h}); each channel votes for its argmax note;
top-R notes by votes, ties to the earlier-inserted note; replay in document order.
Both sides arrive as BF16 and are cast to FP32 and L2-normalised before matching.

Choice where the paper is silent: a note that receives no vote is never retrieved ("up to R").

Kernels, fast path and naive path side by side (pure tensor functions, same contracts):
  channel_scores        s [J, N], tiled over channels and notes; the max over question tokens (and
                        address slots) is taken per tile, so no more than one cache-sized
                        [Jt*m, Q, Nt] FP32 tile of similarities exists (never [J, Q, N]). Every bmm
                        has the same shape, so duplicated notes score bitwise alike (tie rule).
  channel_scores_naive  the previous implementation: a [J*m, 1024, Q] block per 1024 notes, then
                        amax; the reference for scores and the benchmark baseline.
  channel_winners       per-channel argmax. On CPUs with AVX512-BF16 and large problems: a BF16
                        proxy of s (approx_scores_bf16, ~2x the FP32 rate) picks the few notes that
                        can be the maximum, which are rescored in FP32; provably the FP32 argmax.
  native_votes_naive    the explicit-loop reference of the votes (Eq. 5, ties included).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from nbcore.notebank.features import l2_normalize

# Similarity-tile budget in elements. CPU: ~1 MiB of FP32 per intra-op thread, so each core's share
# of the tile stays in its L2 while amax re-reads it. GPU: large tiles (launch count, not cache, matters).
CPU_TILE_PER_THREAD = 1 << 18
GPU_TILE = 1 << 26
CPU_NOTE_TILE = 256                  # notes per CPU tile (a multiple of the SIMD width); Jt fills the rest
PREFILTER_TILE = (1 << 20, 512)      # BF16 proxy tile on CPU: elements per thread, notes (measured best)

# BF16 prefilter for the per-channel winners (CPU with AVX512-BF16 only, see channel_winners).
# |bf16 score - fp32 score| <= 2^-7 (input rounding) + 2^-7 (output rounding, even if truncated)
# + ~1e-6 (FP32 accumulation) < 0.016 for unit vectors: PREFILTER_EPS leaves a ~2x margin.
PREFILTER_EPS = 0.03
PREFILTER_MIN_WORK = 1 << 23         # J*m*Q*N below this (N < ~700 at J=192, Q=64): FP32 alone is as fast
CANDIDATE_CAP = 256                  # more near-max notes than this in a channel: FP32 for that channel

Scorer = Callable[..., torch.Tensor]


def _check(u: torch.Tensor, keys: torch.Tensor, m: int) -> tuple[int, int, int, int]:
    if u.dim() != 3 or keys.dim() != 3:
        raise ValueError(f"u must be [Q, J, d] and keys [J*m, N, d]; got {tuple(u.shape)}, {tuple(keys.shape)}")
    Q, J, d = u.shape
    if keys.shape[0] != J * m or keys.shape[2] != d:
        raise ValueError(f"keys {tuple(keys.shape)} do not match u {tuple(u.shape)} with m={m} slots")
    if Q == 0:
        raise ValueError("no question tokens: the max over tau is undefined")
    return Q, J, d, keys.shape[1]


def tile_shape(J: int, Q: int, N: int, m: int = 1, device: torch.device | str = "cpu",
               per_thread: int | None = None, note_tile: int | None = None) -> tuple[int, int]:
    """(channels, notes) per tile so that the [Jt*m, Q, Nt] similarity tile fits the budget
    (on CPU: per_thread elements per intra-op thread, note_tile notes; defaults for FP32)."""
    if torch.device(device).type == "cpu":
        budget = (per_thread or CPU_TILE_PER_THREAD) * max(1, torch.get_num_threads())
        nt = note_tile or CPU_NOTE_TILE
    else:
        budget = GPU_TILE
        nt = max(1, budget // max(1, J * m * Q))
    nt = max(1, min(N, nt, budget // (m * Q)))
    if nt >= 16:
        nt -= nt % 16
    jt = max(1, min(J, budget // (m * Q * nt)))
    return jt, nt


def _starts(n: int, tile: int) -> list[int]:
    """Tile starts covering [0, n) with full tiles only (tile <= n): the last one ends exactly at n."""
    return list(range(0, n - tile, tile)) + [n - tile]


def channel_scores(u: torch.Tensor, keys: torch.Tensor, note_block: int | None = None, *,
                   chan_block: int | None = None, m: int = 1) -> torch.Tensor:
    """Fast tiled scorer. s: [J, N] FP32 = max over address slots and question tokens of the cosine.

    u: [Q, J, d] question features (any float dtype; L2-normalised here in FP32);
    keys: [J*m, N, d] normalised addresses (Archive.routing_keys / normalized_keys; slot-minor,
    i.e. row j*m + s is channel j's slot s), on the device the work runs on.
    Per tile: bmm [Jt*m, Q, d] @ [Jt*m, d, Nt] -> [Jt*m, Q, Nt] (FP32 products and accumulation)
    into a reused buffer, then one amax over the contiguous (slot, token) axis -> out[j-tile, n-tile].
    note_block / chan_block override the tile (tests use tiny tiles to exercise the edges)."""
    Q, J, d, N = _check(u, keys, m)
    dev = keys.device
    out = torch.empty(J, N, dtype=torch.float32, device=dev)
    if N == 0 or J == 0:
        return out
    keys = keys.float()
    jt, nt = tile_shape(J, Q, N, m, dev)
    jt, nt = min(J, chan_block or jt), min(N, note_block or nt)
    uq = l2_normalize(u.to(dev)).transpose(0, 1)                                    # [J, Q, d]
    uq = (uq.repeat_interleave(m, dim=0) if m > 1 else uq).contiguous()             # [J*m, Q, d]
    kt = keys.transpose(1, 2)                                                       # [J*m, d, N] (view)
    t = torch.empty(jt * m, Q, nt, dtype=torch.float32, device=dev)                 # the only tile
    tv = t.view(jt, m * Q, nt)
    # Every bmm has the same shape: the last tile of each axis is shifted back to end at J / N
    # (overlapping its neighbour) instead of being shorter. A shorter call can take another BLAS
    # path (e.g. GEMV for one note) and round a duplicated note differently, which would break
    # the tie rule; within one fixed-shape call every column is computed alike.
    for j0 in _starts(J, jt):
        uj, kj, oj = uq[j0 * m:(j0 + jt) * m], kt[j0 * m:(j0 + jt) * m], out[j0:j0 + jt]
        for n0 in _starts(N, nt):
            torch.bmm(uj, kj[:, :, n0:n0 + nt], out=t)
            torch.amax(tv, dim=1, out=oj[:, n0:n0 + nt])
    return out


def bf16_prefilter_available(device: torch.device | str = "cpu") -> bool:
    """The BF16 prefilter runs where torch's BF16 bmm is oneDNN's AVX512-BF16 kernel (FP32 accumulation)."""
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())


def approx_scores_bf16(u: torch.Tensor, keys: torch.Tensor, m: int = 1, note_block: int | None = None,
                       chan_block: int | None = None, *, unit: bool = False) -> torch.Tensor:
    """Cheap proxy of channel_scores for the prefilter. -> [J, N] BF16 (CPU).

    u: [Q, J, d]; keys: [J*m, N, d] unit rows. Same tiling as channel_scores, but the products run
    in BF16 (FP32 accumulation, BF16 output; ~2x the FP32 rate) and the max over (slot, token) is
    taken on the BF16 bit patterns as int16 (a vectorised integer max; torch's BF16 amax is slow).
    Contract, for unit vectors: where a note's BF16 maximum is >= 0 the result is that maximum, within
    PREFILTER_EPS of the FP32 score; otherwise the result is negative (and meaningless) and the FP32
    score is below PREFILTER_EPS. unit=True: u is already l2_normalize(u) (FP32)."""
    Q, J, d, N = _check(u, keys, m)
    out = torch.empty(J, N, dtype=torch.int16)
    if N == 0 or J == 0:
        return out.view(torch.bfloat16)
    jt, nt = tile_shape(J, Q, N, m, "cpu", *PREFILTER_TILE)
    jt, nt = min(J, chan_block or jt), min(N, note_block or nt)
    uq = (u.cpu() if unit else l2_normalize(u.cpu())).transpose(0, 1)               # [J, Q, d]
    uq = (uq.repeat_interleave(m, dim=0) if m > 1 else uq).to(torch.bfloat16).contiguous()
    kb = torch.empty(jt * m, nt, d, dtype=torch.bfloat16)                          # keys tile, in cache
    t = torch.empty(jt * m, Q, nt, dtype=torch.bfloat16)
    ti = t.view(torch.int16).view(jt, m * Q, nt)
    for j0 in _starts(J, jt):                                                       # fixed shapes, as above
        uj, kj, oj = uq[j0 * m:(j0 + jt) * m], keys[j0 * m:(j0 + jt) * m], out[j0:j0 + jt]
        for n0 in _starts(N, nt):
            kb.copy_(kj[:, n0:n0 + nt])
            torch.bmm(uj, kb.transpose(1, 2), out=t)
            # non-negative BF16 values order like their int16 bit patterns; negative ones all sort
            # below them (reversed among themselves), hence the contract above
            torch.amax(ti, dim=1, out=oj[:, n0:n0 + nt])
    return out.view(torch.bfloat16)


def _winners_prefiltered(u: torch.Tensor, keys: torch.Tensor, m: int) -> torch.Tensor:
    """channel_winners via the BF16 prefilter; exactly the FP32 argmax (first max on ties).
    u: [Q, J, d]; keys: [J*m, N, d] unit rows (CPU) -> winners [J] int64.

    Where the proxy maximum p* >= 2 eps, the best FP32 score exceeds eps, so every note reaching it
    has a BF16 maximum >= 0 and a proxy > p* - 2 eps: only those candidates are rescored, in FP32,
    in one bmm (in note order, so argmax keeps the earliest of exact ties). Channels with p* < 2 eps
    or more than CANDIDATE_CAP candidates are scored by channel_scores instead."""
    Q, J, d, N = _check(u, keys, m)
    keys = keys.float().contiguous()
    un = l2_normalize(u.cpu())                                                       # [Q, J, d] FP32 unit
    a = approx_scores_bf16(un, keys, m, unit=True).float()                          # [J, N]
    amax = a.amax(dim=1)
    thr = amax - 2 * PREFILTER_EPS
    jj, ii = (a >= thr[:, None]).nonzero(as_tuple=True)                             # row-major: notes ascend
    cnt = torch.bincount(jj, minlength=J)
    ok = (amax >= 2 * PREFILTER_EPS) & (cnt <= CANDIDATE_CAP)
    winners = torch.empty(J, dtype=torch.int64)
    jo = ok.nonzero().squeeze(1)
    if len(jo):
        if len(jo) < J:
            keep = ok[jj]
            jj, ii = jj[keep], ii[keep]
        co = cnt[jo]
        row = torch.empty(J, dtype=torch.int64)
        row[jo] = torch.arange(len(jo))
        r = row[jj]                                                                  # compact channel row
        start = torch.cumsum(co, 0) - co
        pos = torch.arange(len(ii)) - start[r]
        # [Jo, C] candidates in note order, padded with the row's first candidate (a padded copy
        # equals a real entry, so the first max is never a pad)
        idx = ii[start][:, None].repeat(1, int(co.max()))
        idx[r, pos] = ii
        C = idx.shape[1]
        rows = (jo[:, None] * m + torch.arange(m)).reshape(-1)                       # [Jo*m] key rows
        flat = (rows[:, None] * N + idx.repeat_interleave(m, dim=0)).reshape(-1)
        g = keys.view(-1, d)[flat].view(len(jo) * m, C, d)                          # candidate keys
        uh = un.permute(1, 2, 0)                                                     # [J, d, Q]
        uh = uh[jo] if len(jo) < J else uh
        uh = (uh.repeat_interleave(m, dim=0) if m > 1 else uh).contiguous()         # [Jo*m, d, Q]
        # candidates as rows (C is small: the [C, d] @ [d, Q] orientation is ~4x faster here)
        ex = torch.bmm(g, uh).view(len(jo), m, C, Q).amax(dim=(1, 3))               # [Jo, C] FP32
        winners[jo] = idx.gather(1, ex.argmax(dim=1, keepdim=True)).squeeze(1)
    jb = (~ok).nonzero().squeeze(1)
    if len(jb):
        rows = (jb[:, None] * m + torch.arange(m)).reshape(-1)
        winners[jb] = channel_scores(u[:, jb], keys[rows], m=m).argmax(dim=1)
    return winners


def channel_scores_naive(u: torch.Tensor, keys: torch.Tensor, note_block: int = 1024, *, m: int = 1) -> torch.Tensor:
    """Reference scorer (the previous implementation): s: [J, N] FP32, same contract as channel_scores.
    u: [Q, J, d]; keys: [J*m, N, d]. Builds a [J*m, Nb, Q] block over all channels per 1024 notes."""
    Q, J, d, N = _check(u, keys, m)
    uh = l2_normalize(u.to(keys.device)).permute(1, 2, 0).contiguous()              # [J, d, Q]
    if m > 1:
        uh = uh.repeat_interleave(m, dim=0)                                         # [J*m, d, Q]
    out = torch.empty(J * m, N, dtype=torch.float32, device=keys.device)
    for n0 in range(0, N, note_block):
        torch.amax(torch.bmm(keys[:, n0:n0 + note_block].float(), uh), dim=2, out=out[:, n0:n0 + note_block])
    return out.view(J, m, N).amax(dim=1) if m > 1 else out


def native_votes_naive(u: torch.Tensor, addresses: torch.Tensor, m: int = 1) -> torch.Tensor:
    """Reference Eq. 5 with explicit loops. u: [Q, J, d_rho]; addresses: [N, J*m, d_rho] (m slots per
    channel, slot-minor) -> votes [N] (int64, CPU). Ties stay with the earlier note (strict >)."""
    Q, J, _ = u.shape
    N = addresses.shape[0]
    votes = torch.zeros(N, dtype=torch.int64)
    if N == 0:
        return votes
    for j in range(J):
        uj = [u[t, j].float() / u[t, j].float().norm().clamp_min(1e-12) for t in range(Q)]
        best_i, best_s = 0, -float("inf")
        for i in range(N):
            s = -float("inf")
            for r in range(m):
                a = addresses[i, j * m + r].float()
                a = a / a.norm().clamp_min(1e-12)
                s = max(s, max(float(x @ a) for x in uj))
            if s > best_s:                              # strict: ties stay with the earlier note
                best_i, best_s = i, s
        votes[best_i] += 1
    return votes


def normalized_keys(addresses: torch.Tensor) -> torch.Tensor:
    """[N, J, d] addresses -> [J, N, d] FP32 unit vectors (what Archive.routing_keys caches).
    Bitwise equal to l2_normalize(addresses.float()).transpose(0, 1).contiguous(), computed in
    cache-sized channel slabs with one transposing cast per slab (~2.5x faster on CPU)."""
    N, J, d = addresses.shape
    out = torch.empty(J, N, d, dtype=torch.float32, device=addresses.device)
    jc = max(1, (1 << 19) // max(1, N * d)) if addresses.device.type == "cpu" else max(J, 1)
    for j0 in range(0, J, jc):
        o = out[j0:j0 + jc]
        o.copy_(addresses[:, j0:j0 + jc].transpose(0, 1))
        o.div_(o.norm(dim=-1, keepdim=True).clamp_min_(1e-12))
    return out


def slot_scores(u: torch.Tensor, keys: torch.Tensor, m: int = 1, scorer: Scorer | None = None) -> torch.Tensor:
    """s: [J, N] with m address slots per channel: max over slots and question tokens.
    u: [Q, J, d]; keys: [J*m, N, d] (channel-major slots). scorer: channel_scores (default) or
    channel_scores_naive."""
    return (scorer or channel_scores)(u, keys, m=m)


def channel_winners(u: torch.Tensor, keys: torch.Tensor, m: int = 1, scorer: Scorer | None = None,
                    prefilter: bool | None = None) -> torch.Tensor:
    """Eq. 5's per-channel choice: winners [J] (int64) = the note each channel votes for,
    the earlier-inserted note on ties. u: [Q, J, d]; keys: [J*m, N, d] unit rows, N >= 1.
    prefilter (default: where available and the problem is large): BF16 candidates + FP32 rescoring,
    the same winners as the FP32 argmax; ignored when a scorer is given."""
    if scorer is None and keys.shape[1] > 1:
        Q, J, _, N = _check(u, keys, m)
        if prefilter is None:
            prefilter = J * m * Q * N >= PREFILTER_MIN_WORK
        if prefilter and bf16_prefilter_available(keys.device):
            return _winners_prefiltered(u, keys, m)
    return slot_scores(u, keys, m, scorer).argmax(dim=1)                     # first max on ties


def native_votes(u: torch.Tensor, addresses: torch.Tensor | None = None, keys: torch.Tensor | None = None,
                 m: int = 1, scorer: Scorer | None = None, prefilter: bool | None = None) -> torch.Tensor:
    """Vectorised Eq. 5 -> votes [N] (int64, on the keys' device). Pass `keys` (Archive.routing_keys())
    to skip re-normalising the archive for every question. u: [Q, J, d]; addresses: [N, J*m, d]."""
    if keys is None:
        keys = normalized_keys(addresses)
    N = keys.shape[1]
    if N == 0:
        return torch.zeros(0, dtype=torch.int64, device=keys.device)
    return torch.bincount(channel_winners(u, keys, m, scorer, prefilter), minlength=N)


def margin_votes(u: torch.Tensor, keys: torch.Tensor, m: int = 1, scorer: Scorer | None = None) -> torch.Tensor:
    """Variant beyond the paper: each channel's vote weighs (best - second best) score, so channels that
    cannot tell near-identical notes apart (template matches, repeated haystack) add ~nothing.
    u: [Q, J, d]; keys: [J*m, N, d] -> [N] float64."""
    s = slot_scores(u, keys, m, scorer)                                       # [J, N]
    N = s.shape[1]
    if N == 0:
        return torch.zeros(0, dtype=torch.float64, device=s.device)
    if N == 1:
        return torch.ones(1, dtype=torch.float64, device=s.device)
    top = torch.topk(s, 2, dim=1)                                            # values [J, 2]
    winners = s.argmax(dim=1)                                                # first max on ties
    # + 1e-6: a channel whose best notes tie still casts a (negligible) vote, so some note is
    # always retrieved and exact ties fall back to the paper's count-then-earlier rule.
    w = (top.values[:, 0] - top.values[:, 1]).double() + 1e-6
    return torch.zeros(N, dtype=torch.float64, device=s.device).scatter_add_(0, winners, w)


def sum_scores(u: torch.Tensor, keys: torch.Tensor, m: int = 1, scorer: Scorer | None = None) -> torch.Tensor:
    """Variant beyond the paper: soft voting, score_i = sum_j s_i^j (late interaction over channels),
    shifted by J + 1 so every note scores > 0. u: [Q, J, d]; keys: [J*m, N, d] -> [N] float64."""
    s = slot_scores(u, keys, m, scorer)
    return s.sum(dim=0).double() + s.shape[0] + 1.0


def top_r(scores: torch.Tensor | np.ndarray, r: int, starts: np.ndarray) -> list[int]:
    """Up to R notes with the highest score (> 0), ties to the earlier-inserted note;
    returned in document order (by start position, then insertion)."""
    s = np.asarray(scores.cpu().numpy() if isinstance(scores, torch.Tensor) else scores, dtype=np.float64)
    order = np.lexsort((np.arange(len(s)), -s))          # by -score, then insertion index
    chosen = [int(i) for i in order[:r] if s[i] > 0]
    return sorted(chosen, key=lambda i: (int(starts[i]), i))
