"""Write (top-W): span selection and address assignment (paper Sec. 3.2, Eqs. 3-4, App. B.2-B.3).

Rules implemented exactly as App. B.2 states them; where it is silent we chose (and test):
- Candidate region of chunk c = last `tail` tokens of chunk c-1 (scores and query features kept
  from their own chunk) + the C tokens of chunk c. Sentences are clipped to the region: a note
  never contains a token without a retained score/query feature.
- Window: highest sum of d_t over `window` consecutive region tokens; ties -> earliest start.
  A region shorter than the window is one window covering it.
- Central token of a window [s, e): s + (e - s - 1) // 2 (the left-middle token for even sizes).
- Span: the sentence holding the central token, expanded by whole adjacent sentences, left first
  then right, while the span stays <= B tokens; repeated until neither side fits.
- Over-long sentence (> B): the B tokens starting at the window start, shifted to stay inside it.
- Second note (W=2): every sentence overlapping note 1 is excluded (the whole sentence, also when
  note 1 holds only part of it); the best window over the <= 2 remaining sub-regions (each treated
  as a region) seeds note 2, whose expansion stays inside its sub-region. No candidate -> 1 note.
- Address (Eq. 4): per channel, the note position with the highest per-channel distinctiveness
  (ties -> earliest), its compacted query stored in BF16, unnormalised.
- The final incomplete chunk writes nothing; a context shorter than C leaves the archive empty.
- Numerical ties: window sums and per-channel scores are compared on a 1e-5 grid before taking
  the first maximum, so float noise from a different kernel blocking (C-token streaming vs large
  blocks) cannot flip a choice between windows whose scores differ by less than that (repetitive
  haystacks produce many such near-ties).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nbcore.config import NoteBankConfig
from nbcore.notebank.archive import Archive


TIE_GRID = 1e-5


def _snap(x):
    """Round scores to the tie grid (see module docstring)."""
    if isinstance(x, torch.Tensor):
        return torch.round(x / TIE_GRID)
    return np.round(np.asarray(x, dtype=np.float64) / TIE_GRID)


def best_window(scores: np.ndarray, lo: int, hi: int, window: int) -> tuple[int, int, float]:
    """Highest-scoring window inside [lo, hi) -> (start, end, score); ties to the earliest."""
    if hi - lo <= window:
        return lo, hi, float(scores[lo:hi].sum())
    c = np.concatenate([[0.0], np.cumsum(scores[lo:hi], dtype=np.float64)])
    sums = c[window:] - c[:-window]                        # [hi-lo-window+1]
    i = int(np.argmax(_snap(sums)))                        # first maximum
    return lo + i, lo + i + window, float(sums[i])


def _sentence_bounds(sent: np.ndarray, t: int, lo: int, hi: int) -> tuple[int, int]:
    """[start, end) of the sentence containing t, clipped to [lo, hi). sent: ids, non-decreasing."""
    sid = sent[t]
    s = lo + int(np.searchsorted(sent[lo:hi], sid, side="left"))
    e = lo + int(np.searchsorted(sent[lo:hi], sid, side="right"))
    return s, e


def sentence_spans(sent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """-> (first [T], end [T]): the [first, end) token range of each token's sentence (sent: ids,
    non-decreasing). O(1) lookups for `span_from_window(bounds=...)`, the same answers as
    `_sentence_bounds` once clipped to a range containing the token."""
    T = len(sent)
    if T == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    cut = np.flatnonzero(sent[1:] != sent[:-1]) + 1              # first token of every later sentence
    rank = np.zeros(T, np.int64)
    rank[cut] = 1
    np.cumsum(rank, out=rank)                                    # sentence number of each token
    return np.concatenate([[0], cut])[rank], np.concatenate([cut, [T]])[rank]


def span_from_window(sent: np.ndarray, ws: int, we: int, lo: int, hi: int, B: int,
                     bounds=None) -> tuple[int, int, int, int]:
    """Note span seeded by window [ws, we) inside the region [lo, hi).

    -> (span_start, span_end, excl_start, excl_end): the excluded range covers every sentence
    overlapping the span (== the span unless the seed sentence was cut to B tokens).
    bounds: optional fn(t, lo, hi) -> `_sentence_bounds(sent, t, lo, hi)` (a faster lookup)."""
    sb = bounds or (lambda t, a, b: _sentence_bounds(sent, t, a, b))
    center = ws + (we - ws - 1) // 2
    ss, se = sb(center, lo, hi)
    if se - ss > B:
        start = min(max(ws, ss), se - B)
        return start, start + B, ss, se
    while True:
        grown = False
        if ss > lo:
            ls, _ = sb(ss - 1, lo, hi)
            if se - ls <= B:
                ss, grown = ls, True
        if se < hi:
            _, re_ = sb(se, lo, hi)
            if re_ - ss <= B:
                se, grown = re_, True
        if not grown:
            return ss, se, ss, se


def select_spans(scores: np.ndarray, sent: np.ndarray, W: int, B: int, window: int) -> list[tuple[int, int]]:
    """Top-W span selection in one candidate region (App. B.2).

    scores: [L] channel-averaged distinctiveness d_t of the region's tokens; sent: [L] sentence ids.
    -> list of up to W non-overlapping (start, end) spans, region coordinates, in selection order."""
    L = len(scores)
    if L == 0:
        return []
    ws, we, _ = best_window(scores, 0, L, window)
    s1, e1, xs, xe = span_from_window(sent, ws, we, 0, L, B)
    spans = [(s1, e1)]
    if W >= 2:
        cands = []
        for lo, hi in ((0, xs), (xe, L)):
            if hi > lo:
                cands.append((*best_window(scores, lo, hi, window), lo, hi))
        if cands:
            # highest score; ties -> earlier window (left sub-region comes first)
            ws2, we2, _, lo, hi = max(cands, key=lambda c: (float(_snap(c[2])), -c[0]))
            s2, e2, _, _ = span_from_window(sent, ws2, we2, lo, hi, B)
            spans.append((s2, e2))
    return spans


def assign_addresses(dist: torch.Tensor, qc: torch.Tensor, start: int, end: int, m: int = 1) -> torch.Tensor:
    """Eq. 4: per channel, the compacted query at argmax_t d_t^{l,h} over the note.

    dist: [L, J] per-channel position scores of the region (the paper: key distinctiveness);
    qc: [L, J, d_rho] compacted queries. -> [J * m, d_rho] bf16, channel-major: channel j's slots
    are rows j*m .. j*m+m-1. m > 1 keeps the top-m distinct positions (ties -> earlier;
    a note shorter than m repeats its best position)."""
    J = dist.shape[1]
    s = _snap(dist[start:end].double())                                     # [n, J]
    if m == 1:
        t_star = torch.argmax(s, dim=0) + start                             # [J] (first max on ties)
        return qc[t_star, torch.arange(J)].to(torch.bfloat16)
    n = end - start
    order = torch.sort(-s, dim=0, stable=True).indices[: min(m, n)] + start  # [m', J]
    if order.shape[0] < m:
        order = torch.cat([order, order[:1].expand(m - order.shape[0], J)])
    out = qc[order, torch.arange(J)[None]]                                  # [m, J, d_rho]
    return out.transpose(0, 1).reshape(J * m, -1).to(torch.bfloat16)


def query_novelty(qc: torch.Tensor, q_mean: torch.Tensor) -> torch.Tensor:
    """1 - cos(q_t^j, mean query of channel j so far): low for what every position shares
    (template words), high for rare content. qc: [L, J, d]; q_mean: [J, d] -> [L, J] in [0, 2]."""
    from nbcore.notebank.features import l2_normalize
    return 1.0 - torch.einsum("ljd,jd->lj", l2_normalize(qc.float()), l2_normalize(q_mean))


@dataclass
class _Tail:
    dist: torch.Tensor       # [tail, J]
    qc: torch.Tensor         # [tail, J, d_rho]


CARRY_PREFIX = "carry."


@dataclass
class WriterCarry:
    """Everything an `ArchiveWriter` needs to continue a document (incremental append), and no
    more: no notes (the archive holds them) and only the token ids a future candidate region can
    still reference (the last `tail` tokens of the last completed chunk + the pending tokens of
    the incomplete chunk), never the whole document.

    pos:          tokens consumed (document length so far)
    n_chunks:     completed C-token chunks (pending tokens = [n_chunks * C, pos), fewer than C)
    chunk_size, tail: the writer config's C and tail (checked on resume)
    ids_start:    document position of ids[0] (= n_chunks * C - rows of the tail)
    last_sent:    sentence id of token pos - 1 (the next part's sentence ids continue from it)
    ids, sent:    [pos - ids_start] int64 token ids / sentence ids of [ids_start, pos)
    pending_dist: [t, J] fp32 writer-side distinctiveness of the pending tokens (computed with
                  the partial chunk's mean key; a resumed read recomputes it, see pending_keys)
    pending_qc:   [t, J, d_rho] bf16 compacted queries of the pending tokens
    pending_keys: [t, J, d_k] fp32 raw native keys of the pending tokens, or None: the chunk mean
                  of Eq. 3 needs every key of the chunk, so an append that completes the chunk
                  recomputes the pending tokens' distinctiveness from them (the largest tensor of
                  a carry: < C x J x d_k x 4 bytes)
    tail_dist, tail_qc: [r, J] / [r, J, d_rho] the tail features (r = tail, or 0 before the first
                  completed chunk / with tail = 0)
    q_sum:        [J, d_rho] fp32 running sum of unit compacted queries (addr_select key_qnovel),
                  or None
    """

    pos: int
    n_chunks: int
    chunk_size: int
    tail: int
    ids_start: int
    last_sent: int
    ids: np.ndarray
    sent: np.ndarray
    pending_dist: torch.Tensor
    pending_qc: torch.Tensor
    tail_dist: torch.Tensor
    tail_qc: torch.Tensor
    pending_keys: torch.Tensor | None = None
    q_sum: torch.Tensor | None = None

    _INTS = ("pos", "n_chunks", "chunk_size", "tail", "ids_start", "last_sent")
    _TENSORS = ("pending_dist", "pending_qc", "tail_dist", "tail_qc")
    _OPTIONAL = ("pending_keys", "q_sum")

    def __post_init__(self):
        self.ids = np.asarray(self.ids, dtype=np.int64).reshape(-1)
        self.sent = np.asarray(self.sent, dtype=np.int64).reshape(-1)
        self.validate()

    @property
    def n_pending(self) -> int:
        return self.pos - self.n_chunks * self.chunk_size

    def validate(self) -> "WriterCarry":
        C = self.chunk_size
        t = self.n_pending
        if C <= 0 or not 0 <= self.tail < C:
            raise ValueError(f"carry: bad chunk_size/tail ({C}, {self.tail})")
        if self.pos <= 0 or not 0 <= t < C:
            raise ValueError(f"carry: pos {self.pos} and {self.n_chunks} completed chunks of {C} disagree")
        r = self.tail_dist.shape[0]
        if r not in (0, self.tail) or (r == 0) != (self.n_chunks == 0 or self.tail == 0):
            raise ValueError(f"carry: {r} tail rows for tail={self.tail}, {self.n_chunks} chunks")
        if self.ids_start != self.n_chunks * C - r:
            raise ValueError(f"carry: ids_start {self.ids_start} != {self.n_chunks * C - r}")
        if self.ids.shape != self.sent.shape or len(self.ids) != self.pos - self.ids_start:
            raise ValueError("carry: ids/sent must cover [ids_start, pos)")
        if self.pending_dist.shape[0] != t or self.pending_qc.shape[0] != t or self.tail_qc.shape[0] != r:
            raise ValueError("carry: pending/tail feature rows do not match pos")
        if self.pending_keys is not None and self.pending_keys.shape[0] != t:
            raise ValueError("carry: pending_keys rows do not match the pending tokens")
        if len(self.sent) and int(self.sent[-1]) != self.last_sent:
            raise ValueError("carry: last_sent disagrees with sent")
        return self

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Plain CPU tensors named `carry.<field>` (no clash with `Backbone.state_to_tensors`
        names), each owning its storage: safe for `safetensors.torch.save` next to the state,
        same carry -> same bytes. Absent optional fields are left out."""
        out = {CARRY_PREFIX + n: torch.tensor([int(getattr(self, n))], dtype=torch.int64) for n in self._INTS}
        out[CARRY_PREFIX + "ids"] = torch.from_numpy(self.ids.copy())
        out[CARRY_PREFIX + "sent"] = torch.from_numpy(self.sent.copy())
        for n in self._TENSORS + self._OPTIONAL:
            v = getattr(self, n)
            if v is not None:
                out[CARRY_PREFIX + n] = v.detach().cpu().contiguous().clone()
        return out

    @classmethod
    def from_tensors(cls, d: dict[str, torch.Tensor]) -> "WriterCarry":
        """Inverse of to_tensors; other keys in `d` (e.g. the backbone state's) are ignored."""
        g = lambda n: d.get(CARRY_PREFIX + n)
        missing = [n for n in cls._INTS + ("ids", "sent") + cls._TENSORS if g(n) is None]
        if missing:
            raise ValueError(f"not a writer carry: missing {[CARRY_PREFIX + n for n in missing]}")
        kw = {n: int(g(n).reshape(-1)[0]) for n in cls._INTS}
        kw["ids"] = g("ids").cpu().numpy().astype(np.int64)
        kw["sent"] = g("sent").cpu().numpy().astype(np.int64)
        for n in cls._TENSORS + cls._OPTIONAL:
            v = g(n)
            kw[n] = None if v is None else v.cpu().clone()
        return cls(**kw)


class ArchiveWriter:
    """Streaming writer: feed per-token features in document order (any block size that keeps
    chunk alignment); notes are written each time a C-token chunk completes.

    Resumable: `carry()` -> WriterCarry, `ArchiveWriter.from_carry(...)` continues the document
    (token ids of the new part via `extend`); the resumed writer's `finish()` holds only the notes
    written after the resume. `ids`/`sent` hold the document positions [base, base + len(ids))."""

    def __init__(self, cfg: NoteBankConfig, ids: np.ndarray, sent: np.ndarray, n_channels: int,
                 model_fingerprint: str):
        self.cfg = cfg.validate()
        self.ids = np.asarray(ids, dtype=np.int64)
        self.sent = np.asarray(sent, dtype=np.int64)
        if self.ids.shape != self.sent.shape:
            raise ValueError("ids and sentence ids must have the same length")
        self.base = 0                                 # document position of ids[0]
        self.J = n_channels
        self.fp = model_fingerprint
        self.pos = 0                                  # tokens consumed
        self._buf_dist: list[torch.Tensor] = []       # pending features of the current chunk
        self._buf_qc: list[torch.Tensor] = []
        self._buf_n = 0
        self._tail: _Tail | None = None
        self._n_chunks = 0                            # completed chunks
        self._q_sum = None                            # running sum of unit compacted queries [J, d] (key_qnovel)
        self.token_ids: list[np.ndarray] = []
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.chunks: list[int] = []
        self.addresses: list[torch.Tensor] = []

    # ---- resume -----------------------------------------------------------------------------
    @classmethod
    def from_carry(cls, cfg: NoteBankConfig, carry: WriterCarry, n_channels: int,
                   model_fingerprint: str) -> "ArchiveWriter":
        """A writer that continues where `carry` was taken (its notes list starts empty)."""
        cfg = cfg.validate()
        carry.validate()
        if (carry.chunk_size, carry.tail) != (cfg.chunk_size, cfg.tail):
            raise ValueError(f"carry was written with chunk_size={carry.chunk_size}, tail={carry.tail}; "
                             f"config has {cfg.chunk_size}, {cfg.tail}")
        J = carry.pending_dist.shape[1]
        if J != n_channels:
            raise ValueError(f"carry has {J} channels, backbone {n_channels}")
        if carry.pending_qc.shape[2] != cfg.addr_dim:
            raise ValueError(f"carry has d_rho={carry.pending_qc.shape[2]}, config addr_dim={cfg.addr_dim}")
        if (carry.q_sum is not None) != (cfg.addr_select == "key_qnovel" and carry.n_chunks > 0):
            raise ValueError("carry's query sum does not match addr_select")
        w = cls(cfg, carry.ids.copy(), carry.sent.copy(), n_channels, model_fingerprint)
        w.base = carry.ids_start
        w.pos = carry.pos
        w._n_chunks = carry.n_chunks
        if carry.n_pending:
            w._buf_dist, w._buf_qc = [carry.pending_dist.clone()], [carry.pending_qc.clone()]
            w._buf_n = carry.n_pending
        if carry.tail_dist.shape[0]:
            w._tail = _Tail(carry.tail_dist.clone(), carry.tail_qc.clone())
        w._q_sum = None if carry.q_sum is None else carry.q_sum.clone()
        return w

    def extend(self, ids: np.ndarray, sent: np.ndarray) -> None:
        """Append the token ids / sentence ids of tokens about to be fed (a resumed document)."""
        ids = np.asarray(ids, dtype=np.int64)
        sent = np.asarray(sent, dtype=np.int64)
        if ids.shape != sent.shape:
            raise ValueError("ids and sentence ids must have the same length")
        self.ids = np.concatenate([self.ids, ids])
        self.sent = np.concatenate([self.sent, sent])

    def refresh_pending(self, dist: torch.Tensor) -> None:
        """Replace the distinctiveness of the buffered pending tokens ([n_pending, J]): a resumed
        read recomputes it once later keys of the same chunk are known (features.ChunkReducer
        prefix_keys)."""
        if tuple(dist.shape) != (self._buf_n, self.J):
            raise ValueError(f"refresh_pending: expected [{self._buf_n}, {self.J}], got {tuple(dist.shape)}")
        if self._buf_n:
            self._buf_dist = [dist.cpu()]

    def carry(self, pending_keys: torch.Tensor | None = None) -> WriterCarry:
        """Snapshot of what continuing needs (pending_keys: [n_pending, J, d_k] raw keys of the
        pending tokens, from ChunkReducer(keep_partial=True).partial_keys())."""
        if self.pos == 0:
            raise ValueError("carry of an empty writer: nothing was read")
        J, d = self.J, self.cfg.addr_dim
        C = self.cfg.chunk_size
        if self._buf_n:
            pd, pq = torch.cat(self._buf_dist).float(), torch.cat(self._buf_qc)
        else:
            pd, pq = torch.zeros(0, J), torch.zeros(0, J, d, dtype=torch.bfloat16)
        if self._tail is not None:
            td, tq = self._tail.dist, self._tail.qc
        else:
            td, tq = torch.zeros(0, J), torch.zeros(0, J, d, dtype=torch.bfloat16)
        start = self._n_chunks * C - td.shape[0]
        lo, hi = start - self.base, self.pos - self.base
        if lo < 0 or hi > len(self.ids):
            raise ValueError("writer does not hold the token ids the carry needs")
        if pending_keys is not None:
            pending_keys = pending_keys.detach().float().cpu()
        return WriterCarry(
            pos=self.pos, n_chunks=self._n_chunks, chunk_size=C, tail=self.cfg.tail, ids_start=start,
            last_sent=int(self.sent[hi - 1]), ids=self.ids[lo:hi].copy(), sent=self.sent[lo:hi].copy(),
            pending_dist=pd.clone(), pending_qc=pq.clone(), tail_dist=td.clone(), tail_qc=tq.clone(),
            pending_keys=None if pending_keys is None else pending_keys.clone(),
            q_sum=None if self._q_sum is None else self._q_sum.clone())

    # ---- write ------------------------------------------------------------------------------
    def feed(self, dist: torch.Tensor, qc: torch.Tensor) -> None:
        """dist: [t, J] fp32, qc: [t, J, d_rho] for the next t tokens of the document."""
        C = self.cfg.chunk_size
        # span selection is host-side numpy: bring each block over once (no-op on CPU)
        dist, qc = dist.cpu(), qc.cpu()
        i = 0
        t = dist.shape[0]
        while i < t:
            take = min(t - i, C - self._buf_n)
            self._buf_dist.append(dist[i:i + take])
            self._buf_qc.append(qc[i:i + take])
            self._buf_n += take
            i += take
            if self._buf_n == C:
                self._write_chunk(torch.cat(self._buf_dist), torch.cat(self._buf_qc))
                self._buf_dist, self._buf_qc, self._buf_n = [], [], 0
        self.pos += t

    def _write_chunk(self, dist: torch.Tensor, qc: torch.Tensor) -> None:
        cfg = self.cfg
        C = cfg.chunk_size
        c_idx = self._n_chunks
        self._n_chunks += 1
        chunk_start = c_idx * C
        if self._tail is not None:
            r_dist = torch.cat([self._tail.dist, dist])
            r_qc = torch.cat([self._tail.qc, qc])
        else:
            r_dist, r_qc = dist, qc
        region_start = chunk_start - (r_dist.shape[0] - C)
        region_end = chunk_start + C
        b = self.base                                            # ids/sent hold [base, ...)
        if region_start < b or region_end - b > len(self.sent):
            raise ValueError(f"writer holds token ids of [{b}, {b + len(self.sent)}), chunk needs "
                             f"[{region_start}, {region_end})")
        scores = r_dist.mean(dim=1).double().numpy()            # d_t, Eq. 3 (channel average)
        sent = self.sent[region_start - b:region_end - b]
        pos_scores = r_dist
        if cfg.addr_select == "key_qnovel":
            # archive-internal statistic: mean query of everything read so far (causal)
            from nbcore.notebank.features import l2_normalize
            chunk_sum = l2_normalize(qc.float()).sum(0)
            self._q_sum = chunk_sum if self._q_sum is None else self._q_sum + chunk_sum
            pos_scores = r_dist * query_novelty(r_qc, self._q_sum)
        for s, e in select_spans(scores, sent, cfg.write_budget, cfg.note_budget, cfg.window):
            self.token_ids.append(self.ids[region_start - b + s:region_start - b + e].astype(np.int32))
            self.starts.append(region_start + s)
            self.ends.append(region_start + e)
            self.chunks.append(c_idx)
            self.addresses.append(assign_addresses(pos_scores, r_qc, s, e, cfg.addr_positions))
        if cfg.tail:
            self._tail = _Tail(dist[C - cfg.tail:].clone(), qc[C - cfg.tail:].clone())

    def finish(self, n_tokens: int | None = None) -> Archive:
        """Close the archive. Pending tokens of an incomplete final chunk write nothing."""
        n = len(self.token_ids)
        slots = self.J * self.cfg.addr_positions
        addr = torch.stack(self.addresses) if n else torch.zeros(0, slots, self.cfg.addr_dim, dtype=torch.bfloat16)
        return Archive(
            token_ids=self.token_ids,
            starts=np.asarray(self.starts, np.int64),
            ends=np.asarray(self.ends, np.int64),
            chunk_index=np.asarray(self.chunks, np.int64),
            addresses=addr.contiguous(),
            config=self.cfg,
            model_fingerprint=self.fp,
            n_tokens=int(self.pos if n_tokens is None else n_tokens),
        )
