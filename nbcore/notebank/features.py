"""Native-feature reductions used by the writer and router (paper Eqs. 3, 8, 9).

Pure tensor functions. Layout: features are [T, H, d] per layer or [T, J, d] over all channels.
The fast path (`ChunkReducer`) reduces each layer's q/k as the backbone produces them, so a
forward over a large block never keeps O(T·J·d) tensors; `reference_features` is the naive
whole-tensor version it is tested against.
"""
from __future__ import annotations

import torch

from nbcore.backbones.base import FeatureTap
from nbcore.kernels import native


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """x / ||x||_2 over the last dim (fp32)."""
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


# Tokens per slab on CPU: the reductions below run slab by slab so that every temporary
# ([slab, H, d] fp32, ~2 MiB for 4K tokens x 128 dims) stays in cache; one whole-tensor pass per
# op was 2.5-3x slower at 64K tokens. On accelerators one slab covers the block (fewer launches).
SLAB_TOKENS = 4096


def _slab(T: int, chunk_size: int, device: torch.device) -> int:
    if device.type != "cpu":
        return max(T, 1)
    return max(chunk_size, (SLAB_TOKENS // chunk_size) * chunk_size)


def chunk_distinctiveness(k: torch.Tensor, chunk_size: int, offset: int = 0,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-channel native-key distinctiveness (Eqs. 3, 8).

    k: [T, H, d] keys of consecutive tokens whose first token sits at document position `offset`.
    Chunks are the document's C-token chunks [cC, (c+1)C); `offset` must be a multiple of C
    (the last group may be partial: it belongs to an incomplete chunk that never writes).
    Returns d: [T, H] with d_t = 1 - <k̂_t, normalize(mean_{s in chunk(t)} k̂_s)>, written into
    `out` ([T, H] fp32, any strides) when given.
    `reference_features` is the naive per-chunk, per-channel loop it is tested against.
    """
    if offset % chunk_size:
        raise ValueError(f"feature block must start on a chunk boundary (offset {offset}, C={chunk_size})")
    T, H, D = k.shape
    C = chunk_size
    n_full = T // C
    if out is None:
        out = torch.empty(T, H, dtype=torch.float32, device=k.device)
    step = _slab(T, C, k.device)
    if head_major(k):
        # k is a [T, H, d] view of a contiguous [H, T, d] tensor (how the GDN kernels lay q/k
        # out): per head, two batched mat-vecs over contiguous [n, C, d] chunks, no copy.
        for h in range(H):
            x = k[: n_full * C, h].float().view(n_full, C, D)        # [n, C, d] contiguous
            inv = torch.linalg.vector_norm(x, dim=-1).clamp_min_(1e-12).reciprocal_()   # [n, C]
            s = torch.bmm(inv.unsqueeze(1), x)                          # [n, 1, d] = sum of k̂
            mu = s / torch.linalg.vector_norm(s, dim=-1, keepdim=True).clamp_min_(1e-12)
            dot = torch.bmm(x, mu.transpose(1, 2)).squeeze(-1) * inv    # [n, C] = <k̂_t, mû>
            out[: n_full * C, h] = (1.0 - dot).view(-1)
    for s0 in range(0, 0 if head_major(k) else n_full * C, step):
        s1 = min(n_full * C, s0 + step)
        # a contiguous in-cache copy first: strided reads of k (a view into the model's fused
        # q/k/v projection) made every op below ~2x slower
        kh = l2_normalize(k[s0:s1].contiguous())                  # [m, H, d], m = s1 - s0
        blocks = kh.view((s1 - s0) // C, C, H, D)                 # [n, C, H, d]
        mu = l2_normalize(blocks.mean(dim=1))                     # [n, H, d]
        dot = (blocks * mu.unsqueeze(1)).sum(dim=-1)              # [n, C, H]
        torch.sub(1.0, dot.view(s1 - s0, H), out=out[s0:s1])
    rest = k[n_full * C:]
    if rest.shape[0]:
        kh = l2_normalize(rest)
        mu = l2_normalize(kh.mean(dim=0))                         # [H, d]
        out[n_full * C:] = 1.0 - (kh * mu).sum(dim=-1)
    return out


def head_major(x: torch.Tensor) -> bool:
    """True for a [T, H, d] view of a contiguous [H, T, d] tensor (head-major layout)."""
    return x.dim() == 3 and x.shape[1] > 1 and x.shape[0] > 1 and x.transpose(0, 1).is_contiguous()


def compact(q: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """Fixed coordinate selection P (Eq. 9).

    q: [T, H, d]; coords: [H, d_rho] (int64, distinct per row) -> [T, H, d_rho] = P_h q_{t,h}."""
    idx = coords.to(q.device).unsqueeze(0).expand(q.shape[0], -1, -1)  # [T, H, d_rho]
    return torch.gather(q.float(), 2, idx)


def compact_bf16(q: torch.Tensor, coords: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`compact` rounded to BF16 (what the writer keeps), computed slab by slab on CPU, written
    into `out` ([T, H, d_rho] bf16, any strides) when given.
    Exact: selection then rounding, the same values as compact(q, coords).to(bf16)."""
    T, H, _ = q.shape
    if out is None:
        out = torch.empty(T, H, coords.shape[1], dtype=torch.bfloat16, device=q.device)
    if head_major(q):
        cd = coords.to(q.device)
        for h in range(H):                       # [T, d] contiguous rows per head
            out[:, h] = q[:, h].float().index_select(1, cd[h])
        return out
    idx = coords.to(q.device).unsqueeze(0)
    step = _slab(T, SLAB_TOKENS, q.device)
    for s0 in range(0, T, step):
        s1 = min(T, s0 + step)
        # gather from a contiguous in-cache copy: on a strided view (q as the model splits it
        # out of its fused projection) torch's CPU gather was ~7x slower
        out[s0:s1] = torch.gather(q[s0:s1].float().contiguous(), 2, idx.expand(s1 - s0, -1, -1))
    return out


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

    `offset` is the document position of the first token of this forward call.

    Resumed ingest (`nbcore.reader.append`): the first call may start inside a chunk. Then
    `prefix_keys` [t0, J, d] are the raw native keys of the t0 tokens before `offset` that belong
    to the same chunk (`offset - t0` must be a chunk boundary): they join that chunk's mean key
    exactly as in a one-pass read, and `prefix_dist()` gives their distinctiveness recomputed with
    it. `keep_partial=True` keeps the raw keys of the trailing incomplete chunk (prefix included)
    for the next resume: `partial_keys()`; at most C - 1 rows, never a whole block.

    `n_tokens` (the length of the forward call, when the caller knows it): every layer writes
    straight into one [n_tokens, J] / [n_tokens, J, d_rho] result pair, so `result()` needs no
    concatenation pass over the block's features (without it, per-layer pieces are
    concatenated at the end; the values are the same).

    `native=False` keeps `on_segment` on its torch path (the C kernel's reference).

    `buffers`: a previous reducer's `result()` pair to write into again (same n_tokens, channels,
    d_rho and device), so that a long read does not fault in fresh pages every block; the caller
    must be done with the previous block's features (`ingest` is: its writers copy what they keep)."""

    def __init__(self, coords: torch.Tensor, heads_per_layer: int, chunk_size: int | None, offset: int = 0,
                 prefix_keys: torch.Tensor | None = None, keep_partial: bool = False,
                 n_tokens: int | None = None, native: bool = True,
                 buffers: tuple[torch.Tensor | None, torch.Tensor] | None = None):
        self.coords = coords                     # [J, d_rho]
        self.native = native                     # on_segment may use the C kernel (nbcore.kernels.native)
        self._coords_cache: dict = {}
        self._ptrs: tuple | None = None          # addresses of the n_tokens buffers (native path)
        self._empty_keys: torch.Tensor | None = None
        self.n_tokens = n_tokens
        self._buf: tuple[torch.Tensor | None, torch.Tensor] | None = None   # (dist, qc) when n_tokens
        self._reuse = buffers
        self.H = heads_per_layer
        self.chunk_size = chunk_size
        self.offset = offset
        self.dist: dict[int, list[torch.Tensor]] = {}
        self.qc: dict[int, list[torch.Tensor]] = {}
        self._pos: dict[int, int] = {}           # tokens already seen per layer in this call
        if prefix_keys is not None and prefix_keys.shape[0] == 0:
            prefix_keys = None
        if prefix_keys is not None and not chunk_size:
            raise ValueError("prefix_keys need a chunk_size")
        self.prefix_keys = prefix_keys           # [t0, J, d] or None
        self.keep_partial = keep_partial
        self._prefix_dist: dict[int, torch.Tensor] = {}
        self._partial: dict[int, torch.Tensor] = {}

    def _advance(self, rec_idx: int, t: int, device) -> int:
        """Reserve the next t tokens of layer rec_idx -> their position in this call."""
        pos = self._pos.get(rec_idx, 0)
        self._pos[rec_idx] = pos + t
        if self.n_tokens is not None:
            if pos + t > self.n_tokens:
                raise ValueError(f"ChunkReducer(n_tokens={self.n_tokens}): layer {rec_idx} got {pos + t} tokens")
            if self._buf is None:
                J, d = self.coords.shape
                rd, rq = self._reuse if self._reuse is not None else (None, None)
                fits = rq is not None and tuple(rq.shape) == (self.n_tokens, J, d) and rq.device == torch.device(device) \
                    and ((rd is None) if not self.chunk_size else (rd is not None and tuple(rd.shape) == (self.n_tokens, J)))
                self._buf = (rd, rq) if fits else \
                    (torch.empty(self.n_tokens, J, dtype=torch.float32, device=device) if self.chunk_size else None,
                     torch.empty(self.n_tokens, J, d, dtype=torch.bfloat16, device=device))
                self._reuse = None
        return pos

    # --- the kernel-side path ---------------------------------------------------------------
    def accepts_segments(self, rec_idx: int, kernel_chunk: int, segment: int) -> bool:
        """Whether layer `rec_idx`'s next kernel call may feed `on_segment` instead of `on_layer`:
        the kernel's chunk-major segments of `segment` tokens (chunks of `kernel_chunk`) must tile
        NoteBank's C-token chunks exactly, and a resumed chunk's prefix keys go the general way."""
        if self.prefix_keys is not None and self._pos.get(rec_idx, 0) == 0:
            return False
        C = self.chunk_size
        return not C or (C % kernel_chunk == 0 and segment % C == 0)

    def on_segment(self, rec_idx: int, a: int, t: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """The same reduction as `on_layer`, fed by a CPU kernel (nbcore.kernels.gdn_cpu) from the
        chunk-major fp32 copies it makes anyway, before it normalises them: no strided read of the
        model's fused projection and no extra copy.

        q, k: [n, B*Hv, c, d] fp32, the raw query/key of tokens a .. a+t-1 of this call in n chunks of
        c tokens (rows past t are zero padding), key heads repeated r = Hv / H times (batch 0 is
        read). Calls come in order, a = the tokens this layer has seen; a is a multiple of C."""
        n, BH, c, D = k.shape
        H = self.H
        r = BH // H if BH % H == 0 else 0
        if not r or n * c < t:
            raise ValueError(f"on_segment: {BH} kernel heads for {H} key heads, {n}x{c} rows for {t} tokens")
        pos = self._advance(rec_idx, t, k.device)
        if pos != a:
            raise ValueError(f"on_segment: layer {rec_idx} at token {pos}, segment starts at {a}")
        if self.chunk_size and (self.offset + a) % self.chunk_size:
            raise ValueError(f"on_segment: segment at document position {self.offset + a} is not on a "
                             f"chunk boundary (C={self.chunk_size})")
        C = self.chunk_size
        if self._buf is not None and self.native and self._native_into(rec_idx, pos, t, q, k, r):
            # written straight into the block's buffers: no views made per call (at ~30 tensor
            # calls per segment, dispatch between the kernel's big ops cost as much as the work)
            self.qc.setdefault(rec_idx, [])
            if C:
                self.dist.setdefault(rec_idx, [])
                self._after_chunks(rec_idx, pos, t, k, r, None)
            return
        sl = slice(rec_idx * H, (rec_idx + 1) * H)
        dr = self.coords.shape[1]
        qc = self._buf[1][pos:pos + t, sl] if self._buf is not None else \
            torch.empty(t, H, dr, dtype=torch.bfloat16, device=q.device)
        d = None
        if C:
            d = self._buf[0][pos:pos + t, sl] if self._buf is not None else \
                torch.empty(t, H, dtype=torch.float32, device=k.device)
        # the C kernel (nbcore.kernels.native) when it can run here, else the torch path: its reference
        kh = None
        if not (self.native and native.capture_segment(q, k, r, H, t, self._layer_coords(rec_idx, q.device),
                                                       qc, d, C)):
            kh = k.view(n, BH // r, r, c, D)[:, :H, 0]            # [n, H, c, d]: batch 0, one copy per key head
            with torch.no_grad():
                self._segment_torch(q.view(n, BH // r, r, c, D)[:, :H, 0], kh, t, sl, qc, d)
        self.qc.setdefault(rec_idx, []).append(qc)
        if not C:
            return
        self.dist.setdefault(rec_idx, []).append(d)
        self._after_chunks(rec_idx, pos, t, k, r, kh)

    def _after_chunks(self, rec_idx: int, pos: int, t: int, k: torch.Tensor, r: int, kh: torch.Tensor | None):
        """The segment's trailing partial chunk, if any: its distinctiveness (within the partial
        chunk, as `chunk_distinctiveness`) and, with keep_partial, its raw keys."""
        C, H = self.chunk_size, self.H
        n, BH, c, D = k.shape
        rest = t % C
        if not rest:
            if self.keep_partial:                                 # ends on a chunk boundary: nothing pending
                self._partial[rec_idx] = self._no_keys(k)
            return
        g, nb = C // c, t // C
        if kh is None:
            kh = k.view(n, BH // r, r, c, D)[:, :H, 0]
        tail = kh[nb * g:].permute(0, 2, 1, 3).reshape(-1, H, D)[:rest]                 # [rest, H, d]
        d = self._buf[0][pos:pos + t, rec_idx * H:(rec_idx + 1) * H] if self._buf is not None else \
            self.dist[rec_idx][-1]
        with torch.no_grad():
            chunk_distinctiveness(tail, C, 0, out=d[nb * C:])
            if self.keep_partial:
                self._partial[rec_idx] = tail.clone()

    def _no_keys(self, k: torch.Tensor) -> torch.Tensor:
        """[0, H, d] fp32: no pending keys (one per reducer, shared by its layers)."""
        e = self._empty_keys
        if e is None or e.shape[2] != k.shape[3] or e.device != k.device:
            e = self._empty_keys = k.new_empty(0, self.H, k.shape[3])
        return e

    def _native_into(self, rec_idx: int, pos: int, t: int, q: torch.Tensor, k: torch.Tensor, r: int) -> bool:
        """`native.capture_into` on this block's buffers at tokens pos .. pos+t-1 of layer rec_idx."""
        ptrs = self._ptrs
        if ptrs is None:
            d_buf, q_buf = self._buf
            if q_buf.device.type != "cpu" or not q_buf.is_contiguous() or \
                    (d_buf is not None and not d_buf.is_contiguous()):
                return False
            ptrs = self._ptrs = (q_buf.data_ptr(), d_buf.data_ptr() if d_buf is not None else None)
        qc_base, d_base = ptrs
        J, dr = self.coords.shape
        H = self.H
        coords = self._layer_coords(rec_idx, q.device)
        row = pos * J + rec_idx * H                               # element offset of (pos, first head)
        return native.capture_into(q, k, r, H, t, coords.data_ptr(), dr, qc_base + 2 * row * dr, J * dr, dr,
                                   d_base + 4 * row if d_base is not None else None, J, 1, self.chunk_size or 0)

    def _segment_torch(self, qh: torch.Tensor, kh: torch.Tensor, t: int, sl: slice, qc: torch.Tensor,
                       d: torch.Tensor | None) -> None:
        """`on_segment`'s reduction in torch ops, the reference of the C kernel: compacted queries
        into qc [t, H, d_rho], and distinctiveness of the whole C-token chunks into d [t, H].
        qh, kh: [n, H, c, d] views of the kernel's fp32 chunk-major copies (batch 0)."""
        n, H, c, D = kh.shape
        qh, kh = qh.contiguous(), kh.contiguous()                 # a copy only when heads are repeated
        # Eq. 9: the d_rho coordinates of every head at once, then one converting copy into place
        dr = self.coords.shape[1]
        idx = self.coords[sl].to(qh.device).view(1, 1, H, dr)
        sel = torch.gather(qh.transpose(1, 2), 3, idx.expand(n, c, H, dr))   # [n, c, H, d_rho] token-major
        qc.copy_(sel.view(n * c, H, dr)[:t])
        C = self.chunk_size
        if not C:
            return
        # Eqs. 3, 8 for the whole C-token chunks: heads and kernel chunks batched together
        g, nb = C // c, t // C                                    # kernel chunks per NoteBank chunk; full chunks
        if nb:
            m = nb * g                                            # kernel chunks in whole C-token chunks
            x = kh[:m].reshape(m * H, c, D)                       # a view: [(chunk, head), c, d]
            inv = torch.linalg.vector_norm(x, dim=-1).clamp_min_(1e-12).reciprocal_()  # [m*H, c] = 1/|k_t|
            s = torch.bmm(inv.unsqueeze(1), x).view(nb, g * H, D)                      # per kernel chunk
            s = s.view(nb, g, H, D).sum(1)                                              # [nb, H, d] = sum of k̂
            mu = s.div_(torch.linalg.vector_norm(s, dim=-1, keepdim=True).clamp_min_(1e-12))
            # <k_t, mû> against every (chunk, head) mean in one GEMM, then each row's own column: the
            # per-row mat-vec (a batched bmm) is ~3x slower on CPU at these sizes
            allp = x.view(m * H * c, D) @ mu.view(nb * H, D).t()                       # [m*H*c, nb*H]
            col = self._columns(nb, g, H, c, kh.device)
            dot = allp.gather(1, col).view(m, H, c).mul_(inv.view(m, H, c))             # <k̂_t, mû>
            d[: nb * C].view(m, c, H).copy_(dot.transpose(1, 2)).neg_().add_(1.0)

    def _layer_coords(self, rec_idx: int, device) -> torch.Tensor:
        """[H, d_rho] int64 coordinates of layer rec_idx's heads, contiguous on `device` (cached)."""
        key = (rec_idx, device)
        co = self._coords_cache.get(key)
        if co is None:
            co = self._coords_cache[key] = \
                self.coords[rec_idx * self.H:(rec_idx + 1) * self.H].to(device=device, dtype=torch.int64).contiguous()
        return co

    _COLS: dict = {}

    @classmethod
    def _columns(cls, nb: int, g: int, H: int, c: int, device) -> torch.Tensor:
        """[nb*g*H*c, 1] int64: row (kernel chunk i, head h, token) -> column (i // g) * H + h."""
        key = (nb, g, H, c, str(device))
        col = cls._COLS.get(key)
        if col is None:
            i = torch.arange(nb * g, device=device).view(-1, 1, 1) // g
            h = torch.arange(H, device=device).view(1, -1, 1)
            col = (i * H + h).expand(nb * g, H, c).reshape(-1, 1).contiguous()
            if len(cls._COLS) > 64:
                cls._COLS.clear()
            cls._COLS[key] = col
        return col

    def on_layer(self, rec_idx, q, k):
        t = q.shape[0]
        pos = self._advance(rec_idx, t, q.device)
        sl = slice(rec_idx * self.H, (rec_idx + 1) * self.H)
        if self.n_tokens is not None:
            qc = compact_bf16(q, self.coords[sl], out=self._buf[1][pos:pos + t, sl])
        else:
            qc = compact_bf16(q, self.coords[sl])
        self.qc.setdefault(rec_idx, []).append(qc)
        if not self.chunk_size:
            return
        start, n_pre = self.offset + pos, 0
        if pos == 0 and self.prefix_keys is not None:
            pre = self.prefix_keys[:, sl].to(device=k.device, dtype=k.dtype)
            n_pre = pre.shape[0]
            k, start = torch.cat([pre, k]), start - n_pre
        if self._buf is not None and not n_pre:
            d = chunk_distinctiveness(k, self.chunk_size, start, out=self._buf[0][pos:pos + t, sl])
        else:
            d = chunk_distinctiveness(k, self.chunk_size, start)
        if n_pre:
            self._prefix_dist[rec_idx] = d[:n_pre]
            d = d[n_pre:]
            if self._buf is not None:
                self._buf[0][pos:pos + t, sl] = d
        self.dist.setdefault(rec_idx, []).append(d)
        if self.keep_partial:
            r = (start + k.shape[0]) % self.chunk_size      # start is chunk-aligned: r <= len(k)
            self._partial[rec_idx] = k[k.shape[0] - r:].float().clone()

    def result(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """-> (dist [T, J] fp32 or None, qc [T, J, d_rho] bf16)."""
        layers = sorted(self.qc)
        if self._buf is not None:
            n_layers = self.coords.shape[0] // self.H
            if layers != list(range(n_layers)) or any(self._pos[i] != self.n_tokens for i in layers):
                raise ValueError(f"ChunkReducer(n_tokens={self.n_tokens}): layers {layers} saw "
                                 f"{[self._pos[i] for i in layers]} tokens")
            return self._buf
        qc = torch.cat([torch.cat(self.qc[i], 0) for i in layers], dim=1)
        dist = None
        if self.chunk_size:
            dist = torch.cat([torch.cat(self.dist[i], 0) for i in layers], dim=1)
        return dist, qc

    def prefix_dist(self) -> torch.Tensor | None:
        """[t0, J] fp32: distinctiveness of the prefix tokens, recomputed with this call's keys
        (None without prefix_keys)."""
        if self.prefix_keys is None:
            return None
        return torch.cat([self._prefix_dist[i] for i in sorted(self.qc)], dim=1)

    def partial_keys(self) -> torch.Tensor | None:
        """[r, J, d] fp32 raw keys of the trailing incomplete chunk after this call (r = 0 when the
        call ends on a chunk boundary); None unless keep_partial."""
        if not self.keep_partial:
            return None
        return torch.cat([self._partial[i] for i in sorted(self.qc)], dim=1)


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
