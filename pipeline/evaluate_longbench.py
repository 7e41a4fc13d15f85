"""LongBench v1, LongBench v2 and MemoryAgentBench on Ray (`benchmark: longbench` in jobs/evaluate.py).

One Ray task per (backbone, example): the example's context is ingested ONCE (one ingest per
distinct writer config) and every method answers from its own copy of the state S_T. A
MemoryAgentBench cell is one context with all of its questions: ingested once, every question
answered from a fresh copy; rows record the ingest time amortised over the questions.

Prompts (paper App. C.2): the native prompt is cut right after the context; the head
(instruction + context) is ingested, the rest (question, choices, answer cue) is the question.
  v1   official dataset2prompt templates, no chat template, official middle truncation of the
       whole prompt to `longbench.max_length` model tokens (null: never), official max new tokens.
  v2   official 0-shot prompt, chat template when the tokenizer has one; never truncated: an
       example is kept only if its full prompt + replay reserve + generation fits
       `longbench_v2.position_budget` (counted with the backbone's tokenizer on the driver).
  MAB  the context is ingested as is; each question is the official long-context-agent query.

Resumable like pipeline/evaluate.py: each finished cell is one Parquet file (tmp name, then
renamed); a rerun skips cells whose file exists.

Layout under `output`:
  cells/<backbone>/<suite>/<dataset>/<index>.parquet   per-example rows (one per method and question)
  results.parquet, summary.json, report.md, *.png       written by nbcore.evals.report_longbench
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from dataclasses import dataclass, field

import fsspec

from nbcore.config import NoteBankConfig
from nbcore.evals import longbench as lb
from nbcore.evals import memoryagentbench as mab
from pipeline.config import ConfigError
from pipeline.evaluate import BackboneEntry, BackboneSweepConfig
from pipeline.fanout import cell_result, finish_sweep, run_all, unfinished

SUITES = ("longbench", "longbench_v2", "memoryagentbench")


@dataclass
class LongBenchV1Spec:
    """LongBench v1: the paper's 12 English subsets, a fixed seeded subset of each."""

    source: str | None = None           # dir (local or fsspec URL) with {dataset}.jsonl or data/{dataset}.jsonl;
                                        # null: suite off
    datasets: list[str] = field(default_factory=lambda: list(lb.V1_DATASETS))
    n_examples: int = 30                # per subset, chosen by `seed`, shared by every method (paper: 30)
    max_length: int | None = None       # official middle truncation of the prompt (model tokens); null: never


@dataclass
class LongBenchV2Spec:
    """LongBench v2: 0-shot multiple choice, kept only where the whole prompt fits."""

    source: str | None = None           # data.json / .jsonl file or a dir holding data.json; null: suite off
    paper_subset: bool = True           # the paper's domains (single-/multi-doc QA, dialogue history, user guides)
    n_examples: int | None = None       # after the fit filter, chosen by `seed`; null: all that fit
    position_budget: int = 131072       # positions the backbone may use (prompt + replay + generation)
    replay_reserve: int | None = None   # null: max over NoteBank methods of top_R x note_budget
    max_new_tokens: int = lb.V2_MAX_NEW_TOKENS
    chat_template: bool = True          # apply the tokenizer's chat template when it has one


@dataclass
class MemoryAgentBenchSpec:
    """MemoryAgentBench: one context, many questions (ingest once, answer each from a copy)."""

    source: str | None = None           # HF layout dir (data/{split}-*.parquet) or one parquet/JSON(L) file;
                                        # null: suite off
    configs: list[str] = field(default_factory=lambda: list(mab.PAPER_SOURCES))   # metadata.source names
    max_samples: int | None = None      # contexts per configuration (official max_test_samples); null: all
    max_questions: int | None = None    # questions per context (first ones); null: all


