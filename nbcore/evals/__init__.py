"""Benchmark scoring for NoteBank evaluations (paper App. C.2).

* :mod:`nbcore.evals.metrics` - answer metrics reimplemented from the official sources
  (LongBench ``qa_f1_score``/``rouge_score``/``classification_score``, LongBench v2's answer
  parser, MemoryAgentBench's ``substring_exact_match``).
* :mod:`nbcore.evals.longbench` - LongBench v1 prompts, generation budgets, per-dataset scores,
  category/overall macro-averages, seeded subsets and the JSONL loader; LongBench v2 0-shot prompt,
  parser, accuracy, the fits-in-budget filter and the ``data.json`` loader.
* :mod:`nbcore.evals.memoryagentbench` - parquet/JSON loaders, query prompts and accuracy.

Importing this package pulls in only the standard library (fsspec/pyarrow load on first use).
"""
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
    "normalize_answer",
    "qa_f1_score",
    "rouge_l_f",
    "rouge_score",
    "classification_score",
    "extract_choice",
    "substring_exact_match",
]
