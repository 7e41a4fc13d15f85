"""Evaluation results: per-example rows (Parquet) and the summary of a sweep (results.json).

Two formats, each versioned and validated when written and when read:

``results.parquet`` - RULER per-example rows (``ruler.rows`` v1), one row per (backbone, budget,
    method, task, length, example). Required columns: backbone, method, task (strings), length,
    index (integers), score (0-100). Optional columns, checked when present: budget, the coverage
    columns (0-1), the counters (integers >= 0) and the stage timings (seconds >= 0) listed in
    OPTIONAL_COLUMNS. Other columns are kept unchecked (a benchmark may record more). A measurement
    may appear twice (two config entries ran the same example and method); the report keeps the
    first (pipeline.evaluate.drop_repeated_measurements). Files written before the schema existed
    carry no schema metadata; they are read as v1 and checked the same way.

``results.json`` - the summary (``results.summary`` v1), in the spirit of lm-evaluation-harness:

    {"schema": "results.summary", "schema_version": 1, "benchmark": "ruler",
     "results": {"<backbone>/<method>/<length>": {"metric": ..., "value": mean, "stderr": ...,
                 "n-samples": examples, "n_tasks": ..., "ci": [low, high], "ci_level": 0.95,
                 "model": ..., "config_hash": ...}, ...},
     "configs": {"<config_hash>": {the configuration the hash names}, ...},
     "config_parts": {"<hash>": {a part several configs share, e.g. a model entry}, ...},
     "bootstrap": {"n_boot": ..., "level": ..., "seed": ..., "resampling": ...},
     "versions": {"results.summary": 1, "notebank": ..., "numpy": ..., ...},
     "provenance": {"git": {"commit": ..., "dirty": ...}, "versions": {... torch, transformers, ray ...},
                    "date": ..., "host": ..., "job": ..., "config": {the job's config}}}   (optional)

    config_hash = the first 16 hex digits of the SHA-256 of the configuration's canonical JSON
    (sorted keys); a reader recomputes it. A configuration names the parts it shares with others by
    their hashes (its "parts" list), so the hash covers them too and each is stored once.
    `summary.json` beside it keeps the flat {"<key>": mean rounded to 2 decimals} map older readers
    know; both come from the same entries.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, fields

import pyarrow as pa
import pyarrow.compute as pc

from notebank.schemas._base import SchemaError, dumps_json, read_parquet_url, schema_meta, with_meta

ROWS_NAME, ROWS_VERSION = "ruler.rows", 1
SUMMARY_NAME, SUMMARY_VERSION = "results.summary", 1

REQUIRED_COLUMNS = {"backbone": "string", "method": "string", "task": "string", "length": "int",
                    "index": "int", "score": "number"}
COVERAGE = ("archived_cov", "retrieved_cov")
COUNTERS = ("n_tokens", "n_notes", "archived_tokens", "replay_len", "address_bytes_per_note", "question_tokens",
            "answer_tokens")
TIMINGS = ("prefill_s", "write_s", "ingest_s", "probe_s", "route_s", "replay_generate_s", "answer_s", "cell_s")
OPTIONAL_COLUMNS = {"budget": "string", "prediction": "string", **{c: "number" for c in COVERAGE},
                    **{c: "int" for c in COUNTERS}, **{c: "number" for c in TIMINGS}}


# ---------------------------------------------------------------------------------------------
# Per-example rows
# ---------------------------------------------------------------------------------------------
def _kind_ok(t: pa.DataType, kind: str) -> bool:
    if kind == "string":
        return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)
    if kind == "int":
        return pa.types.is_integer(t)
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t)


def _range(table: pa.Table, col: str, lo: float, hi: float | None, where: str) -> None:
    x = table.column(col)
    if pa.types.is_null(x.type) or x.null_count == len(x):
        return
    bad = pc.less(x, lo)
    if hi is not None:
        bad = pc.or_(bad, pc.greater(x, hi))
    n = pc.sum(pc.cast(pc.fill_null(bad, False), pa.int64())).as_py() or 0
    if n:
        span = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise SchemaError(f"{where}: column '{col}' has {n} values outside {span}")


def validate_rows(table: pa.Table, where: str = "results rows") -> pa.Table:
    """Raise SchemaError unless `table` holds valid per-example rows (see module docstring). -> table."""
    meta = schema_meta(table.schema)
    name, version = meta.get("notebank.schema"), meta.get("notebank.schema_version")
    if name is not None and name != ROWS_NAME:
        raise SchemaError(f"{where}: expected '{ROWS_NAME}' rows, schema metadata says {name!r}")
    if name is not None and version != str(ROWS_VERSION):
        raise SchemaError(f"{where}: '{ROWS_NAME}' schema version {version!r} is not the supported "
                          f"version '{ROWS_VERSION}'")
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise SchemaError(f"{where}: missing required columns {missing}")
    for col, kind in {**REQUIRED_COLUMNS, **OPTIONAL_COLUMNS}.items():
        if col not in table.column_names:
            continue
        t = table.schema.field(col).type
        if not _kind_ok(t, kind):
            raise SchemaError(f"{where}: column '{col}' has type {t}, expected {kind}")
        if col in REQUIRED_COLUMNS and table.column(col).null_count:
            raise SchemaError(f"{where}: required column '{col}' has {table.column(col).null_count} nulls")
    if pa.types.is_floating(table.schema.field("score").type) and \
            pc.sum(pc.cast(pc.is_nan(table.column("score")), pa.int64())).as_py():
        raise SchemaError(f"{where}: column 'score' has NaN values")
    _range(table, "score", 0, 100, where)
    _range(table, "length", 1, None, where)
    _range(table, "index", 0, None, where)
    for c in COVERAGE:
        if c in table.column_names:
            _range(table, c, 0, 1, where)
    for c in (*COUNTERS, *TIMINGS):
        if c in table.column_names:
            _range(table, c, 0, None, where)
    return table


def _nullable_counters(df):
    """pandas turns an integer counter that older rows lack (e.g. answer_tokens, added later) into
    float with NaN when rows are concatenated; give such a column back its integer type, with nulls
    for the rows that never had it. Non-integral values stay float (and fail validation)."""
    df = df.copy(deep=False)
    for col in COUNTERS:
        if col in df.columns and df[col].dtype.kind == "f":
            x = df[col]
            vals = x[x.notna()]
            if (vals == vals.round()).all():
                df[col] = x.astype("Int64")
    return df


def rows_table(rows) -> pa.Table:
    """Rows (a pyarrow Table, a DataFrame or a list of dicts) as a validated table stamped with the
    rows schema's name and version (kept beside any other metadata, e.g. pandas')."""
    if isinstance(rows, pa.Table):
        table = rows
    elif isinstance(rows, list):
        table = pa.Table.from_pylist(rows)
    else:
        table = pa.Table.from_pandas(_nullable_counters(rows), preserve_index=False)
    validate_rows(table)
    keep = {k: v for k, v in (table.schema.metadata or {}).items() if not k.startswith(b"notebank.")}
    stamped = with_meta(pa.schema([]), ROWS_NAME, ROWS_VERSION).metadata
    return table.replace_schema_metadata({**keep, **stamped})


def read_rows(url: str) -> pa.Table:
    """results.parquet at `url` (local path or fsspec URL), validated. SchemaError names the file."""
    return validate_rows(read_parquet_url(url), url)


# ---------------------------------------------------------------------------------------------
# Summary entries and results.json
# ---------------------------------------------------------------------------------------------
_HASH = re.compile(r"^[0-9a-f]{16}$")


def config_hash(config: dict) -> str:
    """16 hex digits naming a configuration (SHA-256 of its canonical JSON, sorted keys)."""
    data = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(data.encode("utf-8")).hexdigest()[:16]


@dataclass
class SummaryEntry:
    """One summary number: the mean of `metric` over `n` examples with its bootstrap interval."""

    metric: str            # e.g. "six-task mean score (0-100)"
    value: float           # the mean
    stderr: float          # standard deviation of the bootstrap replicates
    n: int                 # examples (over all tasks) the mean rests on
    ci: tuple[float, float]
    model: str             # the backbone the rows report
    config_hash: str
    n_tasks: int = 1
    ci_level: float = 0.95

    def validate(self, where: str = "summary entry") -> "SummaryEntry":
        if not isinstance(self.metric, str) or not self.metric:
            raise SchemaError(f"{where}: metric must be a non-empty string")
        if not isinstance(self.model, str) or not self.model:
            raise SchemaError(f"{where}: model must be a non-empty string")
        for k in ("n", "n_tasks"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SchemaError(f"{where}: {k} must be an int >= 1, got {v!r}")
        nums = {"value": self.value, "stderr": self.stderr, "ci_level": self.ci_level}
        if not isinstance(self.ci, (list, tuple)) or len(self.ci) != 2:
            raise SchemaError(f"{where}: ci must be [low, high], got {self.ci!r}")
        nums.update({"ci low": self.ci[0], "ci high": self.ci[1]})
        for k, v in nums.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise SchemaError(f"{where}: {k} must be a finite number, got {v!r}")
        if self.stderr < 0 or not 0 < self.ci_level < 1:
            raise SchemaError(f"{where}: stderr must be >= 0 and ci_level in (0, 1)")
        if self.ci[0] > self.ci[1]:
            raise SchemaError(f"{where}: ci low {self.ci[0]} > high {self.ci[1]}")
        if not _HASH.match(str(self.config_hash)):
            raise SchemaError(f"{where}: config_hash must be 16 hex digits, got {self.config_hash!r}")
        return self

    def to_json(self) -> dict:
        d = asdict(self)
        return {"metric": d["metric"], "value": d["value"], "stderr": d["stderr"], "n-samples": d["n"],
                "n_tasks": d["n_tasks"], "ci": list(d["ci"]), "ci_level": d["ci_level"], "model": d["model"],
                "config_hash": d["config_hash"]}

    @classmethod
    def from_json(cls, d: dict, where: str) -> "SummaryEntry":
        if not isinstance(d, dict):
            raise SchemaError(f"{where}: an entry must be an object")
        d = dict(d)
        if "n-samples" not in d:
            raise SchemaError(f"{where}: missing 'n-samples'")
        d["n"] = d.pop("n-samples")
        names = {f.name for f in fields(cls)}
        unknown, missing = set(d) - names, {"metric", "value", "stderr", "n", "ci", "model", "config_hash"} - set(d)
        if unknown or missing:
            raise SchemaError(f"{where}: unknown fields {sorted(unknown)}, missing {sorted(missing)}")
        if isinstance(d["ci"], list):
            d["ci"] = tuple(d["ci"])
        return cls(**d).validate(where)


def results_document(entries: dict[str, SummaryEntry], configs: dict[str, dict], *, benchmark: str,
                     bootstrap: dict, versions: dict, parts: dict[str, dict] | None = None,
                     provenance: dict | None = None) -> dict:
    """The results.json object (validated): entries keyed like summary.json, configs and their shared
    parts by hash; `provenance` (schemas/provenance.py: git commit, versions, date, the job's model
    and config) is kept beside them, outside every config hash."""
    parts = parts or {}
    doc = {"schema": SUMMARY_NAME, "schema_version": SUMMARY_VERSION, "benchmark": benchmark,
           "results": {k: e.to_json() for k, e in sorted(entries.items())},
           "configs": {h: configs[h] for h in sorted(configs)},
           "config_parts": {h: parts[h] for h in sorted(parts)}, "bootstrap": dict(bootstrap),
           "versions": {SUMMARY_NAME: SUMMARY_VERSION, **versions}}
    if provenance is not None:
        doc["provenance"] = provenance
    validate_results(doc)
    return doc


def validate_results(doc: dict, where: str = "results.json") -> dict[str, SummaryEntry]:
    """Check a results.json object. -> {key: SummaryEntry}."""
    if not isinstance(doc, dict) or doc.get("schema") != SUMMARY_NAME:
        raise SchemaError(f"{where}: not a '{SUMMARY_NAME}' document")
    if doc.get("schema_version") != SUMMARY_VERSION:
        raise SchemaError(f"{where}: '{SUMMARY_NAME}' schema version {doc.get('schema_version')!r} is not the "
                          f"supported version {SUMMARY_VERSION}")
    need = {"benchmark", "results", "configs", "config_parts", "bootstrap", "versions"}
    if need - set(doc):
        raise SchemaError(f"{where}: missing {sorted(need - set(doc))}")
    configs, parts = doc["configs"], doc["config_parts"]
    out = {}
    for key, d in doc["results"].items():
        if len(key.split("/")) != 3:
            raise SchemaError(f"{where}: key {key!r} is not <backbone>/<method>/<group>")
        e = SummaryEntry.from_json(d, f"{where}: {key}")
        if e.config_hash not in configs:
            raise SchemaError(f"{where}: {key}: config {e.config_hash} is not in 'configs'")
        out[key] = e
    for kind, table in (("config", configs), ("config part", parts)):
        for h, cfg in table.items():
            if not isinstance(cfg, dict) or config_hash(cfg) != h:
                raise SchemaError(f"{where}: {kind} {h} does not hash to its key (edited by hand?)")
    for h, cfg in configs.items():
        missing = [p for p in cfg.get("parts", []) if p not in parts]
        if missing:
            raise SchemaError(f"{where}: config {h} names parts {missing} that are not in 'config_parts'")
    return out


def results_bytes(doc: dict) -> bytes:
    validate_results(doc)
    return dumps_json(doc)


def write_results(path: str, doc: dict) -> None:
    """results.json (validated; canonical JSON: sorted keys, no timestamps)."""
    data = results_bytes(doc)
    with open(path, "wb") as f:
        f.write(data)


def read_results(path: str) -> tuple[dict, dict[str, SummaryEntry]]:
    """-> (the document, {key: SummaryEntry}); SchemaError names the file when it is not valid."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SchemaError(f"{path}: not valid JSON (truncated?): {e}") from e
    return doc, validate_results(doc, path)


def flat_summary(entries: dict[str, SummaryEntry], ndigits: int = 2) -> dict[str, float]:
    """summary.json: {"<key>": mean rounded to `ndigits`}, the map older readers know."""
    return {k: round(float(e.value), ndigits) for k, e in sorted(entries.items())}
