"""RULER evaluation sweeps on Ray: backbones x budgets x tasks x lengths x examples, every method
answered from one ingest per example. Resumable: each finished cell is one Parquet file
(written to a temporary name, then renamed); a rerun skips cells whose file exists.

Layout under `output`:
  cells/<backbone>/<budget>/<task>/<length>/<index>.parquet   per-example rows (one per method)
  results.parquet, summary.json, report.md, *.png               written by the final report step
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field

from nbcore.config import NoteBankConfig
from pipeline.config import BenchmarkJobConfig, ConfigError, ModelSpec
from pipeline.fanout import cell_result, finish_sweep, run_all, unfinished

K = 1024


@dataclass
class BackboneEntry:
    name: str = ""                                  # label used in results (e.g. tiny-gdn)
    model: ModelSpec = field(default_factory=ModelSpec)
    notebank: NoteBankConfig = field(default_factory=NoteBankConfig)   # per-backbone defaults (C=256 for Mamba-2)
    # Reporting: results rows say `report_as` (default: name) and rename methods through
    # `method_names`, e.g. an adapter entry reports as tiny-gdn with nb-tf-top2 -> nb-lora-top2.
    report_as: str = ""
    method_names: dict = field(default_factory=dict)
    methods: list = field(default_factory=list)     # this backbone's methods (default: the job's)
    # this backbone's per-length method filter (default: the job's table, unless `methods` is given)
    methods_by_length: dict = field(default_factory=dict)
    lengths: list = field(default_factory=list)     # this backbone's lengths (default: the job's)
    n_examples_by_length: dict = field(default_factory=dict)   # overrides the job's table


@dataclass
class BudgetEntry:
    """A (C, W, B) variant; unset fields keep the backbone's notebank config."""
    name: str = "default"
    chunk_size: int | None = None
    write_budget: int | None = None
    note_budget: int | None = None


@dataclass
class BackboneSweepConfig(BenchmarkJobConfig):
    """A job over `backbones` entries (benchmark: ruler and longbench)."""

    backbones: list[BackboneEntry] = field(default_factory=list)

    def check_backbones(self) -> None:
        """At least one entry, each named without '/' (names and labels are path components) and
        with a valid model spec."""
        if not self.backbones:
            raise ConfigError("backbones: at least one entry is required")
        for b in self.backbones:
            if not b.name or "/" in b.name:
                raise ConfigError(f"backbones: each entry needs a name without '/', got {b.name!r}")
            b.model.validate(f"backbones[{b.name}].model")
            if "/" in (b.report_as or ""):
                raise ConfigError(f"backbones[{b.name}].report_as must not contain '/'")


@dataclass
class EvalJobConfig(BackboneSweepConfig):
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
    report_only: bool = False                       # rebuild results/report from finished cells, run nothing
    only_backbones: list[str] = field(default_factory=list)   # run just these entries (report: all cells)
    only_lengths: list[str] = field(default_factory=list)     # run just these lengths, e.g. [4K, 64K]

    def validate(self):
        from nbcore.evals.ruler_eval import method_config
        self.check_backbones()
        names = [*self.methods, *(m for b in self.backbones for m in b.methods),
                 *(m for ms in self.methods_by_length.values() for m in ms),
                 *(m for b in self.backbones for ms in b.methods_by_length.values() for m in ms)]
        for m in names:
            try:
                method_config(m)
            except ValueError as e:
                raise ConfigError(str(e)) from e
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


def parse_length(s) -> int:
    s = str(s).strip().upper()
    try:
        if s.endswith("M"):
            return int(float(s[:-1]) * K * K)
        if s.endswith("K"):
            return int(float(s[:-1]) * K)
        return int(s)
    except ValueError:
        raise ConfigError(f"bad length {s!r} (use e.g. 4K, 64K, 1M)") from None


def _nb_for(entry: BackboneEntry, budget: BudgetEntry) -> NoteBankConfig:
    kw = dataclasses.asdict(entry.notebank)
    for k in ("chunk_size", "write_budget", "note_budget"):
        if getattr(budget, k) is not None:
            kw[k] = getattr(budget, k)
    return NoteBankConfig(**kw).validate()


def cell_path(out: str, bb: str, budget: str, task: str, length: int, index: int) -> str:
    return f"{out.rstrip('/')}/cells/{bb}/{budget}/{task}/{length}/{index:04d}.parquet"


_BACKBONES: dict = {}


def _backbone(model: dict):
    """One loaded backbone per worker process and model spec (tasks reuse worker processes)."""
    key = json.dumps(model, sort_keys=True)
    if key not in _BACKBONES:
        from pipeline.worker import build_backbone
        _BACKBONES[key] = build_backbone(model)
    return _BACKBONES[key]


def run_cell(cell: dict) -> dict:
    """Evaluate one example under every method and commit its Parquet file. Pure except for I/O."""
    import torch
    from nbcore.evals.ruler_eval import EvalSpec, evaluate_example
    threads = max(1, int(cell.get("threads", 1)))
    torch.set_num_threads(threads)
    spec = EvalSpec(cell["task"], cell["length"], cell["index"], cell["seed"], cell["max_new_tokens"])
    t0 = time.perf_counter()
    try:
        bb = _backbone(cell["model"])
        rows = evaluate_example(bb, spec, cell["methods"], NoteBankConfig(**cell["notebank"]), cell["block_size"])
        err = None
    except Exception as e:  # noqa: BLE001 - a failed example is recorded, the sweep goes on
        rows, err = [], f"{type(e).__name__}: {e}"
    rename = cell.get("method_names") or {}
    for r in rows:
        r.update(backbone=cell.get("report_as") or cell["backbone"], budget=cell["budget"],
                 cell_s=time.perf_counter() - t0, method=rename.get(r["method"], r["method"]))
    return cell_result(cell, rows, err)


