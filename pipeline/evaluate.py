"""The evaluation sweep runner on Ray Data: one runner for every `benchmark:` job of jobs/evaluate.py.

A job config (pipeline/benchmarks.py names them: `ruler` pipeline/evaluate_ruler.py, `longbench`
pipeline/evaluate_longbench.py, `mone` pipeline/evaluate_mone.py) turns its YAML into cells, one per
(model entry, example item of an nbcore benchmark, nbcore.evals). This module does the rest:

  plan     cfg.plan() -> (cells, notes); a cell is a JSON-able dict: benchmark name + options, the
           example item, the model spec, methods, notebank config, labels, and its Parquet `path`
  resume   a cell whose file exists is done (files are written to a temporary name, then renamed);
           with cfg.measurement_key, cells are also restored from a shipped results.parquet
  fan out  one Ray Data dataset of the cells, ordered by model (backbone spec):
           map_batches(CellRunner, batch_size=1, compute=ActorPoolStrategy(size=n), num_gpus=...): an
           actor loads a model when its first cell of that model arrives (so once per model), then per
           cell rebuilds the benchmark, runs benchmark.evaluate(model, item, methods), stamps the
           labels and commits the cell's Parquet file itself; the driver gets one small record per cell
  results  <output>/results.parquet from the finished cells (checked by cfg.validate_rows), then
           cfg.write_report(rows, cells, notes): summary.json, report.md and plots (pipeline/reporting)
  report   report_from_results: the report again from results.parquet alone (--report-only)

Layout under `output`: cells/<job's path parts>/<index>.parquet (scratch, git-ignored), results.parquet,
summary.json, report.md, *.png.
"""
from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import dataclass, field
from typing import ClassVar

from nbcore.config import NoteBankConfig
from notebank.pipeline.config import BenchmarkJobConfig, ConfigError, ModelSpec
from notebank.pipeline.fanout import cell_result, finish_sweep, unfinished

K = 1024


def parse_length(s) -> int:
    """'4K' -> 4096, '1M' -> 1048576, '1500' -> 1500 (tokens, >= 1)."""
    t = str(s).strip().upper()
    try:
        if t.endswith("M"):
            n = int(float(t[:-1]) * K * K)
        elif t.endswith("K"):
            n = int(float(t[:-1]) * K)
        else:
            n = int(t)
    except ValueError:
        raise ConfigError(f"bad length {s!r} (use e.g. 4K, 64K, 1M or 4096)") from None
    if n < 1:
        raise ConfigError(f"bad length {s!r}: must be >= 1 token")
    return n


# ---------------------------------------------------------------------------------------------
# What a job config gives the runner
# ---------------------------------------------------------------------------------------------
@dataclass
class SweepJobConfig(BenchmarkJobConfig):
    """A `benchmark:` job of jobs/evaluate.py, as the runner sees it. Subclasses declare the YAML
    keys (dataclass fields) and implement plan() and write_report()."""

    units: ClassVar[tuple[str, str]] = ("cells", "cell")     # CLI summary keys / progress bar unit
    measurement_key: ClassVar[list[str] | None] = None      # columns naming one measurement: shipped
    #                                                         results.parquet rows are kept and restored
    report_planned_only: ClassVar[bool] = False             # report the planned cells (else every finished one)
    num_actors: int = 0                     # model-holding actors per model; 0: as many as the Ray cluster fits
    accelerator_type: str | None = None     # e.g. H100 (Ray accelerator type of the actors' GPUs)
    report_only: bool = False               # gather finished cells into results.parquet, report, run nothing
    #                                         (jobs/evaluate.py --report-only: from results.parquet alone)

    def plan(self) -> tuple[list[dict], dict]:
        """-> (cells, notes): the cells in plan order; notes are planning facts for the report/summary."""
        raise NotImplementedError

    def write_report(self, df, cells: list[dict], notes: dict) -> dict:
        """Write summary.json, report.md and plots under the (local) output. -> the summary dict."""
        raise NotImplementedError

    def cell_order(self, cell: dict):
        """Sort key of the cells to run (default: plan order)."""
        return 0

    def resources(self) -> tuple[float, float]:
        """(CPUs, GPUs) per cell task."""
        return 1.0, 0.0

    def summary_extra(self, cells: list[dict], notes: dict) -> dict:
        """Job-specific entries of the CLI summary."""
        return {}

    def validate_rows(self, table):
        """Check (and stamp) the rows of results.parquet before it is written and when it is read
        (a pyarrow Table -> the table to write). Default: as they are."""
        return table

    def report_from_rows(self, df) -> dict:
        """The report of rows read back from results.parquet (jobs/evaluate.py --report-only), with no
        cells at hand. Default: write_report without cells or planning notes."""
        return self.write_report(df, [], {})


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

    @property
    def label(self) -> str:
        """The backbone name its rows report (`report_as`, default `name`)."""
        return self.report_as or self.name

    def model_dict(self) -> dict:
        """The model spec as a dict, a local checkpoint path made absolute (workers may run elsewhere)."""
        import dataclasses
        model = dataclasses.asdict(self.model)
        if model.get("path") and "://" not in model["path"] and os.path.exists(model["path"]):
            model["path"] = os.path.abspath(model["path"])
        return model


