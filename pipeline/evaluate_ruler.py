"""RULER sweeps (`benchmark: ruler`, the default of jobs/evaluate.py): backbones x budgets x tasks x
lengths x examples, every method answered from one ingest per example (nbcore.evals.ruler). Run by
the sweep runner (pipeline/evaluate.py); reported by pipeline/reporting/ruler.py.

Resumable: each finished cell is one Parquet file; a rerun skips it. `results.parquet` is what a
repository ships (cells/ is scratch): a fresh clone restores the cells it covers and adds new rows to it.

Layout under `output`:
  cells/<backbone>/<budget>/<task>/<length>/<index>.parquet   per-example rows (one per method)
  results.parquet (schemas/results.py), results.json, summary.json, report.md, report-appendix.md, *.png
                                                                written by the final report step
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from nbcore.config import NoteBankConfig
from notebank.pipeline.config import ConfigError
from notebank.pipeline.evaluate import (BackboneEntry, BackboneSweepConfig, cell_path, make_cell, parse_length,
                               report_meta)

MEASUREMENT_KEY = ["backbone", "budget", "method", "task", "length", "index"]


@dataclass
class BudgetEntry:
    """A (C, W, B) variant; unset fields keep the backbone's notebank config."""
    name: str = "default"
    chunk_size: int | None = None
    write_budget: int | None = None
    note_budget: int | None = None


