"""MoNe memory in an ingest output folder (`memory: mone`): the per-document manifest record.

Layout under the output URL (pipeline/store.py; same commit protocol as the NoteBank archives):
    manifest/_run.json                  run record (schemas.manifest), fingerprint has "memory": "mone"
    manifest/docs/<key>.json            MoneDocRecord: the commit marker of the document
    manifest/rejected/<h>.json          rows without a usable key
    state/<key>.p<part>.safetensors     the document's fast-weight state after part <part> (1-based)

The state file is ``nbcore.mone.state.MoNeState.to_bytes()`` (format ``mone-state/1``): per decoder
layer W_in / W_gate / W_out and their momenta, the token ids of the incomplete last segment and the
counters, in one deterministic safetensors file whose size does not depend on the document length.
An incremental ingest (``append: true``) writes part p+1 under a new name and then the record, so a
crash never leaves a record pointing at a half-updated state; the superseded part file is removed
after the commit.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from schemas._base import SchemaError, dumps_json
from schemas.manifest import FileRef

DOC_NAME = "manifest.mone_doc"
VERSION = 1
STATE_FORMAT = "mone-state/1"
STATUSES = ("ok", "failed")


@dataclass
class MonePart:
    text_sha256: str     # sha256 of the part's UTF-8 text
    n_tokens: int        # tokens of this part


@dataclass
class MoneDocRecord:
    doc_id: str | None
    key: str | None
    status: str
    error: str | None = None
    n_tokens: int = 0                   # tokens written so far (all parts)
    n_segments: int = 0                 # complete segments written into the fast weights
    n_pending: int = 0                  # tokens of the incomplete last segment (kept as ids in the state)
    parts: list[MonePart] = field(default_factory=list)   # appended texts, in order
    bytes: int = 0                      # state file bytes
    state: FileRef | None = None
    fingerprint: dict | None = None     # run fingerprint (pipeline.mone_pipeline.run_fingerprint)
    source: dict | None = None          # {"shard": ..., "row": ...} of the last part
    metadata: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    committed_at: str | None = None

    def validate(self, where: str = "MoNe manifest record") -> "MoneDocRecord":
        if self.status not in STATUSES:
            raise SchemaError(f"{where}: status {self.status!r} not in {STATUSES}")
        if self.status == "ok":
            if not self.key or self.state is None or not self.parts:
                raise SchemaError(f"{where}: an ok record needs key, state and at least one part")
        elif not self.error:
            raise SchemaError(f"{where}: a failed record needs an error")
        for name in ("n_tokens", "n_segments", "n_pending", "bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise SchemaError(f"{where}: {name} must be a non-negative int, got {v!r}")
        return self

    @property
    def text_shas(self) -> set[str]:
        return {p.text_sha256 for p in self.parts}

    def to_bytes(self) -> bytes:
        self.validate()
        return dumps_json({"schema": DOC_NAME, "schema_version": VERSION, **asdict(self)})

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "MoneDocRecord":
        try:
            d = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SchemaError(f"{where}: manifest record is not valid JSON (truncated?): {e}") from e
        name, version = d.pop("schema", None), d.pop("schema_version", None)
        if name != DOC_NAME or version != VERSION:
            raise SchemaError(f"{where}: not a {DOC_NAME} v{VERSION} record (found {name!r} v{version!r}; "
                              f"a NoteBank archive? set memory: notebank)")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise SchemaError(f"{where}: unknown manifest fields {sorted(unknown)}")
        if d.get("state") is not None:
            d["state"] = FileRef(**d["state"])
        d["parts"] = [MonePart(**p) for p in d.get("parts") or []]
        return cls(**d).validate(where)
