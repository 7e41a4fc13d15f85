"""Meta-training of MoNe on a frozen base (arXiv 2608.17616, Sec. 3.1), plus its evaluation.

Trainable: only the MoNe parameters (LoRAs on the write/read projections, per-token learning-rate
and momentum projections, read gates). The base model and W_0 stay frozen. Each step: a batch of
RULER-style contexts of ``S`` segments (S uniform in [min_segments, max_segments], the same S for
the whole batch) is written into fresh fast weights (the frozen forward of all segments is one
no-grad call; the fast-weight chain is differentiable), then the query pass (question + answer,
local positions, memory tokens) gives the answer-token generation loss (answer tokens + EOS).
AdamW, linear warmup, cosine decay to ``min_lr_frac``, clip 1.0; checkpoint/resume from
``run_dir/ckpt.pt``. Pure torch + transformers (``jobs/train_mone.py`` adds the optional Ray Train
wrapper).

Per example (``run_example``, used by the cost scan; results come from the sweep runner,
``jobs/evaluate.py -c configs/eval_mone.yaml``): methods ``mone`` (ingest context -> state -> query), ``icl`` (full context
in the prompt of the frozen base) and ``rag`` (128-token chunks, BM25 top-K via ``bm25s``, chunks
kept in document order, then the question), greedy decoding, RULER ``string_match_all`` 0-100.
"""
from __future__ import annotations

import json
import math
import random
import resource
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from nbcore.mone.model import MoNeConfig, MoNeModel
from nbcore.mone import state as mstate
from nbcore.tasks import ruler

TASK_ALIASES = {"s_niah": "niah_single_1", "mk_niah": "niah_multikey_1", "fwe": "fwe"}


@dataclass
class CurriculumStage:
    """One stage of the meta-training curriculum: contexts of ``min..max_segments`` segments of
    ``segment_len`` tokens, ``batch_size`` contexts per step, for ``steps`` steps (the last stage runs
    until ``max_steps``). ``needle_window``: the context is a window of the haystack around the
    needle the question asks about (the needle is then a large share of a short write); otherwise a
    whole RULER context of that length."""
    steps: int = 100
    segment_len: int = 32
    min_segments: int = 1
    max_segments: int = 1
    batch_size: int = 8
    needle_window: bool = True


@dataclass
class MetaTrainConfig:
    tasks: tuple = ("s_niah", "mk_niah", "fwe")   # RULER niah_single_1, niah_multikey_1, fwe (train-split keys)
    min_segments: int = 2           # contexts of min..max segments of T tokens
    max_segments: int = 8           # (T = mone.segment_len)
    batch_size: int = 4             # contexts per step
    max_steps: int = 100000         # step budget
    minutes: float = 30.0           # wall budget (stops at whichever of steps / minutes first)
    lr: float = 3e-3                # AdamW peak learning rate (cosine to min_lr_frac)
    min_lr_frac: float = 0.1        # final lr / peak lr
    warmup_steps: int = 50          # linear warm-up steps
    weight_decay: float = 0.0       # AdamW weight decay
    clip: float = 1.0               # gradient-norm clip
    seed: int = 0                   # data and init seed (and the held-out diagnostics batch)
    data_seed: int = -1             # training examples' seed; -1: ``seed``. A run continued from
                                    # init_adapters sets it so its steps 0.. draw examples the first run did not
    threads: int = 1                # torch threads
    ckpt_every_s: float = 120.0     # seconds between checkpoints (run_dir/ckpt.pt)
    log_every: int = 10             # steps between log lines
    rate_lr_mult: float = 1.0       # lr multiplier of the rate/momentum biases and read gates (own AdamW group)
    curriculum: list[CurriculumStage] = field(default_factory=list)   # empty: one stage of
                                    # min..max_segments x mone.segment_len, batch_size, whole contexts
    diag_every: int = 0             # steps between memory diagnostics on a fixed held-out batch (0: none)
    diag_lengths: list[int] = field(default_factory=lambda: [1024, 4096])   # their context lengths
    diag_n: list[int] = field(default_factory=lambda: [8, 4])               # examples per length
    init_adapters: str = ""         # start from these MoNe parameters (a folder with mone_adapters.safetensors)
    device: str = "cpu"             # cpu | cuda | cuda:N | auto (cuda when available)
    checkpoint_write: bool = True   # recompute each segment's write in the backward pass: the same
                                    # gradients with ~1/4 of the memory per segment, and faster on CPU
                                    # (bench/results/mone/write_memory.json); false: keep every activation
    mone: MoNeConfig = field(default_factory=lambda: MoNeConfig(segment_len=128))   # the memory's shape
                                    # (segment_len: the deployed T, which the diagnostics use)


