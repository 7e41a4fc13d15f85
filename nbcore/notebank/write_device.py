"""The writer's reduction on the features' own device (paper Sec. 3.2, Eqs. 3-4, App. B.2-B.3).

`DeviceArchiveWriter` writes the same archive as `write.ArchiveWriter` (the naive reference, kept
as is): same rules, same tie grid, same interface (feed / finish / carry / from_carry / extend /
refresh_pending). The difference is where the work happens. The reference moves every block's
per-token features (dist [t, J] fp32, qc [t, J, d_rho]) to the host and selects spans in numpy;
this writer keeps them on their device and brings over only indices, a few window results and
the selected notes' address rows.

All chunks completed by one `feed` call are written together, in at most three host syncs
(none when the call completes no chunk):

  1. device: d_t (channel mean, Eq. 3) of every region token, float64 window sums of every
     region (cumsum differences, as `best_window`), snapped to the tie grid, first maximum.
     -> host: [n, 2] (best window start, its sum) per completed chunk.
     host: note 1 of each chunk (`span_from_window`: sentence expansion, its exclusion range).
  2. (W = 2) device: the best window of each of the <= 2 sub-regions left of / right of the
     sentences note 1 overlaps. -> host: [k, 2] for sub-regions longer than the window, and the
     d_t of the (<= window tokens) shorter ones, whose score the reference takes as a numpy sum.
     host: note 2 (highest snapped score, ties to the earlier window) and its expansion.
  3. device: per note and channel the position of the highest snapped per-channel score
     (Eq. 4, ties earlier; m > 1: the top-m by a stable sort; key_qnovel: times the query
     novelty against the running query sum, kept on the device) and the gather of their
     compacted queries. -> host: [notes, J * m, d_rho] bf16, the addresses themselves.

What crosses per chunk: 2 + (W = 2: <= 2 x 2 values or <= 2 x window scores) scalars and
W x J x m x d_rho address values. `carry()` additionally brings the tail + pending features
over (< C + tail rows), once per document part. A fed block is never copied: the kept rows
(tail + pending) and the block stay separate tensors (`Rows`), read by views and gathers.

Exactness. On CPU every quantity is computed by the same float operations as the reference on
tensors of the same shape and layout (row-wise channel means; float64 sequential cumsum, which
equals numpy's; the same snap; argmax / stable sort, first on ties; key_qnovel's per-chunk
query sum and novelty on the same region tensors), so archives are byte-identical
(tests/test_write_device.py). On CUDA the float64 cumsum is a parallel scan and the channel
mean a tree reduction: window sums may differ from the CPU reference in the last float64 bits
(~1e-16 relative), far below the 1e-5 tie grid; a choice can only flip when a sum lies within
that of a grid rounding boundary.
"""
from __future__ import annotations

import numpy as np
import torch

from nbcore.config import NoteBankConfig
from nbcore.notebank.features import l2_normalize
from nbcore.notebank.write import ArchiveWriter, WriterCarry, _snap, _Tail, query_novelty, sentence_spans, span_from_window


def to_host(t: torch.Tensor) -> torch.Tensor:
    """The writer's only device -> host crossing (one sync per call)."""
    return t.detach().cpu()


def _long(vals, device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(vals, dtype=np.int64), device=device)


