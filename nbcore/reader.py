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
from nbcore.notebank.write import ArchiveWriter


@dataclass
class IngestResult:
    state: BackboneState
    archive: Archive
    n_tokens: int
    timings: dict = field(default_factory=dict)
    token_ids: np.ndarray | None = None     # the context's ids (kept for JRT / oracle diagnostics)
    also_archives: list = field(default_factory=list)   # archives of ingest(..., also=cfgs), same order


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


def encode_context(bb: Backbone, text: str | None, token_ids=None):
    """-> (ids [T] int64, sentence ids [T]). Without a tokenizer, token_ids are required and the
    whole document is one sentence (notes are then B-token cuts at the best window)."""
    if token_ids is not None:
        ids = np.asarray(token_ids, dtype=np.int64)
        if text is not None and bb.tokenizer is not None:
            _, sent = tokenize_with_sentences(bb.tokenizer, text)
            if len(sent) != len(ids):
                raise ValueError("token_ids do not match the tokenisation of text")
        else:
            sent = np.zeros(len(ids), np.int64)
        return ids, sent
    if text is None:
        raise ValueError("ingest needs text or token_ids")
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    if bb.tokenizer is None:
        raise ValueError("this backbone has no tokenizer: pass token_ids")
    return tokenize_with_sentences(bb.tokenizer, text)


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


FEATURE_FIELDS = ("chunk_size", "addr_dim", "seed")   # what the per-chunk feature stream depends on


def ingest(bb: Backbone, text: str | None = None, cfg: NoteBankConfig | None = None, *,
           token_ids=None, block_size: int = 8192, write: bool = True, progress=None,
           also: tuple[NoteBankConfig, ...] | list = ()) -> IngestResult:
    """Read a document with carried state and write its archive.

    block_size: tokens per backbone call (rounded down to a multiple of C, at least C). Archives
    do not depend on it (features are reduced per C-token chunk). write=False = plain prefill
    (same blocks, no capture): the baseline of the overhead benchmarks.
    also: further writer configs fed from the SAME pass (e.g. the addressing variants, which
    change only how notes are written); each must share `cfg`'s FEATURE_FIELDS. Their archives
    equal separate ingests' (tested) and land in `IngestResult.also_archives`."""
    cfg = (cfg or NoteBankConfig()).validate()
    also = [c.validate() for c in also]
    for c in also:
        bad = [f for f in FEATURE_FIELDS if getattr(c, f) != getattr(cfg, f)]
        if bad:
            raise ValueError(f"ingest(also=...): configs must share {FEATURE_FIELDS} with cfg; differ in {bad}")
    if also and not write:
        raise ValueError("ingest(also=...) needs write=True")
    ids, sent = encode_context(bb, text, token_ids)
    T = len(ids)
    if T == 0:
        raise ValueError("empty document: nothing to read")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    C = cfg.chunk_size
    block = max(C, (block_size // C) * C)
    fp = bb.fingerprint()
    writer = ArchiveWriter(cfg, ids, sent, bb.n_channels, fp) if write else None
    extra = [ArchiveWriter(c, ids, sent, bb.n_channels, fp) for c in also]
    coords = coords_for(bb, cfg)
    state = bb.new_state()
    t_fwd = t_write = 0.0
    ids_t = torch.from_numpy(ids)
    for b0 in range(0, T, block):
        chunk = ids_t[b0:b0 + block]
        t0 = time.perf_counter()
        if writer is not None:
            tap = ChunkReducer(coords, bb.heads_per_layer, C, offset=b0)
            bb.forward(state, chunk, tap=tap, need_logits=False)
            t1 = time.perf_counter()
            dist, qc = tap.result()
            writer.feed(dist, qc)
            for w in extra:
                w.feed(dist, qc)
            t_write += time.perf_counter() - t1
            t_fwd += t1 - t0
        else:
            bb.forward(state, chunk, need_logits=False)
            t_fwd += time.perf_counter() - t0
        if progress is not None:
            progress(len(chunk))
    archive = writer.finish(T) if writer is not None else Archive.empty(bb.n_channels, cfg, fp, T)
    return IngestResult(state, archive, T, {"prefill_s": t_fwd, "write_s": t_write}, ids,
                        [w.finish(T) for w in extra])


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
    lam = rc.lam
    if rc.method == "clean_start" and lam is None:
        lam = 0.0
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