# ------------------------------------------------------------------------------------------------
# data

def encode_query(ex: dict, tok, with_answer: bool = True) -> tuple[list[int], int]:
    """Query-pass ids: question (+ answer + EOS); returns (ids, index of the first answer token)."""
    q = tok(ex["question"], add_special_tokens=False)["input_ids"]
    if not with_answer:
        return q, len(q)
    a = tok(ruler.answer_text(ex["answers"]), add_special_tokens=False)["input_ids"]
    return q + a + [tok.eos_token_id], len(q)


def stages(tc: MetaTrainConfig) -> list[CurriculumStage]:
    if tc.curriculum:
        return list(tc.curriculum)
    return [CurriculumStage(steps=tc.max_steps, segment_len=tc.mone.segment_len, min_segments=tc.min_segments,
                            max_segments=tc.max_segments, batch_size=tc.batch_size, needle_window=False)]


def stage_at(step: int, tc: MetaTrainConfig) -> tuple[int, CurriculumStage]:
    """(index, stage) that training step ``step`` (0-based) belongs to."""
    st = stages(tc)
    end = 0
    for i, s in enumerate(st[:-1]):
        end += s.steps
        if step < end:
            return i, s
    return len(st) - 1, st[-1]


def needle_window(ex: dict, tok, n_tokens: int, rng: random.Random) -> list[int]:
    """Context ids: ``n_tokens`` of the haystack around the needle that holds the first answer,
    the needle at a random offset (whole needle even if it is longer than ``n_tokens``)."""
    ctx = ex["context"]
    a, b = next((a, b) for a, b in ex["needle_spans"] if ex["answers"][0] in ctx[a:b])
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    pre, nd, post = enc(ctx[:a]), enc(ctx[a:b]), enc(ctx[b:])
    room = max(0, n_tokens - len(nd))
    left = min(rng.randint(0, room), len(pre))
    right = min(room - left, len(post))
    left = min(room - right, len(pre))
    return pre[len(pre) - left:] + nd + post[:right]


def make_batch(step: int, tc: MetaTrainConfig, tok):
    """(seg_ids [B,S,T], seg_mask [B,S,T], q_ids [B,n], ans_mask [B,n] (targets at t predict t+1), S)
    for training step ``step`` under its curriculum stage."""
    _, stage = stage_at(step, tc)
    T, B = stage.segment_len, stage.batch_size
    rng = random.Random(f"mone|{tc.seed if tc.data_seed < 0 else tc.data_seed}|{step}")
    S = rng.randint(stage.min_segments, stage.max_segments)
    ctxs, qs = [], []
    for _ in range(B):
        task = TASK_ALIASES.get(t := rng.choice(tc.tasks), t)
        q_len = 60 if task == "fwe" else 40
        window = stage.needle_window and task != "fwe"   # FWE has no needle: whole contexts
        length = max(2 * S * T, 512) + q_len if window else S * T + q_len
        ex = ruler.generate(task, length, rng.randrange(1 << 30), tok, seed=tc.seed, split="train")
        if window:
            ctxs.append(needle_window(ex, tok, S * T, rng))
        else:
            ctxs.append(tok(ex["context"], add_special_tokens=False)["input_ids"][:S * T])
        qs.append(encode_query(ex, tok))
    S = max(math.ceil(len(c) / T) for c in ctxs)
    seg = torch.full((B, S * T), tok.pad_token_id, dtype=torch.long)
    msk = torch.zeros((B, S * T), dtype=torch.bool)
    for i, c in enumerate(ctxs):
        seg[i, :len(c)] = torch.tensor(c)
        msk[i, :len(c)] = True
    n = max(len(q) for q, _ in qs)
    q_ids = torch.full((B, n), tok.pad_token_id, dtype=torch.long)
    ans = torch.zeros((B, n), dtype=torch.bool)
    for i, (q, a0) in enumerate(qs):
        q_ids[i, :len(q)] = torch.tensor(q)
        ans[i, a0 - 1:len(q) - 1] = True
    return seg.view(-1, S, T), msk.view(-1, S, T), q_ids, ans, S


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; anything else as torch names it (cuda asked for
    but absent: a clear error before the model loads)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device={name!r}: no CUDA device here (use cpu or auto)")
    return dev