@dataclass
class BackboneSweepConfig(SweepJobConfig):
    """A job over `backbones` entries read by the NoteBank reader (benchmark: ruler and longbench)."""

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

    def check_methods(self, names) -> None:
        """Every name parses (nbcore.evals.methods.method_config)."""
        from nbcore.evals.methods import method_config
        for m in names:
            try:
                method_config(m)
            except ValueError as e:
                raise ConfigError(f"methods: {e}") from e


def make_cell(bench, item: dict, path: str, *, model: dict, methods, notebank: dict | None = None,
              block_size: int = 65536, threads: int = 1, labels: dict | None = None,
              method_names: dict | None = None, key: dict | None = None, **extra) -> dict:
    """One cell: everything `run_cell` needs, JSON-able (the example's data travels with it).
    labels: columns stamped on every row (e.g. backbone, budget); key: the cell's values of the
    job's measurement key (all but `method`), used to restore it from a shipped results.parquet."""
    return dict(benchmark=bench.name, options=bench.options(), item=item, model=model, methods=list(methods),
                notebank=notebank, block_size=int(block_size), threads=max(1, int(threads)),
                labels=dict(labels or {}), method_names=dict(method_names or {}), key=dict(key or {}),
                path=path, **extra)


def cell_path(output: str, *parts) -> str:
    """<output>/cells/<parts...>/<last part as a 4-digit index>.parquet"""
    *dirs, index = parts
    return "/".join([output.rstrip("/"), "cells", *map(str, dirs), f"{int(index):04d}.parquet"])


# ---------------------------------------------------------------------------------------------
# One cell, on an actor that holds the model
# ---------------------------------------------------------------------------------------------
def load_model(bench, spec: dict):
    """The model a benchmark evaluates: an nbcore Backbone (model_kind backbone:
    nbcore.backbones.loading.build_backbone) or the benchmark's own loader."""
    if bench.model_kind == "backbone":
        from nbcore.backbones import loading
        return loading.build_backbone(spec)
    return bench.load_model(spec)


def evaluate_cell(cell: dict, model, load_error: str | None = None) -> dict:
    """Evaluate one cell on a loaded model and commit its Parquet file (tmp name, then rename).
    -> {path, error, n_tokens}. A failure (or the model's `load_error`) is returned, not raised: one
    bad example never stops a sweep."""
    from nbcore.evals import build_benchmark
    t0 = time.perf_counter()
    tokens = "n_tokens"
    try:
        if load_error is not None:
            raise RuntimeError(f"the model could not be loaded: {load_error}")
        bench = build_benchmark(cell["benchmark"], cell["options"])
        tokens = bench.tokens_column
        nb = NoteBankConfig(**cell["notebank"]) if cell.get("notebank") is not None else None
        rows = bench.evaluate(model, cell["item"], cell["methods"], notebank=nb, block_size=cell.get("block_size", 65536))
        err = None
    except Exception as e:  # noqa: BLE001 - a failed example is recorded, the sweep goes on
        rows, err = [], f"{type(e).__name__}: {e}"
    renames = cell.get("method_names") or {}
    for r in rows:
        r.update({**cell.get("labels", {}), "method": renames.get(r["method"], r["method"]),
                  "cell_s": time.perf_counter() - t0})
    return cell_result(cell, rows, err, tokens_key=tokens)


