"""LongBench v1, LongBench v2 and MemoryAgentBench files (`benchmark: longbench` in jobs/evaluate.py).

The job's YAML -> cells, one per (backbone, example) of the nbcore benchmarks `longbench`,
`longbench_v2` and `memoryagentbench` (nbcore/evals/longbench.py, memoryagentbench.py: prompts,
truncation, fit filter, official metrics). Run by the sweep runner (pipeline/evaluate.py): each
example's context is ingested ONCE and every method answers from its own copy of the state S_T; a
MemoryAgentBench cell is one context with all of its questions. Reported by pipeline/reporting/longbench.py.

Prompts (paper App. C.2): the native prompt is cut right after the context; the head
(instruction + context) is ingested, the rest (question, choices, answer cue) is the question.
  v1   official dataset2prompt templates, no chat template, official middle truncation of the
       whole prompt to `longbench.max_length` model tokens (null: never), official max new tokens.
  v2   official 0-shot prompt, chat template when the tokenizer has one; never truncated: an
       example is kept only if its full prompt + replay reserve + generation fits
       `longbench_v2.position_budget` (counted with the backbone's tokenizer on the driver).
  MAB  the context is ingested as is; each question is the official long-context-agent query.

Layout under `output`:
  cells/<backbone>/<suite>/<dataset>/<index>.parquet   per-example rows (one per method and question)
  results.parquet, summary.json, report.md, *.png       written by pipeline/reporting/longbench.py
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from nbcore.evals import longbench as lb
from nbcore.evals import memoryagentbench as mab
from nbcore.evals.methods import replay_reserve
from notebank.pipeline.config import ConfigError
from notebank.pipeline.evaluate import BackboneEntry, BackboneSweepConfig, cell_path, make_cell

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
        self.check_benchmark("longbench")
        self.check_backbones()
        for b in self.backbones:
            try:
                b.notebank.validate()
            except ValueError as e:
                raise ConfigError(f"backbones[{b.name}].notebank: {e}") from e
        if not self.methods:
            raise ConfigError("methods must not be empty")
        self.check_methods(self.methods + [m for b in self.backbones for m in self.methods_of(b)])
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

    def methods_of(self, b: BackboneEntry) -> list[str]:
        """The entry's own `methods` when it sets some (e.g. an NB-LoRA adapter entry), else the job's."""
        return list(b.methods or self.methods)

    # --- the nbcore benchmarks of the three suites -------------------------------------------
    def v1(self) -> lb.LongBench:
        s = self.longbench
        return lb.LongBench(source=s.source, datasets=list(s.datasets), n_examples=s.n_examples,
                            max_length=s.max_length, seed=self.seed, max_new_tokens_cap=self.max_new_tokens_cap)

    def v2(self, reserve: int = 0) -> lb.LongBenchV2:
        s = self.longbench_v2
        return lb.LongBenchV2(source=s.source, paper_subset=s.paper_subset, n_examples=s.n_examples,
                              position_budget=s.position_budget, replay_reserve=reserve,
                              max_new_tokens=s.max_new_tokens, chat_template=s.chat_template, seed=self.seed,
                              max_new_tokens_cap=self.max_new_tokens_cap)

    def mab(self) -> mab.MemoryAgentBench:
        s = self.memoryagentbench
        return mab.MemoryAgentBench(source=s.source, configs=list(s.configs), max_samples=s.max_samples,
                                    max_questions=s.max_questions, max_new_tokens_cap=self.max_new_tokens_cap)

    # --- the runner's hooks ------------------------------------------------------------------
    def plan(self) -> tuple[list[dict], dict]:
        """-> (cells, notes). Every cell carries its example's text, so workers need no data access.
        notes: per backbone, how many v2 examples the fit filter kept."""
        suites = []
        if self.longbench.source:
            bench = self.v1()
            suites.append((bench, _load("longbench.source", lambda: list(bench.examples()))))
        v2_rows = _load("longbench_v2.source", self.v2().candidates) if self.longbench_v2.source else None
        if self.memoryagentbench.source:
            bench = self.mab()
            suites.append((bench, _load("memoryagentbench.source", lambda: list(bench.examples()))))
        cells, notes = [], {}
        for b in self.backbones:
            nb, model = b.notebank.validate(), b.model_dict()
            methods = self.methods_of(b)
            per = list(suites)
            if v2_rows is not None:
                tok = driver_tokenizer(model)
                if tok is None:
                    raise ConfigError(f"backbones[{b.name}]: LongBench v2 needs a tokenizer to count prompt tokens "
                                      "(set model.tokenizer)")
                spec = self.longbench_v2
                bench = self.v2(spec.replay_reserve if spec.replay_reserve is not None else replay_reserve(methods, nb))
                items, notes[f"{b.name}/longbench_v2"] = bench.select(tok, v2_rows)
                per.insert(1 if self.longbench.source else 0, (bench, items))
            for bench, items in per:
                for item in items:
                    dataset = item.get("dataset", bench.name)
                    cells.append(make_cell(
                        bench, item, cell_path(self.output, b.name, bench.name, safe_name(dataset), item["index"]),
                        model=model, methods=methods, notebank=nb.to_dict(), block_size=self.block_size,
                        threads=self.num_cpus_per_cell, labels={"backbone": b.label, "entry": b.name},
                        method_names=b.method_names, entry=b.name))
        return cells, notes

    def cell_order(self, cell: dict):
        """Longest cells (characters to read) first."""
        item = cell["item"]
        return -len(item.get("context") or item.get("head") or (item.get("example") or {}).get("context", ""))

    def resources(self) -> tuple[float, float]:
        return self.num_cpus_per_cell, self.num_gpus_per_cell

    def write_report(self, df, cells: list[dict], notes: dict) -> dict:
        from notebank.pipeline.reporting.longbench import write_report
        return write_report(df, self.output, self.report_title, meta=self.meta(cells, notes))

    def summary_extra(self, cells: list[dict], notes: dict) -> dict:
        return {"v2": notes}

    def meta(self, cells: list[dict], notes: dict) -> dict:
        meta = {"cells": len(cells), "methods": ", ".join(self.methods), "seed": self.seed}
        if self.longbench.source:
            meta["LongBench v1"] = (f"{self.longbench.source}: {len(self.longbench.datasets)} subsets, up to "
                                    f"{self.longbench.n_examples} examples each; middle truncation to "
                                    f"{self.longbench.max_length or 'never'} tokens")
        for k, v in notes.items():
            meta[f"LongBench v2 ({k.split('/')[0]})"] = (
                f"{v['kept']} of {v['candidates']} candidates fit {v['position_budget']} positions with "
                f"{v['replay_reserve']} replay tokens reserved ({v['dropped']} dropped, never truncated)")
        if self.memoryagentbench.source:
            meta["MemoryAgentBench"] = f"{self.memoryagentbench.source}: {', '.join(self.memoryagentbench.configs)}"
        if self.max_new_tokens_cap is not None:
            meta["generation"] = f"capped at {self.max_new_tokens_cap} new tokens (NOT the official budgets)"
        return meta


def safe_name(s: str) -> str:
    """A path component for a dataset/config name (anything but [A-Za-z0-9._-] becomes '_')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", str(s)) or "_"


def driver_tokenizer(model: dict):
    """The backbone's tokenizer, loaded on the driver (v2 fit filter); None when it has none."""
    from nbcore.backbones.loading import build_tokenizer
    if model.get("tokenizer"):
        return build_tokenizer(model["tokenizer"])
    if model.get("path"):
        return build_tokenizer(model["path"])
    return None


def _load(where: str, fn):
    """Call a loader; missing files and malformed data become ConfigError naming the suite key."""
    try:
        return fn()
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ConfigError(f"{where}: {e.args[0] if e.args else e}") from e