@dataclass
class RulerJobConfig(BackboneSweepConfig):
    """jobs/evaluate.py (benchmark: ruler)"""

    benchmark: str = "ruler"
    output: str = "out/eval"
    report_title: str = "RULER evaluation"
    budgets: list[BudgetEntry] = field(default_factory=lambda: [BudgetEntry()])
    tasks: list[str] = field(default_factory=lambda: ["niah_single_1", "niah_single_2", "niah_single_3",
                                                      "niah_multikey_1", "niah_multiquery", "niah_multivalue"])
    lengths: list[str] = field(default_factory=lambda: ["4K", "16K"])
    n_examples: int = 10
    n_examples_by_length: dict = field(default_factory=dict)   # e.g. {1M: 2}: fewer at the costly lengths
    seed: int = 0
    methods: list[str] = field(default_factory=lambda: ["plain", "jrt", "nb-tf-top1", "nb-tf-top2", "nb-tf-top4",
                                                        "nb-bm25-top2", "nb-dense-top2", "nb-oracle-top2",
                                                        "clean-start", "nb-tf-top2-reset"])
    methods_by_length: dict = field(default_factory=dict)      # e.g. {1M: [plain, nb-tf-top2]} (drops JRT's 2x pass)
    max_new_tokens: int = 128   # RULER NIAH tokens_to_generate; generation stops at EOS anyway
    block_size: int = 65536
    num_cpus_per_cell: float = 1.0
    num_gpus_per_cell: float = 0.0
    only_backbones: list[str] = field(default_factory=list)   # run just these entries (report: all cells)
    only_lengths: list[str] = field(default_factory=list)     # run just these lengths, e.g. [4K, 64K]

    measurement_key: ClassVar[list[str]] = MEASUREMENT_KEY

    def validate(self):
        from nbcore.tasks import ruler
        bad = [t for t in self.tasks if not ruler.is_task(t)]
        if bad or not self.tasks:
            raise ConfigError(f"tasks: unknown task(s) {bad}; RULER tasks {list(ruler.TASKS)}, "
                              f"other families {ruler.other_tasks()}" if bad else "tasks: none given")
        self.check_backbones()
        self.check_methods([*self.methods, *(m for b in self.backbones for m in b.methods),
                            *(m for ms in self.methods_by_length.values() for m in ms),
                            *(m for b in self.backbones for ms in b.methods_by_length.values() for m in ms)])
        for x in self.lengths:
            parse_length(x)
        known = {parse_length(y) for y in self.lengths}
        tables = [("n_examples_by_length", self.n_examples_by_length), ("methods_by_length", self.methods_by_length)]
        tables += [(f"backbones[{b.name}].n_examples_by_length", b.n_examples_by_length) for b in self.backbones]
        tables += [(f"backbones[{b.name}].lengths", b.lengths) for b in self.backbones]
        tables += [(f"backbones[{b.name}].methods_by_length", b.methods_by_length) for b in self.backbones]
        for label, table in tables:
            for x in table:
                if parse_length(x) not in known:
                    raise ConfigError(f"{label}: length {x!r} is not in lengths {self.lengths}")
        unknown = set(self.only_backbones) - {b.name for b in self.backbones}
        if unknown:
            raise ConfigError(f"only_backbones: no entry named {sorted(unknown)} "
                              f"(entries: {[b.name for b in self.backbones]})")
        bad = {parse_length(x) for x in self.only_lengths} - known
        if bad:
            raise ConfigError(f"only_lengths: {sorted(bad)} not in lengths {self.lengths}")
        for b in self.backbones:                   # an entry that plans no cell is a config mistake
            if not any(self.methods_at(b, L) for L in self.lengths_for(b)):
                raise ConfigError(f"backbones[{b.name}]: no method left at any of its lengths "
                                  f"(methods_by_length filters the job's methods; give the entry "
                                  f"its own methods to run others)")
        counts = [self.n_examples, *self.n_examples_by_length.values(),
                  *(v for b in self.backbones for v in b.n_examples_by_length.values())]
        if any(int(v) < 1 for v in counts):
            raise ConfigError("n_examples must be >= 1")
        return self

    def lengths_for(self, entry: BackboneEntry) -> list[str]:
        return list(entry.lengths or self.lengths)

    def examples_at(self, length: str, entry: BackboneEntry | None = None) -> int:
        by = {parse_length(k): int(v) for k, v in self.n_examples_by_length.items()}
        if entry is not None:
            by.update({parse_length(k): int(v) for k, v in entry.n_examples_by_length.items()})
        return by.get(parse_length(length), self.n_examples)

    def methods_at(self, entry: BackboneEntry, length: str) -> list[str]:
        """Methods to run for ``entry`` at ``length``: the entry's ``methods`` (else the job's),
        filtered by the entry's ``methods_by_length`` (else, for job methods only, the job's table).
        An entry that names its own methods is not filtered by the job-wide table: add-on entries
        exist to run what that table leaves out, e.g. the dense router at 1M."""
        ms = list(entry.methods or self.methods)
        table = entry.methods_by_length or ({} if entry.methods else self.methods_by_length)
        by = {parse_length(k): list(v) for k, v in table.items()}
        allowed = by.get(parse_length(length))
        return [m for m in ms if allowed is None or m in allowed]

    # --- the runner's hooks ------------------------------------------------------------------
    def plan(self) -> tuple[list[dict], dict]:
        """One cell per (entry, budget, task, length, example) whose methods are not empty."""
        from nbcore.evals.ruler import Ruler
        cells = []
        only_n = {parse_length(x) for x in self.only_lengths}
        for b in self.backbones:
            if self.only_backbones and b.name not in self.only_backbones:
                continue
            model = b.model_dict()
            for budget in self.budgets:
                nb = dataclasses.asdict(notebank_for(b, budget))
                for task in self.tasks:
                    for L in self.lengths_for(b):
                        n = parse_length(L)
                        methods = self.methods_at(b, L)
                        if not methods or (only_n and n not in only_n):
                            continue
                        bench = Ruler(tasks=[task], lengths=[n], n_examples=self.examples_at(L, b), seed=self.seed,
                                      max_new_tokens=self.max_new_tokens)
                        for item in bench.examples():
                            i = item["index"]
                            cells.append(make_cell(
                                bench, item, cell_path(self.output, b.name, budget.name, task, n, i), model=model,
                                methods=methods, notebank=nb, block_size=self.block_size,
                                threads=self.num_cpus_per_cell, labels={"backbone": b.label, "budget": budget.name},
                                method_names=b.method_names, entry=b.name,
                                key=dict(backbone=b.label, budget=budget.name, task=task, length=n, index=i)))
        return cells, {}

    def cell_order(self, cell: dict):
        # Longest first: better packing, and the slow 1M cells start early. Example-major within a
        # length: a run stopped part-way has whole examples of every task (six-task means exist).
        return -cell["item"]["length"], cell["item"]["index"]

    def resources(self) -> tuple[float, float]:
        return self.num_cpus_per_cell, self.num_gpus_per_cell

    def write_report(self, df, cells: list[dict] | None, notes: dict) -> dict:
        from notebank.pipeline.reporting.cost import cost_models
        from notebank.pipeline.reporting.ruler import write_report
        return write_report(df, self.output, self.report_title, meta=report_meta(self, cells),
                            costs=cost_models(self.backbones, self.budgets, notebank_for),
                            answer_budget=self.max_new_tokens, config_of=self.config_of)

    def report_from_rows(self, df) -> dict:
        return self.write_report(df, None, {})

    def validate_rows(self, table):
        from notebank.schemas.results import rows_table
        return rows_table(table)

    def config_of(self, label: str, budget: str, method: str) -> dict | None:
        """The config behind the rows of (reported backbone, budget, method), for results.json's config
        hash: the entry that ran them (an entry renaming a method to `method` first, then one naming it
        in its own methods, then the entry named like the label), its model spec and NoteBank config
        under the budget, the method name it ran, the generation budget and seed. None when no entry
        reports as `label` (rows kept from entries no longer in the config)."""
        entries = [b for b in self.backbones if b.label == label]
        if not entries:
            return None
        b = sorted(entries, key=lambda e: (method not in e.method_names.values(), method not in e.methods,
                                           e.name != label))[0]
        bud = next((x for x in self.budgets if x.name == budget), None)
        nb = notebank_for(b, bud) if bud is not None else b.notebank
        return {"entry": b.name, "model": dataclasses.asdict(b.model), "notebank": dataclasses.asdict(nb),
                "method": {v: k for k, v in b.method_names.items()}.get(method, method),
                "max_new_tokens": self.max_new_tokens, "seed": self.seed}


def notebank_for(entry: BackboneEntry, budget: BudgetEntry) -> NoteBankConfig:
    """The entry's notebank config with the budget's (C, W, B) where the budget sets them."""
    kw = dataclasses.asdict(entry.notebank)
    for k in ("chunk_size", "write_budget", "note_budget"):
        if getattr(budget, k) is not None:
            kw[k] = getattr(budget, k)
    return NoteBankConfig(**kw).validate()