def meta_loss(model: MoNeModel, seg, msk, q_ids, ans, checkpoint: bool = False):
    """(mean answer-token CE, share of rows whose answer tokens are all argmax-correct). The LM head
    (49K x 576 on SmolLM2, a fifth of the query pass) runs on the answer positions only;
    ``meta_loss_reference`` is the full-logits form it is tested equal to. ``checkpoint``: recompute
    the write chain in the backward pass (MoNeModel.write), for long contexts."""
    fast = model.write(model.fresh(seg.shape[0]), seg, msk, checkpoint=checkpoint)
    h, _ = model._run(q_ids, torch.arange(q_ids.shape[1], device=q_ids.device), fast=fast)
    a = ans[:, :-1]
    logits = model.base.lm_head(h[:, :-1][a])          # [answer tokens, vocab]
    tgt = q_ids[:, 1:][a]
    loss = F.cross_entropy(logits, tgt) if len(tgt) else logits.sum() * 0
    with torch.no_grad():
        wrong = torch.zeros(a.shape[0], dtype=torch.long, device=a.device).index_add_(
            0, a.nonzero()[:, 0], (logits.argmax(-1) != tgt).long())
    return loss, (wrong == 0).float().mean().item()


def meta_loss_reference(model: MoNeModel, seg, msk, q_ids, ans):
    fast = model.write(model.fresh(seg.shape[0]), seg, msk)
    logits = model.logits(q_ids, fast)[:, :-1]
    tgt = q_ids[:, 1:]
    a = ans[:, :-1]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none").view_as(tgt)
    loss = (ce * a).sum() / a.sum().clamp(min=1)
    with torch.no_grad():
        ok = ((logits.argmax(-1) == tgt) | ~a).all(1)
    return loss, ok.float().mean().item()


# ------------------------------------------------------------------------------------------------
# training loop

RATE_PARAMS = ("lr_proj.bias", "mom_proj.bias", "gate")


def param_groups(model: MoNeModel, tc: MetaTrainConfig) -> list[dict]:
    """AdamW groups: the rate and momentum biases and the read gates get ``lr * rate_lr_mult`` (with
    the shared lr the rate bias barely moved in 489 steps: eta 0.95-1.04 in every layer), the
    rest ``lr``. Each group's ``lr_mult`` is applied by the schedule."""
    rates, rest = [], []
    for name, p in model.mone.named_parameters():
        if p.requires_grad:
            (rates if name.split(".", 1)[1] in RATE_PARAMS else rest).append(p)
    return [{"params": rest, "lr": tc.lr, "lr_mult": 1.0, "name": "adapters"},
            {"params": rates, "lr": tc.lr * tc.rate_lr_mult, "lr_mult": tc.rate_lr_mult, "name": "rates"}]


def lr_at(step: int, frac: float, tc: MetaTrainConfig) -> float:
    warm = min(1.0, (step + 1) / max(1, tc.warmup_steps))
    cos = tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    return tc.lr * warm * cos


def answer_ce(model: MoNeModel, q_ids: torch.Tensor, a0: int, fast) -> float:
    """Teacher-forced mean CE (nats) of tokens a0.. of one query [1, n] reading ``fast`` (None: no memory)."""
    q_ids = q_ids.to(model.device)
    logits = model.logits(q_ids, fast)[0, a0 - 1:-1]
    return float(F.cross_entropy(logits, q_ids[0, a0:]))