def plan_cells(cfg: EvalJobConfig) -> list[dict]:
    cells = []
    threads = max(1, int(cfg.num_cpus_per_cell))
    only_n = {parse_length(x) for x in cfg.only_lengths}
    for b in cfg.backbones:
        if cfg.only_backbones and b.name not in cfg.only_backbones:
            continue
        model = dataclasses.asdict(b.model)
        if model.get("path") and "://" not in model["path"] and os.path.exists(model["path"]):
            model["path"] = os.path.abspath(model["path"])   # workers may run elsewhere
        for budget in cfg.budgets:
            nb = dataclasses.asdict(_nb_for(b, budget))
            for task in cfg.tasks:
                for L in cfg.lengths_for(b):
                    n = parse_length(L)
                    methods = cfg.methods_at(b, L)
                    if not methods or (only_n and n not in only_n):
                        continue
                    for i in range(cfg.examples_at(L, b)):
                        cells.append(dict(backbone=b.name, budget=budget.name, model=model,
                                          notebank=nb, task=task, length=n, index=i, seed=cfg.seed,
                                          report_as=b.report_as or b.name, method_names=dict(b.method_names),
                                          methods=methods, max_new_tokens=cfg.max_new_tokens,
                                          block_size=cfg.block_size, threads=threads,
                                          path=cell_path(cfg.output, b.name, budget.name, task, n, i)))
    return cells


def run_sweep(cfg: EvalJobConfig) -> dict:
    """Run (or resume) the sweep, then write the report. -> summary for the CLI."""
    cfg.validate()
    t0 = time.perf_counter()
    cells = plan_cells(cfg)
    todo = restore_cells(cfg.output, unfinished(cfg.output, cells))
    missing = len(todo)
    if cfg.report_only:
        todo = []
    # Longest first: better packing, and the slow 1M cells start early. Example-major within a
    # length: a run stopped part-way has whole examples of every task (six-task means exist).
    todo.sort(key=lambda c: (-c["length"], c["index"]))
    results = run_all(run_cell, todo, cfg.num_cpus_per_cell, cfg.num_gpus_per_cell, progress=cfg.progress)
    failed = [r for r in results if r["error"]]

    def report(df):
        from nbcore.evals.report import write_report
        return write_report(drop_repeated_measurements(df), cfg.output, cfg.report_title, meta=_report_meta(cfg, cells))

    summary = finish_sweep(cfg.output, report, key=MEASUREMENT_KEY)
    return {"cells": len(cells), "cells_run": len(todo), "cells_skipped": len(cells) - missing,
            "cells_failed": len(failed), "cells_missing": missing if cfg.report_only else len(failed),
            "tokens": sum(r["n_tokens"] for r in results), "wall_s": round(time.perf_counter() - t0, 2),
            "summary_keys": len(summary)}


MEASUREMENT_KEY = ["backbone", "budget", "method", "task", "length", "index"]


def restore_cells(output: str, todo: list[dict]) -> list[dict]:
    """Write back the cell files of a fresh clone from the shipped <output>/results.parquet, so a rerun
    skips what was measured (`cells/` is git-ignored scratch). A cell of `todo` (unfinished cells) is
    restored only when the file holds a row for every method the cell plans (after `method_names`)
    under its reported backbone, budget, task, length and example. -> the cells still to run."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.fanout import commit_parquet
    fs, path = fsspec.core.url_to_fs(output.rstrip("/") + "/results.parquet")
    if not todo or not fs.exists(path):
        return todo
    with fs.open(path, "rb") as f:
        shipped = pq.read_table(f)
    df = shipped.to_pandas()
    if not set(MEASUREMENT_KEY) <= set(df.columns):
        return todo
    df = drop_repeated_measurements(df)
    groups = dict(iter(df.groupby(["backbone", "budget", "task", "length", "index"], sort=False)))
    left = []
    for c in todo:
        rows = groups.get((c["report_as"], c["budget"], c["task"], c["length"], c["index"]))
        want = {(c.get("method_names") or {}).get(m, m) for m in c["methods"]}
        rows = None if rows is None else rows[rows["method"].isin(want)]
        if rows is None or set(rows["method"]) != want:
            left.append(c)
            continue
        # the shipped file's Arrow types, not pandas' (its str columns come back as large_string, and
        # collect() cannot concatenate a restored cell with a freshly run one: string vs large_string)
        commit_parquet(pa.Table.from_pandas(rows, schema=shipped.schema, preserve_index=False), c["path"])
    return left


def drop_repeated_measurements(df):
    """Keep one row per (backbone, budget, method, task, length, example). Two entries can measure
    the same example under the same method (an add-on entry such as tiny-gdn-dense1m, run after the
    main cells already had that method at one task); a repeat would weigh its example twice."""
    return df.drop_duplicates(subset=MEASUREMENT_KEY, keep="first")


def _report_meta(cfg: EvalJobConfig, cells: list[dict]) -> dict:
    """Where and when the report was made (the cells may come from several resumed runs)."""
    import datetime
    import platform

    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {"report written": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{cpu}, {os.cpu_count()} CPUs, GPU: {gpu}",
            "cells": len(cells), "methods": ", ".join(cfg.methods),
            "command": "python jobs/evaluate.py -c <config> (see the config header); resumable"}
