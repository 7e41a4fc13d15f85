"""NoteBank end to end on one document: ingest (write) and answer (address, replay, generate).

Algorithm 1 of the paper:
  1. Write   - read the context chunk by chunk with carried state, archive top-W spans per chunk.
  2. Address - process the question from a copy of S_T, vote (Eq. 5), keep top-R; copy discarded.
  3. Read    - from a fresh copy of S_T, replay the notes in document order, then the question,
               then generate greedily (Eq. 6). Position ids continue from the context end.

Methods: plain, jrt (context and question read twice), notebank, clean_start (state scaled by
lam, default 0, before the question); `lam` with notebank rescales before replay (App. C.3).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from nbcore.backbones.base import Backbone, BackboneState
from nbcore.config import NoteBankConfig, ReadConfig
from nbcore.notebank.archive import Archive
from nbcore.notebank.features import ChunkReducer, projection_coords
from nbcore.notebank.route import top_r
from nbcore.notebank.routers import RouteQuery, get_router
from nbcore.notebank.sentences import tokenize_with_sentences
from nbcore.notebank.write import ArchiveWriter, WriterCarry
from nbcore.notebank.write_device import DeviceArchiveWriter


@dataclass
class IngestResult:
    state: BackboneState
    archive: Archive
    n_tokens: int
    timings: dict = field(default_factory=dict)
    token_ids: np.ndarray | None = None     # the context's ids (kept for JRT / oracle diagnostics)
    also_archives: list = field(default_factory=list)   # archives of ingest(..., also=cfgs), same order
    carry: WriterCarry | None = None       # writer carry at the end (for `append`); None when write=False


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    retrieved: list[int]          # note indices, document order
    votes: list[float]            # router score of each retrieved note (votes for `native`)
    replay_len: int
    n_question_tokens: int
    timings: dict = field(default_factory=dict)


_COORDS: dict[tuple, torch.Tensor] = {}


def coords_for(bb: Backbone, cfg: NoteBankConfig) -> torch.Tensor:
    """The fixed projection P ([J, d_rho]) for this backbone's channel layout and config seed."""
    key = (bb.n_channels, bb.key_dim, cfg.addr_dim, cfg.seed)
    if key not in _COORDS:
        _COORDS[key] = projection_coords(bb.n_channels, bb.key_dim, cfg.addr_dim, cfg.seed)
    return _COORDS[key]


def encode_context(bb: Backbone, text: str | None, token_ids=None, add_special_tokens: bool = True):
    """-> (ids [T] int64, sentence ids [T]). Without a tokenizer, token_ids are required and the
    whole document is one sentence (notes are then B-token cuts at the best window).
    add_special_tokens=False: how `encode_parts`/`append` tokenise every part after the first."""
    ids, sent, _ = _encode_part(bb, text, token_ids, add_special_tokens)
    return ids, sent


def _encode_part(bb: Backbone, text, token_ids, add_special_tokens: bool = True):
    """-> (ids, sentence ids from 0, segmented): segmented = the sentence ids come from the text's
    own segmentation (False: token ids only, one sentence of id 0)."""
    if token_ids is not None:
        ids = np.asarray(token_ids, dtype=np.int64)
        if text is not None and bb.tokenizer is not None:
            _, sent = tokenize_with_sentences(bb.tokenizer, text, add_special_tokens)
            if len(sent) != len(ids):
                raise ValueError("token_ids do not match the tokenisation of text")
            return ids, sent, True
        return ids, np.zeros(len(ids), np.int64), False
    if text is None:
        raise ValueError("ingest needs text or token_ids")
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    if bb.tokenizer is None:
        raise ValueError("this backbone has no tokenizer: pass token_ids")
    ids, sent = tokenize_with_sentences(bb.tokenizer, text, add_special_tokens)
    return ids, sent, True


JOIN_RULE = """\
A document that grows by parts is the concatenation of its parts, each tokenised on its own (no
re-tokenisation across a join; the first part exactly as `ingest` tokenises a document, every
later part without the tokenizer's special tokens). Each text part's sentence ids come from its
own sentence segmentation, offset to continue after the previous part's last sentence id: the
join is always a sentence boundary. A part given as token ids only (no text) has no segmentation:
it continues the previous part's last sentence (the first such part is sentence 0, as in
`ingest`), so append(token_ids=b) after ingest(token_ids=a) equals ingest(token_ids=a + b)."""