class MemoryDiagnostics:
    """Answer CE on a fixed held-out S-NIAH batch (test-split keys, examples 1000.. at ``seed``, so
    not the grid's examples) with the example's own memory, with the next example's memory, and with
    no memory, at each context length. The frozen base's per-layer inputs of every segment are
    computed once and kept (``cache_dtype``): they do not depend on the MoNe parameters, so each
    evaluation only re-runs the write chain and three short query passes per example. The write
    equals ``state.ingest`` + ``state.finalized`` at the model's ``segment_len`` (full segments,
    then the tail as one short segment)."""

    def __init__(self, model: MoNeModel, tok, lengths=(1024, 4096), ns=(8, 4), seed: int = 0,
                 task: str = "niah_single_1", cache_dtype=torch.float16, cache_file: str | Path | None = None):
        if len(lengths) != len(ns):
            raise ValueError(f"diag_lengths {list(lengths)} and diag_n {list(ns)} differ in length")
        if any(n < 2 for n in ns):
            raise ValueError("diag_n: need >= 2 examples per length (another example's memory)")
        self.T = model.cfg.segment_len
        self.key = {"lengths": list(lengths), "ns": list(ns), "seed": seed, "task": task, "T": self.T,
                    "dtype": str(cache_dtype), "layers": model.n_layers, "hidden": model.hidden}
        if cache_file is not None and Path(cache_file).is_file() and self._load(Path(cache_file)):
            return
        self.cells: dict[int, list[dict]] = {}
        for length, n in zip(lengths, ns):
            items = []
            for i in range(n):
                ex = ruler.generate(task, length, 1000 + i, tok, seed=seed, split="test")
                ctx = tok(ex["context"], add_special_tokens=False)["input_ids"]
                q, a0 = encode_query(ex, tok)
                full, tail = len(ctx) // self.T, ctx[len(ctx) // self.T * self.T:]
                parts = []
                if full:
                    parts.append(torch.tensor(ctx[:full * self.T]).view(full, self.T))
                if tail:
                    parts.append(torch.tensor([tail]))
                xs = [[x.to("cpu", cache_dtype) for x in model.segment_inputs(p.to(model.device))] for p in parts]
                items.append({"xs": xs, "q": torch.tensor([q]), "a0": a0})
            self.cells[length] = items
        if cache_file is not None:
            self._save(Path(cache_file))

    def _save(self, path: Path) -> None:
        """The frozen inputs (safetensors; metadata: what they were made for), so a resumed run
        skips the frozen forward of the whole batch."""
        from safetensors.torch import save_file
        t = {}
        for length, items in self.cells.items():
            for i, it in enumerate(items):
                t[f"{length}.{i}.q"] = it["q"]
                t[f"{length}.{i}.a0"] = torch.tensor(it["a0"])
                for j, xs in enumerate(it["xs"]):
                    for l, x in enumerate(xs):
                        t[f"{length}.{i}.p{j}.l{l}"] = x.contiguous()
        tmp = path.with_suffix(".tmp")
        save_file(t, str(tmp), metadata={"diagnostics": json.dumps(self.key)})
        tmp.replace(path)

    def _load(self, path: Path) -> bool:
        from safetensors import safe_open
        with safe_open(str(path), "pt") as f:
            if json.loads((f.metadata() or {}).get("diagnostics", "null")) != self.key:
                return False     # made for another batch or model: rebuilt and overwritten
            t = {k: f.get_tensor(k) for k in f.keys()}
        self.cells = {}
        for length, n in zip(self.key["lengths"], self.key["ns"]):
            items = []
            for i in range(n):
                parts = sorted({int(k.split(".")[2][1:]) for k in t if k.startswith(f"{length}.{i}.p")})
                xs = [[t[f"{length}.{i}.p{j}.l{l}"] for l in range(self.key["layers"])] for j in parts]
                items.append({"xs": xs, "q": t[f"{length}.{i}.q"], "a0": int(t[f"{length}.{i}.a0"])})
            self.cells[length] = items
        return True

    @torch.no_grad()
    def fast_weights(self, model: MoNeModel, item: dict):
        fast = model.fresh(1)
        for xs in item["xs"]:
            S, t = xs[0].shape[:2]
            dev = model.device
            seg = torch.zeros(1, S, t, dtype=torch.long, device=dev)   # shape only: the inputs are given
            fast = model.write(fast, seg, torch.ones(1, S, t, dtype=torch.bool, device=dev),
                               xs=[x.to(dev, torch.float32) for x in xs])
        return fast

    @torch.no_grad()
    def evaluate(self, model: MoNeModel) -> dict:
        """{str(length): {"own_ce", "other_ce", "none_ce", "n"}}; "other": example i reads example
        i+1's memory (mod n)."""
        if model.cfg.segment_len != self.T:
            raise ValueError(f"diagnostics were prepared for segment_len {self.T}, model has {model.cfg.segment_len}")
        was_training = model.mone.training
        model.mone.eval()
        out = {}
        for length, items in self.cells.items():
            n = len(items)
            own, other, none = [], [], []
            first = prev = None
            for i, it in enumerate(items):
                fast = self.fast_weights(model, it)
                own.append(answer_ce(model, it["q"], it["a0"], fast))
                none.append(answer_ce(model, it["q"], it["a0"], None))
                if prev is not None:          # example i-1 reads example i's memory
                    other.append(answer_ce(model, items[i - 1]["q"], items[i - 1]["a0"], fast))
                else:
                    first = fast
                prev = fast
            other.append(answer_ce(model, items[-1]["q"], items[-1]["a0"], first))
            out[str(length)] = {"own_ce": round(sum(own) / n, 4), "other_ce": round(sum(other) / n, 4),
                                "none_ce": round(sum(none) / n, 4), "n": n}
        model.mone.train(was_training)
        return out


