"""Parquet/Arrow schemas and manifest formats, each defined once, versioned, validated on write and read.

- schemas.archive  the archive layout: notes and documents Parquet datasets, group commit records
- schemas.manifest the run fingerprint record and file references (JSON)
- schemas.answers  answers Parquet (one row per question and method)
- schemas.inputs   corpus and question row formats
- schemas.results  evaluation results: per-example rows (results.parquet) and the summary (results.json)
"""
from notebank.schemas._base import PARQUET_WRITE_OPTIONS, SchemaError

__all__ = ["SchemaError", "PARQUET_WRITE_OPTIONS"]
