"""The archive folder: per-document files committed atomically, manifest as per-document records.

Layout (see schemas/manifest.py):
    <root>/manifest/_run.json           run fingerprint; a rerun with another model/config is refused
    <root>/manifest/docs/<key>.json     DocRecord: the commit marker of the document
    <root>/manifest/rejected/<h>.json   rows without a usable key (missing/unsafe/duplicate doc_id)
    <root>/notes/<key>.parquet
    <root>/state/<key>.safetensors

Commit protocol (single writer: the driver): each file is written under a temporary name
(`<name>.tmp-<token>`) and renamed into place; the manifest record is written last. A document is
committed iff its record exists with status "ok"; data files without a record are orphans of a crash
and are simply rewritten (deterministically, so with the same bytes) by the rerun. On object stores
where rename is copy+delete the record is still written in one PUT, so readers never see a
half-committed document.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import posixpath
import urllib.parse
import uuid

import fsspec

from notebank.schemas.manifest import DocRecord, FileRef, fingerprint_diff, parse_run_record, run_record

TMP_MARK = ".tmp-"
_SAFE = "-_.=+@,"


from notebank.pipeline.archive import ArchiveError, FingerprintMismatch  # noqa: E402,F401 (one class each, shared)


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def doc_key(doc_id: str) -> tuple[str | None, str | None]:
    """File-name key of a document -> (key, error). Keys never contain a path separator."""
    if not isinstance(doc_id, str) or doc_id == "":
        return None, "empty doc_id"
    if "/" in doc_id or "\\" in doc_id or "\x00" in doc_id:
        return None, f"doc_id {doc_id!r} contains a path separator and would escape the output folder"
    if doc_id.startswith("."):
        return None, f"doc_id {doc_id!r} starts with '.' (reserved: '.', '..' and hidden names)"
    if any(ord(c) < 32 for c in doc_id):
        return None, f"doc_id {doc_id!r} contains control characters"
    key = urllib.parse.quote(doc_id, safe=_SAFE)
    if len(key.encode()) > 200:
        return None, f"doc_id is too long for a file name ({len(key.encode())} bytes when quoted, max 200)"
    return key, None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ArchiveStore:
    def __init__(self, root_url: str):
        self.url = root_url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.root = self.root.rstrip("/")

    # ---- paths -------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url_of(self, rel: str) -> str:
        return self.fs.unstrip_protocol(self.path(rel))

    @staticmethod
    def rel_notes(key): return f"notes/{key}.parquet"

    @staticmethod
    def rel_state(key): return f"state/{key}.safetensors"

    @staticmethod
    def rel_record(key): return f"manifest/docs/{key}.json"

    REL_RUN = "manifest/_run.json"

    # ---- low-level atomic write -----------------------------------------------------------------
    def _atomic_write(self, rel: str, data: bytes) -> FileRef:
        final = self.path(rel)
        parent = posixpath.dirname(final)
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{final}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, final)
        return FileRef(path=rel, size=len(data), sha256=sha256(data))

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self.fs.cat_file(self.path(rel))
        except FileNotFoundError as e:
            raise ArchiveError(f"{self.url_of(rel)}: file not found") from e

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def clean_tmp(self) -> int:
        """Remove temporary files left by a killed writer. Returns how many."""
        n = 0
        if not self.fs.exists(self.root):
            return 0
        for p in self.fs.find(self.root):
            if TMP_MARK in posixpath.basename(p):
                self.fs.rm_file(p)
                n += 1
        return n

    # ---- run fingerprint ------------------------------------------------------------------------
    def read_run(self) -> dict | None:
        if not self.exists(self.REL_RUN):
            return None
        return parse_run_record(self.read_bytes(self.REL_RUN), self.url_of(self.REL_RUN))

    def check_or_write_run(self, fingerprint: dict) -> None:
        run = self.read_run()
        if run is None:
            self._atomic_write(self.REL_RUN, run_record(fingerprint, utc_now()))
            return
        diff = fingerprint_diff(run["fingerprint"], fingerprint)
        if diff:
            raise FingerprintMismatch(
                f"refusing to write into {self.url}: it holds archives made with a different model or "
                f"NoteBank config ({self.url_of(self.REL_RUN)}). Differences: " + "; ".join(diff)
                + ". Use a new output folder, or the original model/config.")

    # ---- records --------------------------------------------------------------------------------
    def load_records(self, record_cls=DocRecord) -> dict[str, DocRecord]:
        d = self.path("manifest/docs")
        if not self.fs.exists(d):
            return {}
        out = {}
        for p in self.fs.ls(d, detail=False):
            name = posixpath.basename(p)
            if not name.endswith(".json") or TMP_MARK in name:
                continue
            rec = record_cls.from_bytes(self.fs.cat_file(p), self.fs.unstrip_protocol(p))
            out[name[: -len(".json")]] = rec
        return out

    def load_record(self, key: str, record_cls=DocRecord) -> DocRecord | None:
        rel = self.rel_record(key)
        if not self.exists(rel):
            return None
        return record_cls.from_bytes(self.read_bytes(rel), self.url_of(rel))

    def count_rejected(self) -> int:
        d = self.path("manifest/rejected")
        return len(self.fs.ls(d, detail=False)) if self.fs.exists(d) else 0

    def commit(self, key: str, notes: bytes, state: bytes, record: DocRecord) -> DocRecord:
        """Write a document's files, then its record (the commit)."""
        record.notes = self._atomic_write(self.rel_notes(key), notes)
        record.state = self._atomic_write(self.rel_state(key), state)
        record.bytes = record.notes.size + record.state.size
        record.key, record.status, record.committed_at = key, "ok", utc_now()
        self._atomic_write(self.rel_record(key), record.to_bytes())
        return record

    def record_failure(self, record: DocRecord) -> DocRecord:
        record.status = "failed"
        record.committed_at = utc_now()
        if record.key:
            self._atomic_write(self.rel_record(record.key), record.to_bytes())
        else:
            h = hashlib.sha1(repr(sorted((record.source or {}).items())).encode()).hexdigest()[:20]
            self._atomic_write(f"manifest/rejected/{h}.json", record.to_bytes())
        return record

    # ---- reading a committed document -------------------------------------------------------------
    def read_verified(self, ref: FileRef) -> bytes:
        data = self.read_bytes(ref.path)
        if len(data) != ref.size or sha256(data) != ref.sha256:
            raise ArchiveError(
                f"{self.url_of(ref.path)}: contents do not match the manifest (size {len(data)} vs recorded "
                f"{ref.size}; truncated, corrupted or overwritten)")
        return data

    def document_payload(self, key: str, verify: bool = True) -> dict:
        """Notes + state bytes of a committed document, checked against its record."""
        rec = self.load_record(key)
        if rec is None:
            raise ArchiveError(f"{self.url_of(self.rel_record(key))}: document not archived (no manifest record)")
        if rec.status != "ok":
            raise ArchiveError(f"{self.url_of(self.rel_record(key))}: document failed at ingest: {rec.error}")
        get = self.read_verified if verify else (lambda ref: self.read_bytes(ref.path))
        return {"doc_id": rec.doc_id, "key": key, "notes": get(rec.notes), "state": get(rec.state),
                "notes_url": self.url_of(rec.notes.path), "state_url": self.url_of(rec.state.path),
                "fingerprint": rec.fingerprint}


def is_process_local(url: str) -> bool:
    """memory:// lives in one process: workers cannot see it, so the driver does the I/O."""
    fs, _ = fsspec.core.url_to_fs(url)
    protos = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "memory" in protos
