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
from nbcore.notebank.route import native_votes


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


@register_router("native")
def native_router(rq: RouteQuery) -> np.ndarray:
    u = rq.probe()
    t0 = time.perf_counter()
    votes = native_votes(u, keys=rq.archive.routing_keys())
    rq.route_s += time.perf_counter() - t0
    return votes.numpy().astype(np.float64)


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
