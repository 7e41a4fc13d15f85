"""NB-LoRA training step in pure PyTorch (paper App. B.4, Eq. 10; App. C.4). No ray here:
`pipeline/train_lora.py` runs this on Ray Train workers and passes `reduce_fn` for the gradient
all-reduce.

One example (context X, question Q, gold answer Y):
  1. Write + address, adapters OFF, no grad (`Backbone.forward` outside `reading()`): read X chunk by
     chunk into S_T and write its archive with the configured C, W, B (online, per example); probe
     Q from a copy of S_T and keep the top-R notes (the configured router, default native Eq. 5).
     A context shorter than C leaves the archive empty: zero replay tokens, a plain read (App. B.4).
     `replay=False` is the plain-LoRA control (no archive, no replay; paper Table 4).
  2. Read, adapters ON, with grad: from a copy of S_T (a constant), one forward over
     [replay, Q, Y_1..Y_{n-1}] and the loss of Eq. 10,
         L = -1/|Y~| sum_t log p(Y~_t | S_read, R, Q, Y~_<t),
     where Y~ = the first `max_answer_tokens` (47) answer tokens followed by EOS. Only answer
     tokens (and EOS) contribute; gradients flow through replay and question processing into the
     adapters; note selection and S_T are constants.

The copied cache is made "out of place" for the differentiable forward (transformers updates
linear-attention caches with in-place `copy_`, which autograd refuses when the initial state is
saved for backward): `_grad_safe_cache` swaps the two update methods of each linear-attention cache
layer for assignment-based ones while the copy is used; the copy is discarded afterwards.

An update = `examples_per_update` (4) examples, global across workers: each example's mean NLL is
summed into the gradients, gradients and counts are summed over workers, then divided by the
number of valid examples (so the update is the mean of per-example Eq. 10 losses), clipped to
1.0 and applied by AdamW (lr 5e-4, wd 0.01, constant lr: the paper names no schedule).

Bad examples (empty answer or question, an answer that tokenises to nothing, a non-string field)
raise `BadExample` (or the reader's ValueError/TypeError) in `prepare`; `train_update` counts
and skips them (`skipped` metric, warning log), never crashing the worker. A context shorter
than C is not bad: it is read with an empty archive (zero replay tokens).
"""
from __future__ import annotations

import contextlib
import logging
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from nbcore.config import NoteBankConfig, ReadConfig
from nbcore.lora import LoraSpec
from nbcore.training.configs import LoraTrainConfig  # noqa: F401  (torch-free home)

log = logging.getLogger(__name__)


class BadExample(ValueError):
    """An example that cannot be trained on (the message says why)."""


