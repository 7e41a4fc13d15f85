"""Benchmark task generators: RULER synthetic tasks, haystack text, and the project tokenizer."""
from nbcore.tasks.ruler import PAPER_SIX, TASKS, generate, score, string_match_all

__all__ = ["PAPER_SIX", "TASKS", "generate", "score", "string_match_all"]