class Rows:
    """Rows of tensors concatenated along dim 0 (the kept stream + a new block), without copying
    them together: slices that stay inside one part are views, gathers pick from every part."""

    def __init__(self, *parts):
        flat = [q for p in parts for q in (p.parts if isinstance(p, Rows) else [p])]
        self.parts = [p for p in flat if p.shape[0]] or flat[-1:]
        self.offs = np.cumsum([0] + [p.shape[0] for p in self.parts])[:-1].tolist()
        self.n = sum(p.shape[0] for p in self.parts)

    @property
    def device(self):
        return self.parts[0].device

    def to(self, device) -> "Rows":
        return Rows(*(p.to(device) for p in self.parts))

    def slice(self, a: int, b: int) -> torch.Tensor:
        """Rows [a, b): a view when they lie in one part."""
        pieces = [p[max(a - o, 0):min(b - o, p.shape[0])] for p, o in zip(self.parts, self.offs)
                  if a < o + p.shape[0] and b > o]
        if not pieces:
            return self.parts[0][:0]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def take(self, rows: torch.Tensor, cols: torch.Tensor | None = None) -> torch.Tensor:
        """self[rows] (rows: long tensor of any shape), or self[rows, cols] (broadcast)."""
        g = (lambda p, r: p[r]) if cols is None else (lambda p, r: p[r, cols])
        if len(self.parts) == 1:
            return g(self.parts[0], rows)
        shape = rows.shape if cols is None else torch.broadcast_shapes(rows.shape, cols.shape)
        out = None
        for p, o in zip(self.parts, self.offs):           # later parts win where the row is theirs
            v = g(p, (rows - o).clamp(0, p.shape[0] - 1))
            if out is None:
                out = v
            else:
                m = torch.broadcast_to(rows >= o, shape)
                out = torch.where(m.reshape(*shape, *([1] * (v.dim() - len(shape)))), v, out)
        return out


def device_best_windows(x: torch.Tensor, los, lens, window: int) -> torch.Tensor:
    """Best `window`-token window of each sub-range [lo, lo + len) of x (every len > window).

    x: [N] float64 scores on any device. -> [k, 2] float64 on x's device: (start offset inside
    the sub-range, window sum). The reference's operations exactly (`write.best_window`): float64
    cumsum from the sub-range's first token with a leading 0, sums = c[w:] - c[:-w], snapped to
    the tie grid, first maximum. Sub-ranges are batched, padded with zeros at their ends (which
    leaves every valid prefix sum unchanged) and padded window starts masked."""
    dev = x.device
    k, Lmax = len(los), int(max(lens))
    lo_t, len_t = _long(los, dev), _long(lens, dev)
    ar = torch.arange(Lmax, device=dev)
    valid = ar[None] < len_t[:, None]                                    # [k, Lmax]
    v = x[torch.where(valid, lo_t[:, None] + ar[None], 0)].masked_fill(~valid, 0.0)
    c = torch.cat([v.new_zeros(k, 1), torch.cumsum(v, dim=1)], dim=1)    # [k, Lmax + 1]
    sums = c[:, window:] - c[:, :-window]                                # [k, Lmax - window + 1]
    ok = torch.arange(sums.shape[1], device=dev)[None] <= (len_t - window)[:, None]
    i = torch.argmax(_snap(sums).masked_fill(~ok, float("-inf")), dim=1)  # first maximum
    return torch.stack([i.to(sums.dtype), sums.gather(1, i[:, None])[:, 0]], dim=1)


def device_addresses(pos: torch.Tensor | Rows, qc: torch.Tensor | Rows, pos_rows, qc_rows, lens,
                     m: int = 1) -> torch.Tensor:
    """Eq. 4 for k notes at once: note i covers rows pos_rows[i] + [0, lens[i]) of pos [P, J]
    (per-channel position scores) and the same positions at qc_rows[i] + [0, lens[i]) of
    qc [Q, J, d_rho]. -> [k, J * m, d_rho] bf16 on the device, each note exactly
    `write.assign_addresses` (snapped scores, first maximum / stable top-m, a note shorter than
    m repeats its best position; channel-major slots)."""
    pos, qc = Rows(pos), Rows(qc)
    dev = pos.device
    k, Lmax, J = len(lens), int(max(lens)), pos.parts[0].shape[1]
    len_t = _long(lens, dev)
    ar = torch.arange(Lmax, device=dev)
    valid = ar[None] < len_t[:, None]                                    # [k, Lmax]
    rows = torch.where(valid, _long(pos_rows, dev)[:, None] + ar[None], 0)
    s = _snap(pos.take(rows).double()).masked_fill(~valid[..., None], float("-inf"))  # [k, Lmax, J]
    if m == 1:
        sel = torch.argmax(s, dim=1)[:, None]                            # [k, 1, J] first max
    else:
        order = torch.sort(-s, dim=1, stable=True).indices[:, :m]         # [k, min(m, Lmax), J]
        if order.shape[1] < m:
            order = torch.cat([order, order[:, :1].expand(k, m - order.shape[1], J)], dim=1)
        short = (torch.arange(m, device=dev)[None] >= len_t[:, None])[..., None]   # [k, m, 1]
        sel = torch.where(short, order[:, :1], order)                    # [k, m, J]
    t = _long(qc_rows, dev)[:, None, None] + sel                         # [k, m, J]
    out = qc.take(t, torch.arange(J, device=dev)[None, None])            # [k, m, J, d]
    return out.transpose(1, 2).reshape(k, J * m, -1).to(torch.bfloat16)


