"""Benchmarks of the NoteBank evaluations (paper App. C.2): examples, per-example evaluation, metrics.

Every benchmark implements one interface, :class:`nbcore.evals.base.Benchmark` (``examples()``,
``evaluate(model, item, methods)``, ``score(item, prediction, answers)``), and is found by name:

* ``ruler`` - :mod:`nbcore.evals.ruler` (RULER tasks of :mod:`nbcore.tasks.ruler`);
* ``longbench``, ``longbench_v2`` - :mod:`nbcore.evals.longbench`: LongBench v1 prompts, generation
  budgets, per-dataset scores, category/overall macro-averages, seeded subsets and the JSONL loader;
  LongBench v2 0-shot prompt, parser, accuracy, the fits-in-budget filter and the ``data.json`` loader;
* ``memoryagentbench`` - :mod:`nbcore.evals.memoryagentbench`: parquet/JSON loaders, query prompts, accuracy;
* ``mone`` - :mod:`nbcore.evals.mone`: MoNe vs ICL vs RAG on RULER (:mod:`nbcore.mone.evaluation`).

Shared pieces: :mod:`nbcore.evals.methods` (the method names - plain, jrt, clean-start,
nb-<router>-top<R>[-reset] - and the ingest-once / answer-every-method harness),
:mod:`nbcore.evals.metrics` (answer metrics reimplemented from the official sources: LongBench
``qa_f1_score``/``rouge_score``/``classification_score``, LongBench v2's answer parser,
MemoryAgentBench's ``substring_exact_match``) and :mod:`nbcore.evals.stats` (seeded bootstrap
intervals of evaluation means). Reports and plots live in ``pipeline/reporting``;
nothing here imports ray or pipeline.

The modules here import torch, transformers, fsspec and pyarrow only inside the functions that use them.
"""
from nbcore.evals.base import Benchmark, benchmark_names, build_benchmark, get_benchmark, register
from nbcore.evals.metrics import (
    classification_score,
    extract_choice,
    normalize_answer,
    qa_f1_score,
    rouge_l_f,
    rouge_score,
    substring_exact_match,
)

__all__ = [
    "Benchmark",
    "register",
    "get_benchmark",
    "build_benchmark",
    "benchmark_names",
    "normalize_answer",
    "qa_f1_score",
    "rouge_l_f",
    "rouge_score",
    "classification_score",
    "extract_choice",
    "substring_exact_match",
]