def _eos_id(bb) -> int:
    tok = bb.tokenizer
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        return int(tok.eos_token_id)
    eos = getattr(bb.model.config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None:
        raise ValueError("backbone has no EOS token id (tokenizer or config.eos_token_id)")
    return int(eos)


def target_text(ex: dict, question: str, lead: str = " ") -> str:
    """The supervised answer string: `target` if the example has one (synthetic data: the RULER
    answer continuation), else the first gold answer, with `lead` when the question does not end
    in whitespace and the answer does not start with it."""
    t = ex.get("target")
    if t is None:
        answers = ex.get("answers")
        if isinstance(answers, str):
            answers = [answers]
        if not answers:
            raise BadExample("example has no answer")
        t = answers[0]
    if not isinstance(t, str) or not t.strip():
        raise BadExample("empty answer")
    if lead and question and not question[-1].isspace() and not t[0].isspace():
        t = lead + t
    return t


def answer_targets(bb, text: str, max_tokens: int = 47) -> torch.Tensor:
    """Y~: the first `max_tokens` answer tokens, then EOS (App. C.4: at most 47 + EOS)."""
    if bb.tokenizer is None:
        raise ValueError("answer targets need a tokenizer")
    ids = bb.tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    if not ids:
        raise BadExample(f"answer {text!r} tokenises to nothing")
    return torch.tensor(ids + [_eos_id(bb)], dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# step 1: write + address (adapters off, no grad)

@dataclass
class ReadExample:
    state: object                  # S_T (BackboneState), never mutated
    replay: torch.Tensor           # [<= R*B] replayed note tokens, document order
    q_ids: torch.Tensor            # [|Q|]
    y_ids: torch.Tensor            # [|Y~|] answer tokens + EOS
    retrieved: list = field(default_factory=list)
    n_context: int = 0
    n_notes: int = 0
    timings: dict = field(default_factory=dict)


def select_notes(bb, state, archive, question: str, q_ids: torch.Tensor, top_r: int, router: str = "native",
                 answers=None) -> tuple[list[int], torch.Tensor]:
    """Top-R retrieval exactly as `nbcore.reader.answer` does it (probe from a copy of S_T with
    adapters off, router scores, shared top-R, document order) -> (note indices, replay ids)."""
    from nbcore.notebank.route import top_r as pick
    from nbcore.notebank.routers import RouteQuery, get_router
    from nbcore.reader import coords_for
    if len(archive) == 0:
        return [], torch.zeros(0, dtype=torch.long)
    if bb._read_mode:
        raise RuntimeError("select_notes must run outside Backbone.reading() (adapters off for retrieval)")
    rq = RouteQuery(bb, state, archive, question, q_ids, answers, coords_for(bb, archive.config))
    scores = get_router(router)(rq)
    chosen = pick(scores, top_r, archive.starts)
    if not chosen:
        return [], torch.zeros(0, dtype=torch.long)
    replay = torch.from_numpy(np.concatenate([archive.token_ids[i] for i in chosen]).astype(np.int64))
    return chosen, replay


def prepare(bb, ex: dict, cfg: LoraTrainConfig) -> ReadExample:
    """Online notes and routing for one example (adapters off, no grad)."""
    from nbcore.reader import encode_question, ingest
    question = ex.get("question")
    if not isinstance(question, str) or not question.strip():
        raise BadExample("empty question")
    context = ex.get("context") or ""
    if not isinstance(context, str):
        raise BadExample(f"context must be a string, got {type(context).__name__}")
    y = answer_targets(bb, target_text(ex, question, cfg.answer_lead), cfg.max_answer_tokens)
    q_ids = encode_question(bb, question)
    t0 = time.perf_counter()
    if context:
        res = ingest(bb, context, cfg.nb_config(), block_size=cfg.block_size, write=cfg.replay)
        state, archive, n_ctx = res.state, res.archive, res.n_tokens
    else:                           # no context at all: read the question from the initial state
        state, archive, n_ctx = bb.new_state(), None, 0
    t1 = time.perf_counter()
    chosen, replay = [], torch.zeros(0, dtype=torch.long)
    if cfg.replay and archive is not None and len(archive):
        answers = ex.get("answers") if cfg.router == "oracle" else None
        chosen, replay = select_notes(bb, state, archive, question, q_ids, cfg.top_r, cfg.router, answers)
    t2 = time.perf_counter()
    return ReadExample(state, replay, q_ids, y, chosen, n_ctx, len(archive) if archive is not None else 0,
                       {"ingest_s": t1 - t0, "route_s": t2 - t1})


# ---------------------------------------------------------------------------------------------
# step 2: differentiable read (adapters on)

@contextlib.contextmanager
def _grad_safe_cache(cache):
    """Make the linear-attention layers of `cache` update by assignment instead of in-place copy_
    (autograd-safe); restores the class methods on exit."""
    patched = []
    for layer in getattr(cache, "layers", []) or []:
        if not hasattr(layer, "update_recurrent_state") or not hasattr(layer, "conv_states"):
            continue

        def update_recurrent_state(recurrent_states, state_idx=0, _l=layer, **kw):
            if not _l.is_recurrent_states_initialized[state_idx]:
                _l.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
            _l.recurrent_states[state_idx] = recurrent_states
            return recurrent_states

        def update_conv_state(conv_states, state_idx=0, conv_kernel_size=None, _l=layer, **kw):
            if not _l.is_conv_states_initialized[state_idx]:
                _l.lazy_initialization(conv_states=conv_states, state_idx=state_idx,
                                       conv_kernel_size=conv_kernel_size)
            k = _l.conv_kernel_size[state_idx]
            if not _l.has_previous_state[state_idx]:
                full = conv_states
                _l.has_previous_state[state_idx] = True
                if full.shape[-1] < k:
                    full = F.pad(full, (k - full.shape[-1], 0))
            else:
                full = torch.cat([_l.conv_states[state_idx], conv_states], dim=-1)
            _l.conv_states[state_idx] = full[..., -k:]
            return full

        layer.update_recurrent_state = update_recurrent_state
        layer.update_conv_state = update_conv_state
        patched.append(layer)
    try:
        yield
    finally:
        for l in patched:
            del l.update_recurrent_state
            del l.update_conv_state


def read_logits(bb, state, ids: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Differentiable forward over `ids` [T] continuing from `state` (mutated: pass a copy), with
    adapters ON. -> logits of the last `n_keep` positions [n_keep, V] (fp32)."""
    if ids.dim() != 1 or ids.numel() < 2:
        raise ValueError("the read sequence needs >= 2 tokens (question + answer)")
    dev = bb.device
    with bb.reading(), bb._adapter_ctx(), torch.enable_grad():
        if bb.family == "fla-gdn":
            out = bb.model(input_ids=ids.to(dev)[None], past_key_values=state.cache, use_cache=True,
                           logits_to_keep=n_keep)
        else:
            with _grad_safe_cache(state.cache):
                out = bb.model(input_ids=ids.to(dev)[None], cache=state.cache, use_cache=True,
                               logits_to_keep=n_keep)
    return out.logits[0].float()


def read_nll(bb, rex: ReadExample, lam: float | None = None) -> torch.Tensor:
    """Eq. 10: mean NLL of Y~ (answer tokens + EOS) given S_read, R, Q. Differentiable w.r.t. the
    adapters; S_T is copied (constant)."""
    s = bb.copy_state(rex.state)
    if lam is not None:
        bb.reset_state(s, float(lam))
    y = rex.y_ids
    seq = torch.cat([rex.replay, rex.q_ids, y[:-1]])
    logits = read_logits(bb, s, seq, len(y))          # position of Q_last .. Y_{n-1} predict Y_1 .. Y_n
    return F.cross_entropy(logits, y.to(logits.device), reduction="mean")


# ---------------------------------------------------------------------------------------------
# updates

def example_order(n: int, seed: int, epoch: int) -> list[int]:
    """Example permutation of one pass over the data (seeded; epoch 0 = the paper's single shuffle)."""
    idx = list(range(n))
    random.Random(f"nb-lora|{seed}|{epoch}").shuffle(idx)
    return idx


def examples_for_update(update: int, n: int, cfg: LoraTrainConfig, rank: int = 0, world: int = 1) -> list[int]:
    """Dataset indices this worker processes in `update` (0-based): global slots
    [update*E, (update+1)*E) over seeded epoch permutations, slot j -> worker j % world."""
    if n <= 0:
        raise ValueError("empty training set")
    E = cfg.examples_per_update
    out, cache = [], {}
    for j in range(E):
        if j % world != rank:
            continue
        g = update * E + j
        epoch, pos = divmod(g, n)
        if epoch not in cache:
            cache[epoch] = example_order(n, cfg.seed, epoch)
        out.append(cache[epoch][pos])
    return out


def make_optimizer(params, cfg: LoraTrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def train_update(bb, params: list, opt: torch.optim.Optimizer, batch: list[dict], cfg: LoraTrainConfig,
                 reduce_fn=None) -> dict:
    """One AdamW update over this worker's share of the examples.

    reduce_fn(tensor) -> tensor summed over workers (None: single process). Returns metrics."""
    t0 = time.perf_counter()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
    loss_sum, n_ok, n_bad, n_tok, n_replay = 0.0, 0, 0, 0, 0
    t_prep = t_read = 0.0
    bad_reasons = []
    for ex in batch:
        ta = time.perf_counter()
        try:
            rex = prepare(bb, ex, cfg)
        except (BadExample, ValueError, TypeError) as e:     # bad input: counted, never fatal
            n_bad += 1
            bad_reasons.append(str(e))
            log.warning("skipping example %s: %s", ex.get("id", "?"), e)
            continue
        tb = time.perf_counter()
        loss = read_nll(bb, rex, cfg.lam)
        loss.backward()
        t_prep += tb - ta
        t_read += time.perf_counter() - tb
        loss_sum += float(loss.detach())
        n_ok += 1
        n_tok += int(len(rex.y_ids))
        n_replay += int(len(rex.replay))
    stats = torch.tensor([loss_sum, n_ok, n_bad, n_tok, n_replay], dtype=torch.float64)
    flat = torch.cat([p.grad.reshape(-1) for p in params]) if params else torch.zeros(0)
    if reduce_fn is not None:
        stats = reduce_fn(stats)
        flat = reduce_fn(flat)
    total_ok = int(stats[1])
    metrics = {
        "loss": float(stats[0] / total_ok) if total_ok else float("nan"),
        "examples": total_ok, "skipped": int(stats[2]),
        "answer_tokens": int(stats[3]), "replay_tokens_mean": float(stats[4] / total_ok) if total_ok else 0.0,
        "lr": opt.param_groups[0]["lr"], "prepare_s": t_prep, "read_s": t_read,
    }
    if total_ok == 0:                       # nothing valid anywhere: no update
        metrics.update(grad_norm=0.0, updated=False, step_s=time.perf_counter() - t0)
        return metrics
    flat = flat / total_ok
    off = 0
    for p in params:
        k = p.numel()
        p.grad.copy_(flat[off:off + k].view_as(p).to(p.grad.dtype))
        off += k
    gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
    opt.step()
    metrics.update(grad_norm=float(gnorm), updated=True, step_s=time.perf_counter() - t0)
    if bad_reasons:
        metrics["skip_reasons"] = sorted(set(bad_reasons))
    return metrics


def train_local(bb, data: list[dict], cfg: LoraTrainConfig, log_fn=None, start_update: int = 0, opt=None) -> list[dict]:
    """Single-process training loop (tests, quick experiments). Adapters must be attached."""
    from nbcore.lora import trainable_parameters
    cfg.validate()
    params = trainable_parameters(bb)
    if not params:
        raise ValueError("no adapter parameters: attach_adapter(bb) first")
    opt = opt or make_optimizer(params, cfg)
    hist = []
    for u in range(start_update, cfg.updates):
        batch = [data[i] for i in examples_for_update(u, len(data), cfg)]
        m = train_update(bb, params, opt, batch, cfg)
        m["update"] = u + 1
        hist.append(m)
        if log_fn:
            log_fn(m)
    return hist


# ---------------------------------------------------------------------------------------------
# evaluation helper (NB-TF / NB-LoRA / plain / plain-LoRA on held-out examples)

def default_score(ex: dict, prediction: str) -> float:
    """RULER examples (a `task` field): string_match_all (0-100); otherwise 100 if any gold answer
    occurs in the prediction (case-insensitive)."""
    answers = ex.get("answers") or []
    if isinstance(answers, str):
        answers = [answers]
    if ex.get("task"):
        from nbcore.tasks import ruler
        if ex["task"] in ruler.TASKS:
            return ruler.score(ex["task"], prediction, answers)
    p = prediction.lower()
    return 100.0 if any(a.lower() in p for a in answers if a) else 0.0


def evaluate(bb, data: list[dict], nb: NoteBankConfig, rc: ReadConfig, score_fn=default_score,
             block_size: int = 8192) -> dict:
    """Answer every example with `nbcore.reader` (the query job's code path) and score it."""
    from nbcore.reader import answer, ingest
    scores, rows = [], []
    for ex in data:
        res = ingest(bb, ex["context"], nb, block_size=block_size, write=rc.method == "notebank")
        ans = answer(bb, res.state, res.archive, ex["question"], rc, answers=ex.get("answers"),
                     context_ids=res.token_ids)
        s = score_fn(ex, ans.text)
        scores.append(s)
        rows.append({"prediction": ans.text, "answers": ex.get("answers"), "score": s,
                     "retrieved": ans.retrieved, "replay_len": ans.replay_len, "task": ex.get("task")})
    return {"score": float(np.mean(scores)) if scores else float("nan"), "n": len(scores), "rows": rows}


__all__ = ["LoraTrainConfig", "BadExample", "ReadExample", "answer_targets", "target_text", "prepare",
           "select_notes", "read_logits", "read_nll", "examples_for_update", "example_order", "make_optimizer",
           "train_update", "train_local", "evaluate", "default_score"]