class DeviceArchiveWriter(ArchiveWriter):
    """`ArchiveWriter` with span selection and addressing on the features' device (module
    docstring). Same constructor, same archives, same carries.

    Feature stream: `_sd` [N, J] distinctiveness, `_sq` [N, J, d_rho] compacted queries (`Rows`:
    the kept rows + the new block, never copied together) and `_ss` [N] float64 d_t of the
    document positions [pos - N, pos): after each feed, the tail rows of the last completed chunk
    + the pending tokens of the incomplete chunk."""

    def __init__(self, cfg: NoteBankConfig, ids: np.ndarray, sent: np.ndarray, n_channels: int,
                 model_fingerprint: str):
        super().__init__(cfg, ids, sent, n_channels, model_fingerprint)
        self._sd: Rows | None = None
        self._sq: Rows | None = None
        self._ss: torch.Tensor | None = None
        self._spans_of: np.ndarray | None = None             # the sent array `_spans` indexes
        self._spans: tuple[np.ndarray, np.ndarray] | None = None

    def _bounds(self, off: int):
        """fn(t, lo, hi) -> `_sentence_bounds(self.sent[off:...], t, lo, hi)` by table lookup."""
        if self._spans_of is not self.sent:                  # built once per (extended) id list
            self._spans, self._spans_of = sentence_spans(self.sent), self.sent
        first, end = self._spans
        return lambda t, lo, hi: (max(lo, int(first[off + t]) - off), min(hi, int(end[off + t]) - off))

    # ---- stream -----------------------------------------------------------------------------
    @staticmethod
    def _scores(dist: torch.Tensor) -> torch.Tensor:
        return dist.mean(dim=1).double()                                 # d_t, Eq. 3 (channel average)

    def _n_stream(self) -> int:
        return 0 if self._sd is None else self._sd.n

    def _to(self, device) -> None:
        if self._sd is not None and self._sd.device != device:
            self._sd, self._sq, self._ss = self._sd.to(device), self._sq.to(device), self._ss.to(device)
        if self._q_sum is not None and self._q_sum.device != device:
            self._q_sum = self._q_sum.to(device)

    def _n_tail(self) -> int:
        return self.cfg.tail if self._n_chunks > 0 else 0

    # ---- resume -----------------------------------------------------------------------------
    @classmethod
    def from_carry(cls, cfg: NoteBankConfig, carry: WriterCarry, n_channels: int,
                   model_fingerprint: str) -> "DeviceArchiveWriter":
        w = super().from_carry(cfg, carry, n_channels, model_fingerprint)
        d = ([w._tail.dist] if w._tail is not None else []) + w._buf_dist
        q = ([w._tail.qc] if w._tail is not None else []) + w._buf_qc
        w._tail, w._buf_dist, w._buf_qc, w._buf_n = None, [], [], 0
        if d:
            d, q = torch.cat(d).contiguous(), torch.cat(q).contiguous()
            w._sd, w._sq, w._ss = Rows(d), Rows(q), cls._scores(d)
        return w

    def refresh_pending(self, dist: torch.Tensor) -> None:
        n = self.pos - self._n_chunks * self.cfg.chunk_size
        if tuple(dist.shape) != (n, self.J):
            raise ValueError(f"refresh_pending: expected [{n}, {self.J}], got {tuple(dist.shape)}")
        if n:
            dist = dist.detach().contiguous()
            self._to(dist.device)
            keep = self._n_stream() - n
            self._sd = Rows(self._sd.slice(0, keep), dist)
            self._ss = torch.cat([self._ss[:keep], self._scores(dist)])

    def carry(self, pending_keys: torch.Tensor | None = None) -> WriterCarry:
        if self.pos == 0:
            raise ValueError("carry of an empty writer: nothing was read")
        r = self._n_tail()
        n = self._n_stream() - r
        N = self._n_stream()
        d, q = (to_host(self._sd.slice(0, N)), to_host(self._sq.slice(0, N))) if N else (None, None)
        # the reference's buffers, filled for its carry() and emptied again
        self._buf_dist, self._buf_qc, self._buf_n = ([d[r:]], [q[r:]], n) if n else ([], [], 0)
        self._tail = _Tail(d[:r], q[:r]) if r else None
        q_sum = self._q_sum
        self._q_sum = None if q_sum is None else to_host(q_sum)
        try:
            return super().carry(pending_keys)
        finally:
            self._buf_dist, self._buf_qc, self._buf_n, self._tail, self._q_sum = [], [], 0, None, q_sum

    # ---- write ------------------------------------------------------------------------------
    def feed(self, dist: torch.Tensor, qc: torch.Tensor) -> None:
        """dist: [t, J] fp32, qc: [t, J, d_rho] for the next t tokens of the document."""
        t = dist.shape[0]
        if t == 0:
            return
        dist, qc = dist.detach().contiguous(), qc.detach().contiguous()
        self._to(dist.device)
        sc = self._scores(dist)
        if not self._n_stream():
            self._sd, self._sq, self._ss = Rows(dist), Rows(qc), sc
        else:
            self._sd, self._sq = Rows(self._sd, dist), Rows(self._sq, qc)
            self._ss = torch.cat([self._ss, sc])
        self.pos += t
        C = self.cfg.chunk_size
        done = self.pos // C
        if done > self._n_chunks:
            self._write_chunks(range(self._n_chunks, done))

    def _write_chunks(self, chunks) -> None:
        cfg = self.cfg
        C, W, B, w = cfg.chunk_size, cfg.write_budget, cfg.note_budget, cfg.window
        s0 = self.pos - self._n_stream()                     # document position of stream row 0
        b = self.base                                        # ids/sent hold [base, ...)
        regions = []                                         # (chunk, region start, region end)
        for c in chunks:
            rs, re_ = c * C - (cfg.tail if c > 0 else 0), (c + 1) * C
            if rs < b or re_ - b > len(self.sent):
                raise ValueError(f"writer holds token ids of [{b}, {b + len(self.sent)}), chunk needs "
                                 f"[{rs}, {re_})")
            regions.append((c, rs, re_))
        dev = self._sd.device

        # per-position scores of Eq. 4 (key_qnovel: region-wise, the running query sum moves on)
        if cfg.addr_select == "key_qnovel":
            parts, pos_base, off = [], [], 0
            q_sum = self._q_sum
            for c, rs, re_ in regions:
                a, e = rs - s0, re_ - s0
                chunk_sum = l2_normalize(self._sq.slice(c * C - s0, e).float()).sum(0)
                q_sum = chunk_sum if q_sum is None else q_sum + chunk_sum
                parts.append(self._sd.slice(a, e) * query_novelty(self._sq.slice(a, e), q_sum))
                pos_base.append(off - a)                     # pos row of stream row x: x + base
                off += e - a
            self._q_sum = q_sum
            pos_src = torch.cat(parts)
        else:
            pos_src, pos_base = self._sd, [0] * len(regions)

        # round 1: best window of every region
        lens = [re_ - rs for _, rs, re_ in regions]
        long1 = [i for i, L in enumerate(lens) if L > w]
        win = {i: (0, lens[i]) for i in range(len(regions)) if lens[i] <= w}   # short: one window
        if long1:
            r1 = to_host(device_best_windows(self._ss, [regions[i][1] - s0 for i in long1],
                                             [lens[i] for i in long1], w)).numpy()
            for j, i in enumerate(long1):
                win[i] = (int(r1[j, 0]), int(r1[j, 0]) + w)
        spans, subs = [], []
        for i, (c, rs, re_) in enumerate(regions):
            s1, e1, xs, xe = span_from_window(None, *win[i], 0, lens[i], B, bounds=self._bounds(rs - b))
            spans.append([(s1, e1)])
            if W >= 2:
                subs += [(i, lo, hi) for lo, hi in ((0, xs), (xe, lens[i])) if hi > lo]

        # round 2 (W = 2): best window of each sub-region, note 2
        if subs:
            long2 = [x for x in subs if x[2] - x[1] > w]
            short2 = [x for x in subs if x[2] - x[1] <= w]
            pieces = []
            if long2:
                pieces.append(device_best_windows(self._ss, [regions[i][1] - s0 + lo for i, lo, _ in long2],
                                                  [hi - lo for _, lo, hi in long2], w).reshape(-1))
            if short2:
                idx = np.concatenate([np.arange(regions[i][1] - s0 + lo, regions[i][1] - s0 + hi)
                                      for i, lo, hi in short2])
                pieces.append(self._ss[_long(idx, dev)])
            r2 = to_host(torch.cat(pieces)).numpy()
            cands: dict[int, list] = {}
            o = 2 * len(long2)
            it_long = iter(r2[:o].reshape(-1, 2))
            for i, lo, hi in subs:
                if hi - lo > w:
                    st, sm = next(it_long)
                    cand = (lo + int(st), lo + int(st) + w, float(sm), lo, hi)
                else:                                        # best_window of a short region
                    cand = (lo, hi, float(r2[o:o + hi - lo].sum()), lo, hi)
                    o += hi - lo
                cands.setdefault(i, []).append(cand)
            # every candidate's score snapped to the tie grid in one call (`_snap` per element)
            snapped = iter(_snap(np.array([c[2] for cs in cands.values() for c in cs], dtype=np.float64)).tolist())
            cands = {i: [(snap, c) for c, snap in zip(cs, snapped)] for i, cs in cands.items()}
            for i, cs in cands.items():
                # highest score; ties -> earlier window (left sub-region comes first)
                ws2, we2, _, lo, hi = max(cs, key=lambda sc: (sc[0], -sc[1][0]))[1]
                rs, re_ = regions[i][1], regions[i][2]
                s2, e2, _, _ = span_from_window(None, ws2, we2, lo, hi, B, bounds=self._bounds(rs - b))
                spans[i].append((s2, e2))

        # round 3: addresses of every note
        notes = [(i, s, e) for i in range(len(regions)) for s, e in spans[i]]
        q_rows = [regions[i][1] - s0 + s for i, s, _ in notes]
        addr = to_host(device_addresses(pos_src, self._sq, [r + pos_base[i] for r, (i, _, _) in zip(q_rows, notes)],
                                        q_rows, [e - s for _, s, e in notes], cfg.addr_positions))
        for j, (i, s, e) in enumerate(notes):
            c, rs, _ = regions[i]
            self.token_ids.append(self.ids[rs - b + s:rs - b + e].astype(np.int32))
            self.starts.append(rs + s)
            self.ends.append(rs + e)
            self.chunks.append(c)
            self.addresses.append(addr[j])

        # keep the last chunk's tail + the pending tokens
        self._n_chunks = regions[-1][0] + 1
        keep, N = self._n_chunks * C - self._n_tail() - s0, self._n_stream()
        self._sd, self._sq = Rows(self._sd.slice(keep, N).clone()), Rows(self._sq.slice(keep, N).clone())
        self._ss = self._ss[keep:].clone()