def train(base_dir: str | Path, out_dir: str | Path, run_dir: str | Path, tc: MetaTrainConfig,
          log=print, report=None, on_diagnostics=None) -> dict:
    """Meta-training loop (resumable from ``run_dir/ckpt.pt``; the MoNe parameters of the latest
    checkpoint also go to ``run_dir/adapters``). ``report(metrics)`` is called at each log line (Ray
    Train passes ``ray.train.report``). Every ``diag_every`` steps the held-out memory diagnostics
    run and ``on_diagnostics(model, meta, history, diagnostics)`` is called (the job exports the
    adapters, curves and diagnostics from there); ``out_dir`` receives the adapters at the end."""
    from nbcore.tasks.tokenizer import load_tokenizer
    torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(base_dir)
    dev = resolve_device(tc.device)
    model = MoNeModel.from_pretrained(base_dir, cfg=tc.mone).to(dev)
    parent = None                   # the starting parameters' own record: the exported lineage
    if tc.init_adapters:
        from safetensors.torch import load_file
        model.mone.load_state_dict(load_file(str(Path(tc.init_adapters) / "mone_adapters.safetensors")))
        log(f"initial MoNe parameters from {tc.init_adapters}")
        rec = Path(tc.init_adapters) / "mone_config.json"
        parent = json.loads(rec.read_text()) if rec.is_file() else {"steps": None, "note": "no mone_config.json"}
    params = model.trainable_parameters()
    opt = torch.optim.AdamW(param_groups(model, tc), lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    step, elapsed, ema, history, diags = 0, 0.0, None, [], []
    ck = run_dir / "ckpt.pt"
    if ck.exists():
        st = torch.load(ck, weights_only=True, map_location=dev)   # tensors and plain containers only: no pickle
        model.mone.load_state_dict(st["mone"])
        opt.load_state_dict(st["opt"])
        step, elapsed, ema, history = st["step"], st["elapsed"], st["ema"], st["history"]
        diags = st.get("diagnostics", [])
        if "parent" in st:
            # the lineage as it was when the run started: init_adapters may since hold other parameters
            # (e.g. an export of this very run), which the checkpoint's parameters above already replaced
            parent = json.loads(st["parent"])
        log(f"resumed from {ck} at step {step} ({elapsed:.0f}s)")
    parent_steps = int((parent or {}).get("steps_total", (parent or {}).get("steps")) or 0)
    n_train = sum(p.numel() for p in params)
    n_base = sum(p.numel() for p in model.base.parameters())
    fast_per_layer = 3 * tc.mone.mem_heads * model.Fw * model.D
    log(f"MoNe: {n_train} trainable params, base {n_base}, fast weights {fast_per_layer} x "
        f"{model.n_layers} layers ({100 * fast_per_layer * model.n_layers / n_base:.1f}% of base)")
    diag = None
    if tc.diag_every:
        t_d = time.time()
        diag = MemoryDiagnostics(model, tok, tc.diag_lengths, tc.diag_n, seed=tc.seed,
                                 cache_file=run_dir / "diagnostics_inputs.safetensors")
        log(f"diagnostics batch prepared in {time.time() - t_d:.0f}s")
    budget = tc.minutes * 60
    t0 = time.time() - elapsed
    last_ck = time.time()

    def meta():
        return {"train": {k: v for k, v in asdict(tc).items() if k != "mone"}, "steps": step,
                "wall_s": round(time.time() - t0, 1), "trainable_params": n_train,
                "base_params": n_base, "fast_weight_params_per_layer": fast_per_layer,
                "ema": {"loss": ema[0], "tf_em": ema[1]} if ema else None,
                "diagnostics": diags[-1] if diags else None,
                # every step behind these parameters, through the runs they were continued from
                "steps_total": step + parent_steps,
                "parent": parent}

    def save():
        tmp = run_dir / "ckpt.pt.tmp"
        torch.save({"mone": model.mone.state_dict(), "opt": opt.state_dict(), "step": step,
                    "elapsed": time.time() - t0, "ema": ema, "history": history, "diagnostics": diags,
                    "parent": json.dumps(parent)}, tmp)
        tmp.replace(ck)   # a kill during the write leaves the previous checkpoint intact
        model.save_adapters(run_dir / "adapters", meta())
        (run_dir / "history.json").write_text(json.dumps({"train": history, "diagnostics": diags}))

    def run_diag():
        t_d = time.time()
        res = diag.evaluate(model)
        rec = {"step": step, "t": round(time.time() - t0, 1), "stage": stage_at(max(step - 1, 0), tc)[0], **res}
        diags.append(rec)
        log(json.dumps({"diagnostics": rec, "seconds": round(time.time() - t_d, 1)}))
        save()
        if on_diagnostics is not None:
            on_diagnostics(model, meta(), history, diags)

    if diag is not None and not diags:
        run_diag()                      # the starting point (a resumed run keeps its diag_every grid)
    model.mone.train()
    while step < tc.max_steps and time.time() - t0 < budget:
        frac = max((time.time() - t0) / budget, step / tc.max_steps)
        seg, msk, q_ids, ans, S = make_batch(step, tc, tok)
        seg, msk, q_ids, ans = (t.to(dev) for t in (seg, msk, q_ids, ans))
        lr = lr_at(step, frac, tc)
        for g in opt.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)
        loss, em = meta_loss(model, seg, msk, q_ids, ans, checkpoint=tc.checkpoint_write)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = float(torch.nn.utils.clip_grad_norm_(params, tc.clip))
        opt.step()
        step += 1
        v = (loss.item(), em)
        ema = v if ema is None else tuple(0.98 * e + 0.02 * x for e, x in zip(ema, v))
        if step % tc.log_every == 0:
            stage_i, stage = stage_at(step - 1, tc)
            rec = {"step": step, "t": round(time.time() - t0, 1), "stage": stage_i, "T": stage.segment_len,
                   "S": S, "B": stage.batch_size, "loss": round(ema[0], 4), "tf_em": round(ema[1], 3),
                   "lr": lr, "gnorm": round(gn, 3)}
            history.append(rec)
            log(json.dumps(rec))
            if report is not None:
                report(rec)
        if diag is not None and step % tc.diag_every == 0:
            run_diag()
            last_ck = time.time()
        elif time.time() - last_ck > tc.ckpt_every_s:
            save()
            last_ck = time.time()
    save()
    if diag is not None and not any(d["step"] == step for d in diags):
        run_diag()
    model.save_adapters(out_dir, meta())
    log(f"done: {step} steps, {time.time() - t0:.0f}s")
    return meta()


