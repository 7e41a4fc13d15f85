"""Benchmark task generators: RULER synthetic tasks, phrased needle tasks (other wordings and a
held-out prose haystack, ``phrased``; found by name through ``generate`` / ``score``), haystack
text, and the project tokenizer."""
from nbcore.tasks.ruler import PAPER_SIX, TASKS, generate, is_task, score, string_match_all

__all__ = ["PAPER_SIX", "TASKS", "generate", "is_task", "score", "string_match_all"]