def run_cell(cell: dict) -> dict:
    """One cell in this process, its model loaded for it (a single cell; sweeps use CellRunner)."""
    import torch

    from nbcore.evals import build_benchmark
    torch.set_num_threads(max(1, int(cell.get("threads", 1))))
    try:
        model, err = load_model(build_benchmark(cell["benchmark"], cell["options"]), cell["model"]), None
    except Exception as e:  # noqa: BLE001 - recorded as the cell's error
        model, err = None, f"{type(e).__name__}: {e}"
    return evaluate_cell(cell, model, err)


class CellRunner:
    """Ray Data actor (map_batches, batch_size=1) that evaluates cells, each committed to its own
    Parquet file by the actor. It holds one model at a time and loads a cell's model only when it
    differs from the one it holds (the driver orders the cells by model, so an actor loads each
    model at most once). A model that fails to load fails each of its cells with that error
    (recorded, not retried) instead of failing the sweep."""

    def __init__(self, threads: int = 1):
        import torch
        torch.set_num_threads(max(1, int(threads)))
        self.key, self.model, self.error = None, None, None
        self.loads = 0

    def _use(self, cell: dict) -> None:
        from nbcore.evals import build_benchmark
        bench = build_benchmark(cell["benchmark"], cell["options"])
        key = model_key(bench.model_kind, cell["model"])
        if key == self.key:
            return
        self.key, self.model, self.error = key, None, None      # drop the previous model before loading
        gc.collect()
        from notebank.pipeline.allocator import runs_on_cpu, tune_cpu_malloc
        if runs_on_cpu(cell["model"]):
            tune_cpu_malloc()          # stable heap reuse for the forward's temporaries (pipeline/allocator.py)
        self.loads += 1
        try:
            self.model = load_model(bench, cell["model"])
        except Exception as e:  # noqa: BLE001 - reported per cell
            self.error = f"{type(e).__name__}: {e}"

    def __call__(self, batch: dict) -> dict:
        out = {"path": [], "error": [], "n_tokens": []}
        for packed in batch["cell"]:
            cell = json.loads(packed)
            try:
                self._use(cell)
                res = evaluate_cell(cell, self.model, self.error)
            except Exception as e:  # noqa: BLE001 - e.g. an unknown benchmark: this cell fails, the sweep goes on
                res = {"path": cell["path"], "error": f"{type(e).__name__}: {e}", "n_tokens": 0}
            for k in out:
                out[k].append(res[k])
        return out


def model_key(model_kind: str, model: dict) -> str:
    """What one loaded model is: the benchmark's model kind + the model spec (the LongBench job's three
    benchmarks share one backbone)."""
    return json.dumps([model_kind, model], sort_keys=True)


def model_groups(cells: list[dict]) -> list[list[dict]]:
    """The cells grouped by the model they load (model_key), groups in order of first appearance,
    cells in their given order within a group."""
    from nbcore.evals import get_benchmark
    groups: dict[str, list[dict]] = {}
    for c in cells:
        try:
            kind = get_benchmark(c["benchmark"]).model_kind
        except KeyError:
            kind = None                  # an unknown benchmark: its cells fail on the actor, with the reason
        groups.setdefault(model_key(kind, c["model"]), []).append(c)
    return list(groups.values())