def _continue_sentences(sent: np.ndarray, segmented: bool, last_sent: int | None) -> np.ndarray:
    if last_sent is None:
        return sent
    return sent + (last_sent + 1 if segmented else last_sent)


def encode_parts(bb: Backbone, parts) -> tuple[np.ndarray, np.ndarray]:
    """-> (ids [T], sentence ids [T]) of a document given as parts, by the join rule (JOIN_RULE):
    what `ingest(bb, parts=...)` reads and what a chain of `append` calls reproduces. Each part
    is a str (tokenised) or a sequence of token ids."""
    if isinstance(parts, (str, bytes)) or len(parts) == 0:
        raise ValueError("parts must be a non-empty list of texts or token-id sequences")
    all_ids, all_sent, last = [], [], None
    for i, part in enumerate(parts):
        text, tids = (part, None) if isinstance(part, str) else (None, part)
        ids, sent, seg = _encode_part(bb, text, tids, add_special_tokens=(i == 0))
        if len(ids) == 0:
            raise ValueError(f"part {i} is empty")
        sent = _continue_sentences(sent, seg, last)
        last = int(sent[-1])
        all_ids.append(ids)
        all_sent.append(sent)
    return np.concatenate(all_ids), np.concatenate(all_sent)


def encode_question(bb: Backbone, question) -> torch.Tensor:
    if isinstance(question, str):
        if bb.tokenizer is None:
            raise ValueError("this backbone has no tokenizer: pass the question as token ids")
        ids = bb.tokenizer(question, add_special_tokens=False)["input_ids"]
    else:
        ids = list(question)
    if len(ids) == 0:
        raise ValueError("empty question")
    return torch.tensor(ids, dtype=torch.long)


# Writers: "device" keeps span selection and addressing on the features' device (one to three
# host syncs per block, only the notes' address rows cross); "reference" is the naive host-side
# numpy writer it is tested against (byte-identical archives on CPU, tests/test_write_device.py).
WRITERS = {"device": DeviceArchiveWriter, "reference": ArchiveWriter}
DEFAULT_WRITER = "device"


def writer_class(name: str | None = None) -> type[ArchiveWriter]:
    """The writer `ingest`/`append` use: `name`, else DEFAULT_WRITER."""
    name = DEFAULT_WRITER if name is None else name
    if name not in WRITERS:
        raise ValueError(f"unknown writer {name!r}; one of {sorted(WRITERS)}")
    return WRITERS[name]


FEATURE_FIELDS = ("chunk_size", "addr_dim", "seed")   # what the per-chunk feature stream depends on