@dataclass
class LongBenchJobConfig(BackboneSweepConfig):
    """jobs/evaluate.py (benchmark: longbench): LongBench v1/v2 and MemoryAgentBench."""

    benchmark: str = "longbench"
    output: str = "out/eval-longbench"
    report_title: str = "LongBench / LongBench v2 / MemoryAgentBench"
    longbench: LongBenchV1Spec = field(default_factory=LongBenchV1Spec)
    longbench_v2: LongBenchV2Spec = field(default_factory=LongBenchV2Spec)
    memoryagentbench: MemoryAgentBenchSpec = field(default_factory=MemoryAgentBenchSpec)
    seed: int = 0
    methods: list[str] = field(default_factory=lambda: ["plain", "jrt", "nb-tf-top2", "nb-bm25-top2",
                                                        "clean-start"])
    max_new_tokens_cap: int | None = None           # cap on the official budgets (CI/fixture runs); null: none
    block_size: int = 65536
    num_cpus_per_cell: float = 1.0
    num_gpus_per_cell: float = 0.0

    def validate(self):
        """Structure only (no file access: --print-config works anywhere); sources are checked at run time."""
        from nbcore.evals.ruler_eval import method_config
        self.check_benchmark("longbench")
        self.check_backbones()
        for b in self.backbones:
            try:
                b.notebank.validate()
            except ValueError as e:
                raise ConfigError(f"backbones[{b.name}].notebank: {e}") from e
        if not self.methods:
            raise ConfigError("methods must not be empty")
        for m in self.methods + [m for b in self.backbones for m in backbone_methods(b, [])]:
            try:
                method_config(m)
            except ValueError as e:
                raise ConfigError(f"methods: {e}") from e
        if not any(getattr(self, s).source for s in SUITES):
            raise ConfigError("set at least one of longbench.source, longbench_v2.source, memoryagentbench.source")
        v1, v2, mb = self.longbench, self.longbench_v2, self.memoryagentbench
        bad = [d for d in v1.datasets if d not in lb.V1_DATASETS]
        if bad:
            raise ConfigError(f"longbench.datasets: unknown {bad}; known: {list(lb.V1_DATASETS)}")
        if v1.source and not v1.datasets:
            raise ConfigError("longbench.datasets must not be empty")
        if v1.n_examples < 1:
            raise ConfigError("longbench.n_examples must be >= 1")
        if v1.max_length is not None and v1.max_length < 16:
            raise ConfigError(f"longbench.max_length must be >= 16 tokens or null, got {v1.max_length}")
        if v2.position_budget < 1 or v2.max_new_tokens < 1:
            raise ConfigError("longbench_v2.position_budget and longbench_v2.max_new_tokens must be >= 1")
        if v2.n_examples is not None and v2.n_examples < 1:
            raise ConfigError("longbench_v2.n_examples must be >= 1 or null")
        if v2.replay_reserve is not None and v2.replay_reserve < 0:
            raise ConfigError("longbench_v2.replay_reserve must be >= 0 or null")
        if mb.source and not mb.configs:
            raise ConfigError("memoryagentbench.configs must not be empty")
        for c in mb.configs:
            try:
                mab.task_family(c)
            except KeyError as e:
                raise ConfigError(f"memoryagentbench.configs: {e.args[0]}") from e
        for name in ("max_samples", "max_questions"):
            v = getattr(mb, name)
            if v is not None and v < 1:
                raise ConfigError(f"memoryagentbench.{name} must be >= 1 or null")
        if self.max_new_tokens_cap is not None and self.max_new_tokens_cap < 1:
            raise ConfigError("max_new_tokens_cap must be >= 1 or null")
        return self


# ---------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------
def backbone_methods(b: BackboneEntry, default: list[str]) -> list[str]:
    """The entry's own `methods` when it sets some (e.g. an NB-LoRA adapter entry), else `default`."""
    return list(getattr(b, "methods", None) or default)


