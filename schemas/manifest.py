"""Manifest formats (JSON): one record per document, plus one run record per output folder.

Layout under an ingest output URL (see pipeline/store.py):
    manifest/_run.json          run fingerprint (model, NoteBank config, projection seed, schema versions)
    manifest/docs/<key>.json    one DocRecord per document: the commit marker of that document
    manifest/rejected/<h>.json  DocRecords for input rows that have no usable key (missing/unsafe/duplicate id)
    notes/<key>.parquet         schemas.notes
    state/<key>.safetensors     the retained inference state
A document counts as archived iff its DocRecord exists with status "ok" and the files it names match
their recorded size and sha256. Timestamps live only here, never in the data files.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from notebank.schemas._base import SchemaError, dumps_json

DOC_NAME, RUN_NAME = "manifest.doc", "manifest.run"
VERSION = 1
STATUSES = ("ok", "failed")


@dataclass
class FileRef:
    path: str          # relative to the output root
    size: int
    sha256: str


@dataclass
class DocRecord:
    doc_id: str | None
    key: str | None
    status: str
    error: str | None = None
    n_tokens: int = 0
    n_notes: int = 0
    n_archived_tokens: int = 0          # U (paper Eq. 18)
    bytes: int = 0                      # notes + state file bytes
    notes: FileRef | None = None
    state: FileRef | None = None
    fingerprint: dict | None = None     # run fingerprint digest + parts (see run_fingerprint)
    text_sha256: str | None = None
    source: dict | None = None          # {"shard": ..., "row": ...}
    metadata: dict = field(default_factory=dict)   # extra corpus fields
    timings: dict = field(default_factory=dict)
    committed_at: str | None = None     # UTC ISO time

    def validate(self, where: str = "manifest record") -> "DocRecord":
        if self.status not in STATUSES:
            raise SchemaError(f"{where}: status {self.status!r} not in {STATUSES}")
        if self.status == "ok":
            if not self.key or self.notes is None or self.state is None:
                raise SchemaError(f"{where}: an ok record needs key, notes and state")
        elif not self.error:
            raise SchemaError(f"{where}: a failed record needs an error")
        for name in ("n_tokens", "n_notes", "n_archived_tokens", "bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise SchemaError(f"{where}: {name} must be a non-negative int, got {v!r}")
        return self

    def to_bytes(self) -> bytes:
        self.validate()
        d = asdict(self)
        d = {"schema": DOC_NAME, "schema_version": VERSION, **d}
        return dumps_json(d)

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "DocRecord":
        try:
            d = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SchemaError(f"{where}: manifest record is not valid JSON (truncated?): {e}") from e
        if d.pop("schema", None) != DOC_NAME or d.pop("schema_version", None) != VERSION:
            raise SchemaError(f"{where}: not a {DOC_NAME} v{VERSION} record")
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise SchemaError(f"{where}: unknown manifest fields {sorted(unknown)}")
        for k in ("notes", "state"):
            if d.get(k) is not None:
                d[k] = FileRef(**d[k])
        return cls(**d).validate(where)


def run_record(fingerprint: dict, created_at: str, provenance: dict | None = None) -> bytes:
    """The archive's run record. `provenance` (schemas/provenance.py: git commit, versions, date, the
    job's model and config; default: this process's) sits beside the fingerprint, never in it:
    archives are checked by the fingerprint alone."""
    if provenance is None:
        from notebank.schemas.provenance import provenance as current
        provenance = current()
    return dumps_json({"schema": RUN_NAME, "schema_version": VERSION, "fingerprint": fingerprint,
                       "created_at": created_at, "provenance": provenance})


def parse_run_record(data: bytes, where: str) -> dict:
    try:
        d = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SchemaError(f"{where}: run record is not valid JSON: {e}") from e
    if d.get("schema") != RUN_NAME or d.get("schema_version") != VERSION or "fingerprint" not in d:
        raise SchemaError(f"{where}: not a {RUN_NAME} v{VERSION} record")
    return d


def fingerprint_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Human-readable differences between two (nested) fingerprints."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += fingerprint_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out
