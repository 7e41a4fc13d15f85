"""Native-feature reductions used by the writer and router (paper Eqs. 3, 8, 9).

Pure tensor functions. Layout: features are [T, H, d] per layer or [T, J, d] over all channels.
The fast path (`ChunkReducer`) reduces each layer's q/k as the backbone produces them, so a
forward over a large block never keeps O(T·J·d) tensors; `reference_features` is the naive
whole-tensor version it is tested against.
"""
from __future__ import annotations

import torch

from nbcore.backbones.base import FeatureTap


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """x / ||x||_2 over the last dim (fp32)."""
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


def chunk_distinctiveness(k: torch.Tensor, chunk_size: int, offset: int = 0) -> torch.Tensor:
    """Per-channel native-key distinctiveness (Eqs. 3, 8).

    k: [T, H, d] keys of consecutive tokens whose first token sits at document position `offset`.
    Chunks are the document's C-token chunks [cC, (c+1)C); `offset` must be a multiple of C
    (the last group may be partial: it belongs to an incomplete chunk that never writes).
    Returns d: [T, H] with d_t = 1 - <k̂_t, normalize(mean_{s in chunk(t)} k̂_s)>.
    """
    if offset % chunk_size:
        raise ValueError(f"feature block must start on a chunk boundary (offset {offset}, C={chunk_size})")
    T, H, D = k.shape
    kh = l2_normalize(k)                                   # [T, H, d]
    n_full = T // chunk_size
    out = torch.empty(T, H, dtype=torch.float32, device=k.device)
    if n_full:
        blocks = kh[: n_full * chunk_size].reshape(n_full, chunk_size, H, D)  # [n, C, H, d]
        mu = l2_normalize(blocks.mean(dim=1))              # [n, H, d]
        out[: n_full * chunk_size] = (1.0 - torch.einsum("nchd,nhd->nch", blocks, mu)).reshape(-1, H)
    rest = kh[n_full * chunk_size:]
    if rest.shape[0]:
        mu = l2_normalize(rest.mean(dim=0))                # [H, d]
        out[n_full * chunk_size:] = 1.0 - torch.einsum("thd,hd->th", rest, mu)
    return out


def compact(q: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """Fixed coordinate selection P (Eq. 9).

    q: [T, H, d]; coords: [H, d_rho] (int64, distinct per row) -> [T, H, d_rho] = P_h q_{t,h}."""
    idx = coords.to(q.device).unsqueeze(0).expand(q.shape[0], -1, -1)  # [T, H, d_rho]
    return torch.gather(q.float(), 2, idx)


def projection_coords(n_channels: int, key_dim: int, addr_dim: int, seed: int) -> torch.Tensor:
    """P for every channel: [J, d_rho] distinct coordinates in [0, key_dim), an ordered random
    selection drawn independently per channel from a fixed seed (App. B.3)."""
    if addr_dim > key_dim:
        raise ValueError(f"addr_dim (d_rho={addr_dim}) cannot exceed the native query dim d_k={key_dim}")
    g = torch.Generator().manual_seed(int(seed))
    return torch.stack([torch.randperm(key_dim, generator=g)[:addr_dim] for _ in range(n_channels)])


class ChunkReducer(FeatureTap):
    """Reduces each layer's features on the fly to what NoteBank keeps:
    per-channel distinctiveness [T, H] (if chunk_size) and compacted queries [T, H, d_rho].

    `offset` is the document position of the first token of this forward call."""

    def __init__(self, coords: torch.Tensor, heads_per_layer: int, chunk_size: int | None, offset: int = 0):
        self.coords = coords                     # [J, d_rho]
        self.H = heads_per_layer
        self.chunk_size = chunk_size
        self.offset = offset
        self.dist: dict[int, list[torch.Tensor]] = {}
        self.qc: dict[int, list[torch.Tensor]] = {}
        self._pos: dict[int, int] = {}           # tokens already seen per layer in this call

    def on_layer(self, rec_idx, q, k):
        pos = self._pos.get(rec_idx, 0)
        self._pos[rec_idx] = pos + q.shape[0]
        coords = self.coords[rec_idx * self.H:(rec_idx + 1) * self.H]
        self.qc.setdefault(rec_idx, []).append(compact(q, coords).to(torch.bfloat16))
        if self.chunk_size:
            self.dist.setdefault(rec_idx, []).append(chunk_distinctiveness(k, self.chunk_size, self.offset + pos))

    def result(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """-> (dist [T, J] fp32 or None, qc [T, J, d_rho] bf16)."""
        layers = sorted(self.qc)
        qc = torch.cat([torch.cat(self.qc[i], 0) for i in layers], dim=1)
        dist = None
        if self.chunk_size:
            dist = torch.cat([torch.cat(self.dist[i], 0) for i in layers], dim=1)
        return dist, qc


def reference_features(q: torch.Tensor, k: torch.Tensor, coords: torch.Tensor, chunk_size: int):
    """Naive reference of ChunkReducer over full features q, k: [T, J, d] of a whole document:
    loops over chunks and channels explicitly. -> (dist [T, J], qc [T, J, d_rho] bf16)."""
    T, J, D = k.shape
    dist = torch.empty(T, J)
    for c0 in range(0, T, chunk_size):
        c1 = min(T, c0 + chunk_size)
        for j in range(J):
            kk = k[c0:c1, j].float()
            kh = kk / kk.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            mu = kh.mean(0)
            mu = mu / mu.norm().clamp_min(1e-12)
            dist[c0:c1, j] = 1.0 - kh @ mu
    qc = torch.stack([q[:, j, coords[j]] for j in range(J)], dim=1).float().to(torch.bfloat16)
    return dist, qc