def report_labels(b: BackboneEntry) -> tuple[str, dict]:
    """(backbone label, method renames) for results rows: `report_as` (default: name) and
    `method_names` (e.g. an adapter entry reporting nb-tf-top2 as nb-lora-top2 under tiny-gdn)."""
    return (getattr(b, "report_as", "") or b.name), dict(getattr(b, "method_names", None) or {})


def safe_name(s: str) -> str:
    """A path component for a dataset/config name (anything but [A-Za-z0-9._-] becomes '_')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", str(s)) or "_"


def cell_path(out: str, bb: str, suite: str, dataset: str, index: int) -> str:
    return f"{out.rstrip('/')}/cells/{bb}/{suite}/{safe_name(dataset)}/{index:04d}.parquet"


def capped(n: int, cap: int | None) -> int:
    """Generation budget: the official `n`, or `cap` when it is smaller."""
    return n if cap is None else min(n, cap)


def replay_reserve(methods: list[str], nb: NoteBankConfig) -> int:
    """Most replayed tokens any method may add: max over NoteBank methods of top_R x note_budget."""
    from nbcore.evals.ruler_eval import method_config
    return max([method_config(m).top_r * nb.note_budget for m in methods
                if method_config(m).method == "notebank"] or [0])


def mab_split(config: str) -> str:
    """HF split holding a MemoryAgentBench configuration (`metadata.source`)."""
    if config in mab.PAPER_SOURCES:
        return mab.PAPER_SOURCES[config]
    return "Conflict_Resolution" if mab.task_family(config) == "factconsolidation" else "Accurate_Retrieval"


def v1_category(dataset: str) -> str:
    return next(c for c, names in lb.CATEGORIES.items() if dataset in names)


def _local_model(model: dict) -> dict:
    model = dict(model)
    if model.get("path") and "://" not in model["path"] and os.path.exists(model["path"]):
        model["path"] = os.path.abspath(model["path"])   # workers may run elsewhere
    return model


def driver_tokenizer(model: dict):
    """The backbone's tokenizer, loaded on the driver (v2 fit filter); None when it has none."""
    from pipeline.worker import build_tokenizer
    if model.get("tokenizer"):
        return build_tokenizer(model["tokenizer"])
    if model.get("path"):
        return build_tokenizer(model["path"])
    return None


# ---------------------------------------------------------------------------------------------
# Planning (driver): load the data, pick the examples, one cell per (backbone, example)
# ---------------------------------------------------------------------------------------------
def _load(where: str, fn, *args, **kw):
    """Call a loader; missing files and malformed data become ConfigError naming the suite key."""
    try:
        return fn(*args, **kw)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ConfigError(f"{where}: {e.args[0] if e.args else e}") from e


def load_v1(spec: LongBenchV1Spec, seed: int) -> dict[str, list[tuple[int, dict]]]:
    """-> {dataset: [(file index, example)]}: the seeded subset of each dataset, in file order."""
    out = {}
    for ds in spec.datasets:
        rows = _load("longbench.source", lb.load_longbench, spec.source, ds)
        out[ds] = lb.select_subset(list(enumerate(rows)), spec.n_examples, seed)
    return out


def load_v2(spec: LongBenchV2Spec) -> list[tuple[int, dict]]:
    """-> [(file index, example)] of the paper subset (domains) when `paper_subset`, else all."""
    rows = list(enumerate(_load("longbench_v2.source", lb.load_longbench_v2, spec.source)))
    if spec.paper_subset:
        rows = [(i, r) for i, r in rows if lb.select_v2([r])]
    return rows


def fit_v2(rows: list[tuple[int, dict]], tokenizer, spec: LongBenchV2Spec, reserve: int, cap: int | None,
           seed: int) -> tuple[list[tuple[int, dict, str]], int]:
    """Keep examples whose whole prompt fits (never truncated) -> ([(index, example, prompt)], n dropped)."""
    max_new = capped(spec.max_new_tokens, cap)
    prompts = [lb.chat_prompt(tokenizer, lb.build_prompt_v2(r), spec.chat_template) for _, r in rows]
    kept = [(i, r, p) for (i, r), p in zip(rows, prompts)
            if lb.fits_in_budget(len(tokenizer(p)["input_ids"]), position_budget=spec.position_budget,
                                 replay_reserve=reserve, max_new_tokens=max_new)]
    dropped = len(rows) - len(kept)
    if spec.n_examples is not None:
        kept = lb.select_subset(kept, spec.n_examples, seed)
    return kept, dropped