def actors_that_fit(cpus: float, gpus: float, wanted: int, n_cells: int) -> int:
    """How many actors to start for `n_cells` cells: `wanted` (0: as many as the live Ray nodes hold
    at `cpus`/`gpus` each), at most one per cell, at least one."""
    import ray
    n = wanted
    if n <= 0:
        n = 0
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            r = node.get("Resources", {})
            fits = [int(r.get(k, 0.0) // v) for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0]
            n += min(fits) if fits else 1
    return max(1, min(n, n_cells))


def run_cells(cells: list[dict], cpus: float, gpus: float, *, num_actors: int = 0,
              accelerator_type: str | None = None, progress: bool = True, desc: str = "cells",
              unit: str = "cell") -> list[dict]:
    """Run `cells` on Ray Data (Ray initialised by the caller): one dataset of the cells, ordered by
    model (model_groups), through one pool of CellRunner actors; each actor loads a model when its
    first cell of that model arrives, so at most once per model. -> the cells' records ({path, error,
    n_tokens}) in completion order. Failures are reported on the bar and returned, not raised.

    One pool for every model, not one per model run one after another: a finished pool's actors
    leave only when Ray's reference counting collects them, and until then they hold the CPUs (or
    GPUs) the next pool waits for (seen: the second backbone's pool never started on 2 CPUs)."""
    import ray
    from tqdm import tqdm

    from notebank.pipeline.dataplane import quiet_ray_data, require_room_for_actor
    results: list[dict] = []
    if not cells:
        return results
    require_room_for_actor(cpus, gpus, ("the cells' CPUs (num_cpus_per_cell)", "GPUs (num_gpus_per_cell)"))
    quiet_ray_data(progress)
    ordered = [c for group in model_groups(cells) for c in group]
    n = actors_that_fit(cpus, gpus, num_actors, len(ordered))
    remote = {"accelerator_type": accelerator_type} if accelerator_type else {}
    ds = ray.data.from_items([{"cell": json.dumps(c)} for c in ordered], override_num_blocks=len(ordered))
    ds = ds.map_batches(CellRunner, batch_size=1, compute=ray.data.ActorPoolStrategy(size=n), num_cpus=cpus,
                        num_gpus=gpus or None, fn_constructor_kwargs={"threads": ordered[0].get("threads", 1)},
                        **remote)
    bar = tqdm(total=len(ordered), desc=desc, unit=unit, disable=not progress)
    for batch in ds.iter_batches(batch_size=None, batch_format="pandas"):
        for rec in batch.to_dict("records"):
            err = rec["error"] if isinstance(rec["error"], str) and rec["error"] else None   # null: None or NaN
            rec = {"path": rec["path"], "error": err, "n_tokens": int(rec["n_tokens"] or 0)}
            results.append(rec)
            if rec["error"]:
                bar.write(f"failed {rec['path']}: {rec['error']}")
            bar.update(1)
    bar.close()
    return results


# ---------------------------------------------------------------------------------------------
# The sweep (driver)
# ---------------------------------------------------------------------------------------------
def run_sweep(cfg: SweepJobConfig) -> dict:
    """Run (or resume) a job's cells on Ray (initialised by the caller unless report_only), then
    write results.parquet and the report. -> the CLI summary."""
    cfg.validate()
    t0 = time.perf_counter()
    cells, notes = cfg.plan()
    todo = cells_to_run(cfg, cells)
    missing = len(todo)
    if cfg.report_only:         # rebuild from finished cells, run nothing
        todo = []
    todo.sort(key=cfg.cell_order)
    cpus, gpus = cfg.resources()
    plural, unit = cfg.units
    results = run_cells(todo, cpus, gpus, num_actors=cfg.num_actors, accelerator_type=cfg.accelerator_type,
                        progress=cfg.progress, desc=plural, unit=unit)
    failed = [r for r in results if r["error"]]

    def report(df):
        if cfg.measurement_key:
            df = drop_repeated_measurements(df, cfg.measurement_key)
        return cfg.write_report(df, cells, notes)

    summary = finish_sweep(cfg.output, report, cells if cfg.report_planned_only else None,
                           key=cfg.measurement_key, prepare=cfg.validate_rows)
    return {plural: len(cells), f"{plural}_run": len(todo), f"{plural}_skipped": len(cells) - missing,
            f"{plural}_failed": len(failed),
            f"{plural}_missing": missing if cfg.report_only else len(failed),
            "tokens": sum(r["n_tokens"] for r in results), "wall_s": round(time.perf_counter() - t0, 2),
            "summary_keys": len(summary), "output": cfg.output, **cfg.summary_extra(cells, notes),
            "failures": [f"{f['path']}: {f['error']}" for f in failed[:5]]}


def report_from_results(cfg: SweepJobConfig) -> dict:
    """Rebuild a job's report from <output>/results.parquet alone (jobs/evaluate.py --report-only): no
    model, no Ray, no cells; the file is read and validated (cfg.validate_rows), never written.
    -> the CLI summary."""
    import fsspec
    from notebank.schemas._base import read_parquet_file
    cfg.validate()
    url = cfg.output.rstrip("/") + "/results.parquet"
    fs, path = fsspec.core.url_to_fs(url)
    if fs.protocol not in ("file", ("file", "local")) and "://" in cfg.output:
        raise ConfigError(f"--report-only writes the report with local file I/O; output {cfg.output!r} is not local")
    if not fs.exists(path):
        raise ConfigError(f"--report-only: {url} does not exist (run the sweep first, or set output)")
    with fs.open(path, "rb") as f:
        table = read_parquet_file(f)
    try:
        table = cfg.validate_rows(table)
    except ValueError as e:                        # schemas.SchemaError: name the file
        raise ConfigError(f"{url}: {e}") from e
    df = table.to_pandas()
    if cfg.measurement_key:
        df = drop_repeated_measurements(df, cfg.measurement_key)
    summary = cfg.report_from_rows(df)
    return {"rows": len(df), "summary_keys": len(summary), "output": cfg.output, "source": url}


def cells_to_run(cfg: SweepJobConfig, cells: list[dict]) -> list[dict]:
    """The planned cells with no file under ``cfg.output`` that the shipped results.parquet cannot
    restore either (in plan order)."""
    todo = unfinished(cfg.output, cells)
    if cfg.measurement_key:
        todo = restore_cells(cfg.output, todo, cfg.measurement_key)
    return todo


def restore_cells(output: str, todo: list[dict], key: list[str]) -> list[dict]:
    """Write back the cell files of a fresh clone from the shipped <output>/results.parquet, so a rerun
    skips what was measured (`cells/` is git-ignored scratch). A cell of `todo` (unfinished cells) is
    restored only when the file holds a row for every method the cell plans (after `method_names`)
    under the cell's `key` values (its reported backbone, budget, task, length and example, say).
    -> the cells still to run."""
    import fsspec
    import pyarrow as pa
    from notebank.schemas._base import read_parquet_file

    from notebank.pipeline.fanout import commit_parquet
    fs, path = fsspec.core.url_to_fs(output.rstrip("/") + "/results.parquet")
    if not todo or not fs.exists(path):
        return todo
    with fs.open(path, "rb") as f:
        shipped = read_parquet_file(f)
    df = shipped.to_pandas()
    if not set(key) <= set(df.columns):
        return todo
    df = drop_repeated_measurements(df, key)
    # the key columns a cell names (a key column it does not name, such as MoNe's rag_k, tells apart
    # several rows of one cell)
    cols = [k for k in key if k != "method" and k in todo[0]["key"]]
    groups = dict(iter(df.groupby(cols, sort=False)))
    left = []
    for c in todo:
        rows = groups.get(tuple(c["key"][k] for k in cols))
        want = {(c.get("method_names") or {}).get(m, m) for m in c["methods"]}
        rows = None if rows is None else rows[rows["method"].isin(want)]
        if rows is None or set(rows["method"]) != want:
            left.append(c)
            continue
        # the shipped file's Arrow types, not pandas' (its str columns come back as large_string, and
        # collect() cannot concatenate a restored cell with a freshly run one: string vs large_string)
        commit_parquet(pa.Table.from_pandas(rows, schema=shipped.schema, preserve_index=False), c["path"])
    return left


def drop_repeated_measurements(df, key: list[str]):
    """Keep one row per measurement `key`. Two entries can measure the same example under the same
    method (an add-on entry such as tiny-gdn-dense1m, run after the main cells already had that method
    at one task); a repeat would weigh its example twice."""
    return df.drop_duplicates(subset=key, keep="first")


def report_meta(cfg, cells: list[dict] | None) -> dict:
    """Where and when the report was made (the cells may come from several resumed runs). cells None:
    a report rebuilt from results.parquet (--report-only), which says so and nothing about this machine."""
    if cells is None:
        return {"source": "results.parquet; report rebuilt from its rows without running a model "
                          "(`python jobs/evaluate.py -c <config> --report-only`)"}
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