# ------------------------------------------------------------------------------------------------
# evaluation and cost

class PeakRSS:
    """Peak resident set size (bytes) of this process while the block runs, sampled every 2 ms
    from /proc/self/statm (the block's own peak, unlike ru_maxrss which is process-lifetime)."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.page = resource.getpagesize()

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        self.start = self._rss()
        self.peak = self.start
        self._stop = threading.Event()

        def run():
            while not self._stop.is_set():
                self.peak = max(self.peak, self._rss())
                time.sleep(self.interval)
        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._rss())


def _flops(fn):
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as fc:
        out = fn()
    return out, int(fc.get_total_flops())


def answer_budget(tok, ex) -> int:
    return len(tok(ruler.answer_text(ex["answers"]), add_special_tokens=False)["input_ids"]) + 2


def rag_prompt(tok, ex, k: int, chunk: int = 128) -> list[int]:
    """BM25 (bm25s) over ``chunk``-token chunks of the context; the top-k chunks, in document
    order, then the question."""
    import bm25s
    ids = tok(ex["context"], add_special_tokens=False)["input_ids"]
    chunks = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    texts = [tok.decode(c) for c in chunks]
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    kk = min(k, len(chunks))
    res, _ = retriever.retrieve(bm25s.tokenize([ex["question"]], stopwords="en", show_progress=False),
                                k=kk, show_progress=False)
    keep = sorted(int(i) for i in res[0])
    body = [t for i in keep for t in chunks[i]]
    return body + tok(ex["question"], add_special_tokens=False)["input_ids"]


@torch.no_grad()
def run_example(model: MoNeModel, tok, ex: dict, method: str, rag_k: int = 4, measure: bool = False) -> dict:
    """One example with one method -> {"pred", "score", and (measure) cost fields}."""
    task = ex["task"]
    budget = answer_budget(tok, ex)
    eos = tok.eos_token_id
    cost: dict = {}
    if method == "mone":
        ctx = tok(ex["context"], add_special_tokens=False)["input_ids"]
        q = tok(ex["question"], add_special_tokens=False)["input_ids"]

        def write():
            return mstate.finalized(model, mstate.ingest(model, ctx))

        def query(fast):
            return model.generate(q, fast, budget, eos, return_cache=True)
        if measure:
            with PeakRSS() as rw:
                fast, fw = _flops(write)
            with PeakRSS() as rq:
                (out, cache), fq = _flops(lambda: query(fast))
            cost = {"write_flops": fw, "query_flops": fq, "write_peak_rss": rw.peak,
                    "write_rss_delta": rw.peak - rw.start, "query_peak_rss": rq.peak,
                    "query_rss_delta": rq.peak - rq.start, "context_tokens": len(ctx),
                    "query_tokens": len(q), "memory_tokens_per_layer": cache.n_entries(0) // 2}
        else:
            out, _ = query(write())
    elif method in ("icl", "rag"):
        if method == "icl":
            prompt = tok(ex["context"] + ex["question"], add_special_tokens=False)["input_ids"]
        else:
            prompt = rag_prompt(tok, ex, rag_k)
        if measure:
            with PeakRSS() as rq:
                out, fq = _flops(lambda: model.generate(prompt, None, budget, eos))
            cost = {"write_flops": 0, "query_flops": fq, "query_peak_rss": rq.peak,
                    "query_rss_delta": rq.peak - rq.start, "prompt_tokens": len(prompt)}
        else:
            out = model.generate(prompt, None, budget, eos)
    else:
        raise ValueError(method)
    pred = tok.decode(out)
    return {"pred": pred, "score": ruler.score(task, pred, ex["answers"]), **cost}


@torch.no_grad()
def answer_nll(model: MoNeModel, tok, ex: dict, method: str, other: dict | None = None) -> float:
    """Teacher-forced mean CE (nats) of the answer tokens + EOS: ``mone`` (query pass reading the
    context's fast weights), ``mone_other`` (the same query pass reading the fast weights of ``other``,
    another example's context: equal to ``mone`` when the memory carries nothing about this example),
    ``question`` (no memory, no context: the frozen base's floor), ``icl`` (full context in the prompt)."""
    q, a0 = encode_query(ex, tok)
    if method == "mone_other":
        ex, method = other, "mone"
    if method == "icl":
        ctx = tok(ex["context"], add_special_tokens=False)["input_ids"]
        ids, a0, fast = ctx + q, a0 + len(ctx), None
    else:
        ids = q
        fast = None
        if method == "mone":
            ctx = tok(ex["context"], add_special_tokens=False)["input_ids"]
            fast = mstate.finalized(model, mstate.ingest(model, ctx))
    x = torch.tensor([ids])
    logits = model.logits(x, fast)[0, a0 - 1:-1]
    return float(F.cross_entropy(logits, x[0, a0:]))


def diagnostics(model: MoNeModel, tok, task: str, length: int, n: int,
                methods=("mone", "mone_other", "question", "icl"), seed: int = 0) -> dict:
    task = TASK_ALIASES.get(task, task)
    exs = [ruler.generate(task, length, i, tok, seed=seed, split="test") for i in range(n)]   # once, every method
    out = {}
    for m in methods:
        vals = [answer_nll(model, tok, exs[i], m, other=exs[(i + 1) % n]) for i in range(n)]
        out[m] = round(sum(vals) / len(vals), 4)
    return out


def rag_recall(tok, task: str, length: int, n: int, k: int, seed: int = 0) -> float:
    """Share (0-100) of answers present in the BM25 top-k chunks (what RAG's reader could see)."""
    task = TASK_ALIASES.get(task, task)
    hits = 0.0
    for i in range(n):
        ex = ruler.generate(task, length, i, tok, seed=seed, split="test")
        text = tok.decode(rag_prompt(tok, ex, k))
        hits += sum(a in text for a in ex["answers"]) / len(ex["answers"])
    return round(100 * hits / n, 2)


@torch.no_grad()
def retention_probe(model: MoNeModel, tok, length: int = 8192, n: int = 5, seed: int = 0,
                    checkpoints=(1, 2, 4, 8, 16, 32, 64)) -> dict:
    """How well the fast weights still map the needle's keys to its values as more segments are
    written: mean over layers, heads and needle tokens of cos(M(k_j; W_s), v_j), after s segments
    (the needle is moved into segment 1). ``unwritten``: the same score for the needle tokens of
    another example that was never written (chance level)."""
    from nbcore.mone import memory as mem
    T = model.cfg.segment_len
    curves, chance = [], []
    for i in range(n):
        ex = ruler.generate("niah_single_1", length, i, tok, seed=seed, split="test")
        a, b = ex["needle_spans"][0]
        needle = tok(ex["context"][a:b], add_special_tokens=False)["input_ids"]
        ctx = tok(ex["context"], add_special_tokens=False)["input_ids"]
        ctx = needle + ctx[:T - len(needle)] + ctx[T - len(needle):]
        S = len(ctx) // T
        seg = torch.tensor(ctx[:S * T]).view(1, S, T)
        xs = model.segment_inputs(seg.view(S, T))
        fast = model.fresh(1)
        nmask = torch.zeros(1, T, dtype=torch.bool)
        nmask[0, :len(needle)] = True
        curve = {}
        for s in range(S):
            fast = [model.layer_write(l, fast[l], xs[l][s:s + 1], torch.ones(1, T, dtype=torch.bool))
                    for l in range(model.n_layers)]
            if s + 1 in checkpoints:
                cs = []
                for l in range(model.n_layers):
                    k, v, _, _ = model.write_inputs(l, xs[l][0:1], nmask)
                    out = mem.swiglu_forward(k, fast[l].w_in, fast[l].w_gate, fast[l].w_out)
                    cs.append(F.cosine_similarity(out, v, dim=-1)[0, :len(needle)].mean())
                curve[s + 1] = float(torch.stack(cs).mean())
        curves.append(curve)
        # chance: the next example's needle tokens read from this example's final state
        ex2 = ruler.generate("niah_single_1", 1024, 10_000 + i, tok, seed=seed, split="test")
        a, b = ex2["needle_spans"][0]
        nd2 = tok(ex2["context"][a:b], add_special_tokens=False)["input_ids"]
        xs2 = model.segment_inputs(torch.tensor([nd2]))
        cs = []
        for l in range(model.n_layers):
            k, v, _, _ = model.write_inputs(l, xs2[l], torch.ones(1, len(nd2), dtype=torch.bool))
            out = mem.swiglu_forward(k, fast[l].w_in, fast[l].w_gate, fast[l].w_out)
            cs.append(F.cosine_similarity(out, v, dim=-1).mean())
        chance.append(float(torch.stack(cs).mean()))
    keys = sorted(set.intersection(*[set(c) for c in curves]))
    return {"after_segments": {str(k): round(sum(c[k] for c in curves) / n, 4) for k in keys},
            "unwritten": round(sum(chance) / n, 4), "n": n, "length": length}


def copy_sanity(base_dir, steps: int = 150, batch: int = 8, segments: int = 2, seed: int = 0,
                cfg: MoNeConfig | None = None, log=None, eval_segments=(2, 16)) -> dict:
    """End-to-end check that information flows context -> fast weights -> memory tokens -> answer
    and that the meta-parameters can learn to use it, independently of the base's own retrieval
    skill: the context is S segments in which half the tokens are one digit c (the rest random
    tokens); the query is a fixed question; the answer is c. A fresh MoNe is meta-trained for
    ``steps`` steps; returns answer CE / accuracy before and after on 64 held-out contexts, with
    and without memory (chance CE = ln 10), for contexts of each of ``eval_segments`` segments
    (training uses ``segments``; 16 = 8x the training length)."""
    from nbcore.tasks.tokenizer import load_tokenizer
    tok = load_tokenizer(base_dir)
    model = MoNeModel.from_pretrained(base_dir, cfg=cfg or MoNeConfig(segment_len=128))
    T = model.cfg.segment_len
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    q = tok("\nWhat is the special magic number? The special magic number is", add_special_tokens=False)["input_ids"]
    sp_digits = [tok(" " + str(d), add_special_tokens=False)["input_ids"][-1] for d in range(10)]

    def batch_of(g: torch.Generator, b: int, S: int = segments):
        c = torch.randint(0, 10, (b,), generator=g)
        ctx = torch.randint(4, len(tok), (b, S * T), generator=g)
        put = torch.rand(b, S * T, generator=g) < 0.5
        ctx = torch.where(put, torch.tensor(digits)[c].unsqueeze(1), ctx)
        ids = torch.tensor([q + [0]] * b)
        ids[:, -1] = torch.tensor(sp_digits)[c]
        return ctx.view(b, S, T), ids

    def score(use_memory: bool, S: int = segments):
        g = torch.Generator().manual_seed(10_000 + seed)
        ctx, ids = batch_of(g, 64, S)
        with torch.no_grad():
            fast = model.write(model.fresh(64), ctx, torch.ones_like(ctx, dtype=torch.bool)) if use_memory else None
            lg = model.logits(ids, fast)[:, -2]
        return {"ce": round(float(F.cross_entropy(lg, ids[:, -1])), 4),
                "acc": round(float((lg.argmax(-1) == ids[:, -1]).float().mean()), 4)}

    before = {"memory": score(True), "no_memory": score(False)}
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ctx, ids = batch_of(g, batch)
        fast = model.write(model.fresh(batch), ctx, torch.ones_like(ctx, dtype=torch.bool))
        loss = F.cross_entropy(model.logits(ids, fast)[:, -2], ids[:, -1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.trainable_parameters(), 1.0)
        opt.step()
        if log and (step + 1) % 25 == 0:
            log(f"copy_sanity step {step + 1} loss {loss.item():.3f}")
    after = {"memory": score(True), "no_memory": score(False)}
    for S in eval_segments:
        after[f"memory_{S}_segments"] = score(True, S)
    return {"steps": steps, "batch": batch, "segments": segments, "chance_ce": round(math.log(10), 4),
            "before": before, "after": after}