def load_mab(spec: MemoryAgentBenchSpec) -> dict[str, list[mab.MABSample]]:
    """-> {config: [samples]} (first `max_samples` contexts of each configuration)."""
    fs, p = fsspec.core.url_to_fs(spec.source)
    if not fs.exists(p):
        raise ConfigError(f"memoryagentbench.source: {spec.source} not found; expected the HF layout "
                          "(data/{split}-00000-of-00001.parquet) or one parquet/JSON/JSONL file")
    is_dir = fs.isdir(p)
    out = {}
    for c in spec.configs:
        out[c] = _load("memoryagentbench.source", mab.load_memoryagentbench, spec.source,
                       split=mab_split(c) if is_dir else None, sources=[c], max_samples=spec.max_samples)
    return out


def plan_cells(cfg: LongBenchJobConfig) -> tuple[list[dict], dict]:
    """-> (cells, notes). Every cell carries its example's text, so workers need no data access."""
    cells, notes = [], {}
    v1 = load_v1(cfg.longbench, cfg.seed) if cfg.longbench.source else {}
    v2 = load_v2(cfg.longbench_v2) if cfg.longbench_v2.source else []
    mb = load_mab(cfg.memoryagentbench) if cfg.memoryagentbench.source else {}
    cap = cfg.max_new_tokens_cap
    for b in cfg.backbones:
        model = _local_model(dataclasses.asdict(b.model))
        nb = b.notebank.validate()
        label, renames = report_labels(b)
        methods = backbone_methods(b, cfg.methods)
        base = dict(entry=b.name, backbone=label, method_names=renames, model=model,
                    notebank=dataclasses.asdict(nb), methods=methods, block_size=cfg.block_size,
                    threads=max(1, int(cfg.num_cpus_per_cell)))
        for ds, rows in v1.items():
            for i, ex in rows:
                cells.append(dict(base, suite="longbench", dataset=ds, index=i, id=str(ex.get("_id", i)),
                                  example=ex, max_length=cfg.longbench.max_length,
                                  max_new_tokens=capped(lb.max_new_tokens(ds), cap),
                                  path=cell_path(cfg.output, b.name, "longbench", ds, i)))
        if v2:
            tok = driver_tokenizer(model)
            if tok is None:
                raise ConfigError(f"backbones[{b.name}]: LongBench v2 needs a tokenizer to count prompt tokens "
                                  "(set model.tokenizer)")
            spec = cfg.longbench_v2
            reserve = spec.replay_reserve if spec.replay_reserve is not None else replay_reserve(methods, nb)
            kept, dropped = fit_v2(v2, tok, spec, reserve, cap, cfg.seed)
            notes[f"{b.name}/longbench_v2"] = {"candidates": len(v2), "kept": len(kept), "dropped": dropped,
                                               "position_budget": spec.position_budget, "replay_reserve": reserve}
            for i, ex, prompt in kept:
                head, question = lb.split_at_context(prompt, ex["context"])
                cells.append(dict(base, suite="longbench_v2", dataset="longbench_v2", index=i, id=str(ex["_id"]),
                                  head=head, question=question, answer=ex["answer"], domain=ex["domain"],
                                  max_new_tokens=capped(spec.max_new_tokens, cap),
                                  path=cell_path(cfg.output, b.name, "longbench_v2", "longbench_v2", i)))
        for conf, samples in mb.items():
            for i, s in enumerate(samples):
                n_q = len(s) if cfg.memoryagentbench.max_questions is None else min(
                    len(s), cfg.memoryagentbench.max_questions)
                cells.append(dict(base, suite="memoryagentbench", dataset=conf, index=i, id=f"{conf}-{i}",
                                  context=s.context, questions=s.questions[:n_q], answers=s.answers[:n_q],
                                  max_new_tokens=capped(mab.generation_max_length(conf), cap),
                                  path=cell_path(cfg.output, b.name, "memoryagentbench", conf, i)))
    return cells, notes


