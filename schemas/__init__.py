"""Parquet/Arrow schemas and manifest formats, each defined once, versioned, validated on write and read.

- schemas.notes    notes Parquet (one file per document)
- schemas.manifest per-document manifest records and the run fingerprint record (JSON)
- schemas.answers  answers Parquet (one row per question and method)
- schemas.inputs   corpus and question row formats
- schemas.results  evaluation results: per-example rows (results.parquet) and the summary (results.json)
"""
from notebank.schemas._base import PARQUET_WRITE_OPTIONS, SchemaError

__all__ = ["SchemaError", "PARQUET_WRITE_OPTIONS"]
