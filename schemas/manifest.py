"""Manifest formats (JSON) shared by the archive layout (schemas/archive.py): the run record of an
output folder and the file references its commit records hold.

    manifest/_run.json   run fingerprint (model, NoteBank config, projection seed, schema versions)
Timestamps live only here and in commit records, never in the data files.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from notebank.schemas._base import SchemaError, dumps_json

RUN_NAME = "manifest.run"
VERSION = 1


@dataclass
class FileRef:
    path: str          # relative to the output root
    size: int
    sha256: str


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