# ---------------------------------------------------------------------------------------------
# One cell (worker): ingest once, answer every question with every method from copies
# ---------------------------------------------------------------------------------------------
def answer_all(bb, nb_cfg: NoteBankConfig, head: str, questions: list[str], answers: list[list[str]],
               methods: list[str], max_new_tokens: int, stop: tuple[str, ...], block_size: int) -> list[dict]:
    """Ingest `head` once per distinct writer config; answer each question with each method from a
    copy of S_T. -> rows (question_index, method, prediction, timings, counters), ordered by
    (question, method). `ingest_s` is the full ingest; `ingest_amortised_s` = ingest_s / #questions."""
    from nbcore.evals.ruler_eval import method_config, writer_overrides
    from nbcore.reader import answer, ingest
    groups: dict[str, list[str]] = {}
    for name in methods:
        groups.setdefault(json.dumps(writer_overrides(name), sort_keys=True), []).append(name)
    rows = []
    for key, names in groups.items():
        cfg = NoteBankConfig(**{**nb_cfg.to_dict(), **json.loads(key)}).validate()
        t0 = time.perf_counter()
        res = ingest(bb, head, cfg, block_size=block_size)
        ingest_s = time.perf_counter() - t0
        for qi, (q, gold) in enumerate(zip(questions, answers)):
            for name in names:
                rc = method_config(name, max_new_tokens, stop)
                t1 = time.perf_counter()
                ans = answer(bb, res.state, res.archive, q, rc, answers=list(gold), context_ids=res.token_ids)
                rows.append(dict(question_index=qi, method=name, prediction=ans.text, answers=list(gold),
                                 ingest_s=ingest_s, ingest_amortised_s=ingest_s / len(questions),
                                 n_questions=len(questions), answer_s=time.perf_counter() - t1,
                                 n_tokens=int(res.n_tokens), question_tokens=int(ans.n_question_tokens),
                                 n_notes=len(res.archive), replay_len=int(ans.replay_len)))
    order = {n: i for i, n in enumerate(methods)}
    return sorted(rows, key=lambda r: (r["question_index"], order[r["method"]]))


def evaluate_cell(bb, cell: dict) -> list[dict]:
    """Rows of one cell, scored on 0-100 with the suite's official metric."""
    nb = NoteBankConfig(**cell["notebank"])
    common = dict(methods=cell["methods"], max_new_tokens=cell["max_new_tokens"], block_size=cell["block_size"])
    suite, ds = cell["suite"], cell["dataset"]
    if suite == "longbench":
        ex = cell["example"]
        head, question = lb.split_prompt(ds, ex)
        head, question, cut = lb.truncate_middle(bb.tokenizer, head, question, cell["max_length"])
        stop = ("\n",) if ds == "samsum" else ()          # pred.py: samsum also stops at a newline
        rows = answer_all(bb, nb, head, [question], [list(ex["answers"])], stop=stop, **common)
        for r in rows:
            r.update(category=v1_category(ds), truncated=cut, parsed=None,
                     score=100.0 * lb.score_prediction(ds, r["prediction"], ex["answers"], ex.get("all_classes")))
    elif suite == "longbench_v2":
        rows = answer_all(bb, nb, cell["head"], [cell["question"]], [[cell["answer"]]], stop=(), **common)
        for r in rows:
            r.update(category=cell["domain"], truncated=False, parsed=lb.parse_choice(r["prediction"]))
            r["score"] = 100.0 * (r["parsed"] == cell["answer"])
    elif suite == "memoryagentbench":
        queries = [mab.build_query(ds, q) for q in cell["questions"]]
        rows = answer_all(bb, nb, cell["context"], queries, cell["answers"], stop=(), **common)
        for r in rows:
            r.update(category=mab.task_family(ds), truncated=False, parsed=None,
                     score=100.0 * mab.score_answer(ds, r["prediction"], r["answers"]))
    else:
        raise ValueError(f"unknown suite {suite!r}")
    for r in rows:
        r.update(benchmark=suite, dataset=ds, id=cell["id"], index=cell["index"],
                 max_new_tokens=cell["max_new_tokens"])
    return rows