def ingest(bb: Backbone, text: str | None = None, cfg: NoteBankConfig | None = None, *,
           token_ids=None, block_size: int = 8192, write: bool = True, progress=None,
           also: tuple[NoteBankConfig, ...] | list = (), parts=None, writer: str | None = None) -> IngestResult:
    """Read a document with carried state and write its archive (`ingest_steps`, run to the end).

    parts: the document as a list of parts (texts or token-id sequences) joined by the join rule
    of `append` (see `encode_parts`); instead of text/token_ids. `IngestResult.carry` lets
    `append` continue the document later.

    block_size: tokens per backbone call (rounded down to a multiple of C, at least C). Archives
    do not depend on it (features are reduced per C-token chunk). write=False = plain prefill
    (same blocks, no capture): the baseline of the overhead benchmarks.
    also: further writer configs fed from the SAME pass (e.g. the addressing variants, which
    change only how notes are written); each must share `cfg`'s FEATURE_FIELDS. Their archives
    equal separate ingests' (tested) and land in `IngestResult.also_archives`.
    writer: "device" or "reference" (see WRITERS; default DEFAULT_WRITER); same archives."""
    steps = ingest_steps(bb, text, cfg, token_ids=token_ids, block_size=block_size, write=write,
                         progress=progress, also=also, parts=parts, writer=writer)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def ingest_steps(bb: Backbone, text: str | None = None, cfg: NoteBankConfig | None = None, *,
                 token_ids=None, block_size: int = 8192, write: bool = True, progress=None,
                 also: tuple[NoteBankConfig, ...] | list = (), parts=None, writer: str | None = None):
    """`ingest` one step at a time: a generator that yields the tokens read so far, first 0 once
    the input is checked and tokenised, then after each block's forward and write; its return value
    (StopIteration.value) is the IngestResult. Arguments as `ingest`. Why: a caller can interleave
    two reads block by block on one core (bench/overhead.py --interleave block), so that a noisy
    host's slow phases fall on both alike."""
    cfg = (cfg or NoteBankConfig()).validate()
    also = [c.validate() for c in also]
    for c in also:
        bad = [f for f in FEATURE_FIELDS if getattr(c, f) != getattr(cfg, f)]
        if bad:
            raise ValueError(f"ingest(also=...): configs must share {FEATURE_FIELDS} with cfg; differ in {bad}")
    if also and not write:
        raise ValueError("ingest(also=...) needs write=True")
    if parts is not None:
        if text is not None or token_ids is not None:
            raise ValueError("ingest: pass parts OR text/token_ids")
        ids, sent = encode_parts(bb, parts)
    else:
        ids, sent = encode_context(bb, text, token_ids)
    T = len(ids)
    if T == 0:
        raise ValueError("empty document: nothing to read")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    yield 0
    C = cfg.chunk_size
    block = max(C, (block_size // C) * C)
    fp = bb.fingerprint()
    W = writer_class(writer)
    writer = W(cfg, ids, sent, bb.n_channels, fp) if write else None
    extra = [W(c, ids, sent, bb.n_channels, fp) for c in also]
    coords = coords_for(bb, cfg)
    state = bb.new_state()
    t_fwd = t_write = 0.0
    ids_t = torch.from_numpy(ids)
    tap = None
    reuse = None                       # the previous block's feature buffers, written again
    for b0 in range(0, T, block):
        chunk = ids_t[b0:b0 + block]
        t0 = time.perf_counter()
        if writer is not None:
            tap = ChunkReducer(coords, bb.heads_per_layer, C, offset=b0, keep_partial=True, n_tokens=len(chunk),
                               buffers=reuse)
            bb.forward(state, chunk, tap=tap, need_logits=False)
            t1 = time.perf_counter()
            dist, qc = tap.result()
            writer.feed(dist, qc)
            for w in extra:
                w.feed(dist, qc)
            # writers copy what they keep of a block that ends on a chunk boundary (every block
            # but maybe the last), so its buffers can take the next block
            reuse = (dist, qc) if len(chunk) % C == 0 else None
            t_write += time.perf_counter() - t1
            t_fwd += t1 - t0
        else:
            bb.forward(state, chunk, need_logits=False)
            t_fwd += time.perf_counter() - t0
        if progress is not None:
            progress(len(chunk))
        yield b0 + len(chunk)
    archive = writer.finish(T) if writer is not None else Archive.empty(bb.n_channels, cfg, fp, T)
    carry = writer.carry(pending_keys=tap.partial_keys()) if writer is not None else None
    return IngestResult(state, archive, T, {"prefill_s": t_fwd, "write_s": t_write}, ids,
                        [w.finish(T) for w in extra], carry)


def _concat_archives(old: Archive, new: Archive) -> Archive:
    """old's notes then new's (fresh containers: neither input is touched)."""
    return Archive(
        token_ids=[t.copy() for t in old.token_ids] + list(new.token_ids),
        starts=np.concatenate([old.starts, new.starts]).astype(np.int64),
        ends=np.concatenate([old.ends, new.ends]).astype(np.int64),
        chunk_index=np.concatenate([old.chunk_index, new.chunk_index]).astype(np.int64),
        addresses=torch.cat([old.addresses, new.addresses.to(old.addresses.device)]).contiguous(),
        config=old.config,
        model_fingerprint=old.model_fingerprint,
        n_tokens=new.n_tokens,
    )


def append(bb: Backbone, state: BackboneState, archive: Archive, carry: WriterCarry | dict,
           text: str | None = None, cfg: NoteBankConfig | None = None, *, token_ids=None,
           block_size: int = 8192, progress=None, writer: str | None = None) -> IngestResult:
    """Continue an ingested document with a new part: the forward from (a copy of) `state`, the
    writer from `carry` (IngestResult.carry, or its `to_tensors()` dict). Neither `state` nor
    `archive` is mutated. -> IngestResult(state after all tokens, the FULL archive = archive's
    notes unchanged + the notes of chunks completed now, n_tokens = document length, carry for the
    next append; token_ids = the ids of this part only).

    Join rule (also `encode_parts`, `ingest(parts=...)`; the same text is `JOIN_RULE`):
    A document that grows by parts is the concatenation of its parts, each tokenised on its own (no
    re-tokenisation across a join; the first part exactly as `ingest` tokenises a document, every
    later part without the tokenizer's special tokens). Each text part's sentence ids come from its
    own sentence segmentation, offset to continue after the previous part's last sentence id: the
    join is always a sentence boundary. A part given as token ids only (no text) has no segmentation:
    it continues the previous part's last sentence (the first such part is sentence 0, as in
    `ingest`), so append(token_ids=b) after ingest(token_ids=a) equals ingest(token_ids=a + b).

    Equality: append(ingest(a), b) equals ingest(parts=[a, b]): note spans, chunk indices and
    note token ids identical; addresses (bf16) and state tensors equal up to float reassociation
    (the kernels see other block boundaries). tests/test_append.py checks fp32 state tensors to
    atol 1e-5 and addresses to one bf16 step (|a - b| <= 2**-7 |b| + 1e-6); measured on the tiny
    CPU backbones: state <= 1e-6 (GDN/attention hybrid; pure GDN 0, Mamba-2 4e-9), addresses 0.
    Bit-identical when the append point is a multiple of the (chunk-rounded) block size.

    Blocks: one-shot ingest feeds [0, block), [block, 2 block), ...; append at position p feeds
    [p, next multiple of block), then aligned blocks, so for p a multiple of block the backbone
    calls are exactly one-shot's. If p falls inside a chunk, the pending tokens' raw keys
    (carry.pending_keys) join that chunk's mean key (Eq. 3) as in one pass.
    writer: as in `ingest` (a carry from either writer resumes in either)."""
    if carry is None:
        raise ValueError("append needs the writer carry of the previous read (IngestResult.carry)")
    if isinstance(carry, dict):
        carry = WriterCarry.from_tensors(carry)
    cfg = (cfg or archive.config).validate()
    if cfg != archive.config:
        raise ValueError("append: cfg differs from the archive's config")
    fp = bb.fingerprint()
    if archive.model_fingerprint != fp:
        raise ValueError("archive was written by a different model (fingerprint mismatch)")
    p = carry.pos
    if state.n_tokens != p or archive.n_tokens != p:
        raise ValueError(f"append: state ({state.n_tokens}), archive ({archive.n_tokens}) and carry ({p}) "
                         "are not at the same document position")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    ids, sent, seg = _encode_part(bb, text, token_ids, add_special_tokens=False)
    if len(ids) == 0:
        raise ValueError("append: empty part, nothing to read")
    sent = _continue_sentences(sent, seg, carry.last_sent)
    C = cfg.chunk_size
    block = max(C, (block_size // C) * C)
    prefix = None
    if carry.n_pending:
        if carry.pending_keys is None:
            raise ValueError("append: carry has pending tokens but no pending_keys")
        prefix = carry.pending_keys
    writer = writer_class(writer).from_carry(cfg, carry, bb.n_channels, fp)
    writer.extend(ids, sent)
    coords = coords_for(bb, cfg)
    state = bb.copy_state(state)
    end = p + len(ids)
    ids_t = torch.from_numpy(ids)
    t_fwd = t_write = 0.0
    b0 = p
    tap = None
    while b0 < end:
        b1 = min(end, (b0 // block + 1) * block)
        t0 = time.perf_counter()
        tap = ChunkReducer(coords, bb.heads_per_layer, C, offset=b0,
                           prefix_keys=prefix if b0 == p else None, keep_partial=True, n_tokens=b1 - b0)
        bb.forward(state, ids_t[b0 - p:b1 - p], tap=tap, need_logits=False)
        t1 = time.perf_counter()
        dist, qc = tap.result()
        if b0 == p and prefix is not None:
            writer.refresh_pending(tap.prefix_dist())
        writer.feed(dist, qc)
        t_write += time.perf_counter() - t1
        t_fwd += t1 - t0
        if progress is not None:
            progress(b1 - b0)
        b0 = b1
    new = writer.finish(end)
    return IngestResult(state, _concat_archives(archive, new), end,
                        {"prefill_s": t_fwd, "write_s": t_write}, ids, [],
                        writer.carry(pending_keys=tap.partial_keys()))


def _generate(bb, state, logits, rc: ReadConfig) -> tuple[list[int], str]:
    toks = bb.generate(state, logits, rc.max_new_tokens, stop=rc.stop, stop_at_eos=rc.stop_at_eos)
    text = bb.tokenizer.decode(toks, skip_special_tokens=True) if bb.tokenizer is not None else ""
    for s in rc.stop:
        if s and s in text:
            text = text[: text.index(s)]
    return toks, text


def answer(bb: Backbone, state: BackboneState, archive: Archive, question, rc: ReadConfig | None = None, *,
           answers: list[str] | None = None, context_ids=None) -> Answer:
    """Answer one question from the retained state S_T (never mutated: every branch copies it)."""
    rc = (rc or ReadConfig()).validate()
    q_ids = encode_question(bb, question)
    timings = {"probe_s": 0.0, "route_s": 0.0, "replay_generate_s": 0.0}
    retrieved: list[int] = []
    scores: list[float] = []
    replay = torch.zeros(0, dtype=torch.long)

    if rc.method == "notebank" and len(archive) > 0:
        if archive.model_fingerprint != bb.fingerprint():
            raise ValueError("archive was written by a different model (fingerprint mismatch)")
        rq = RouteQuery(bb, state, archive, question if isinstance(question, str) else None, q_ids,
                        answers, coords_for(bb, archive.config))
        note_scores = get_router(rc.router)(rq)            # probes from a copy when it needs to
        timings["probe_s"] = rq.probe_s
        t0 = time.perf_counter()
        retrieved = top_r(note_scores, rc.top_r, archive.starts)
        scores = [float(note_scores[i]) for i in retrieved]
        timings["route_s"] = rq.route_s + (time.perf_counter() - t0)
        if retrieved:
            replay = torch.from_numpy(np.concatenate([archive.token_ids[i] for i in retrieved]).astype(np.int64))

    t0 = time.perf_counter()
    s = bb.copy_state(state)
    if rc.method == "jrt":
        if context_ids is None:
            raise ValueError("jrt re-reads the context: pass context_ids")
        bb.forward(s, q_ids, need_logits=False)
        bb.forward(s, torch.as_tensor(np.asarray(context_ids), dtype=torch.long), need_logits=False)
    lam = rc.lam_for(int(state.n_tokens))
    if lam is not None and rc.method in ("notebank", "clean_start", "plain"):
        bb.reset_state(s, float(lam))
    with bb.reading():                     # read adapters (if any) on: replay, question, answer
        if len(replay):
            bb.forward(s, replay, need_logits=False)
        logits = bb.forward(s, q_ids)
        toks, text = _generate(bb, s, logits, rc)
    timings["replay_generate_s"] = time.perf_counter() - t0
    return Answer(text, toks, retrieved, scores, int(len(replay)), int(len(q_ids)), timings)


def run_example(bb: Backbone, context: str, question: str, nb_cfg: NoteBankConfig | None = None,
                read_cfgs: list[ReadConfig] | None = None, answers: list[str] | None = None,
                block_size: int = 8192) -> tuple[IngestResult, list[Answer]]:
    """One-pass evaluation: ingest once, answer with every read config from copies of S_T."""
    res = ingest(bb, context, nb_cfg, block_size=block_size)
    outs = [answer(bb, res.state, res.archive, question, rc, answers=answers, context_ids=res.token_ids)
            for rc in (read_cfgs or [ReadConfig()])]
    return res, outs