def run_cell(cell: dict) -> dict:
    """Evaluate one cell and commit its Parquet file (tmp, then rename). Errors are returned, not raised."""
    import torch

    from pipeline.evaluate import _backbone
    torch.set_num_threads(max(1, int(cell.get("threads", 1))))
    t0 = time.perf_counter()
    try:
        rows = evaluate_cell(_backbone(cell["model"]), cell)
        err = None
    except Exception as e:  # noqa: BLE001 - a failed example is recorded, the run goes on
        rows, err = [], f"{type(e).__name__}: {e}"
    renames = cell.get("method_names") or {}
    for r in rows:
        r.update(backbone=cell["backbone"], entry=cell["entry"], method=renames.get(r["method"], r["method"]),
                 cell_s=time.perf_counter() - t0)
    return cell_result(cell, rows, err)


def _size(cell: dict) -> int:
    """Characters to read (longest cells start first)."""
    ex = cell.get("example") or {}
    return len(cell.get("context") or cell.get("head") or ex.get("context", ""))


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------
def run_longbench(cfg: LongBenchJobConfig) -> dict:
    """Run (or resume) every cell on Ray (already initialised), then write the report. -> CLI summary."""
    cfg.validate()
    t0 = time.perf_counter()
    cells, notes = plan_cells(cfg)
    todo = sorted(unfinished(cfg.output, cells), key=lambda c: -_size(c))
    results = run_all(run_cell, todo, cfg.num_cpus_per_cell, cfg.num_gpus_per_cell, progress=cfg.progress)
    failed = [r for r in results if r["error"]]

    def report(df):
        from nbcore.evals.report_longbench import write_report
        return write_report(df, cfg.output, cfg.report_title, meta=_meta(cfg, cells, notes))

    summary = finish_sweep(cfg.output, report)
    return {"cells": len(cells), "cells_run": len(todo), "cells_skipped": len(cells) - len(todo),
            "cells_failed": len(failed), "tokens": sum(r["n_tokens"] for r in results),
            "wall_s": round(time.perf_counter() - t0, 2), "summary_keys": len(summary), "v2": notes}


def _meta(cfg: LongBenchJobConfig, cells: list[dict], notes: dict) -> dict:
    meta = {"cells": len(cells), "methods": ", ".join(cfg.methods), "seed": cfg.seed}
    if cfg.longbench.source:
        meta["LongBench v1"] = (f"{cfg.longbench.source}: {len(cfg.longbench.datasets)} subsets, up to "
                                f"{cfg.longbench.n_examples} examples each; middle truncation to "
                                f"{cfg.longbench.max_length or 'never'} tokens")
    for k, v in notes.items():
        meta[f"LongBench v2 ({k.split('/')[0]})"] = (
            f"{v['kept']} of {v['candidates']} candidates fit {v['position_budget']} positions with "
            f"{v['replay_reserve']} replay tokens reserved ({v['dropped']} dropped, never truncated)")
    if cfg.memoryagentbench.source:
        meta["MemoryAgentBench"] = f"{cfg.memoryagentbench.source}: {', '.join(cfg.memoryagentbench.configs)}"
    if cfg.max_new_tokens_cap is not None:
        meta["generation"] = f"capped at {cfg.max_new_tokens_cap} new tokens (NOT the official budgets)"
    return meta
