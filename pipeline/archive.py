"""The archive folder (layout v2, schemas/archive.py): written by many actors at once, read as datasets.

Who writes what: each ingest actor writes its group's files straight to the store -- the state of
every document, one notes part, one documents part -- and then the group's commit record, last.
Only a small record per document travels back to the driver. A group is committed iff its record
exists and names files of the recorded sizes; files without a record are orphans of a crash and
are rewritten (with the same bytes) by the rerun, or deleted by `clean_unreferenced`.

How a file is written depends on the filesystem:
  - a local folder: under a temporary name, then renamed into place (a rename is atomic there);
    the commit record is hard-linked into place, which fails if a record is there already.
  - an object store (any other fsspec filesystem): data files are written once, under their final
    names, which are specific to the group and generation (a PUT is atomic: readers see the whole
    object or none; a temporary name + `mv` would be a server-side copy + delete, every byte written
    twice). The commit record is a create-only PUT (`mode="create"`, If-None-Match on S3): the single
    atomic step that makes the group visible.
Either way a record already there with the same content (a batch retried after its actor died
between commit and reply) counts as the commit; a different one is refused as a second writer.

Reading checks what the commit records say: the sizes of every file (`file_problems`) and the
sha256 of every state file and notes part before its bytes are used (`read_verified`; a notes
part's success is remembered per Archive object, so a part shared by many documents is hashed once).

States are safetensors. A state above `piece_bytes` is written in pieces (each a complete
safetensors file holding whole tensors, or slices of one tensor along dim 0), streamed from the
tensors' own memory, so no process ever holds a second copy of a large KV cache.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import posixpath
import struct
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from notebank.schemas import archive as S
from notebank.schemas._base import SchemaError, read_parquet_bytes, read_parquet_file
from notebank.schemas.manifest import fingerprint_diff, parse_run_record, run_record

TMP_MARK = ".tmp-"
REL_RUN = "manifest/_run.json"
STATE_FORMAT, STATE_VERSION = "notebank.state", 2
DEFAULT_PIECE_BYTES = 1 << 30          # 1 GiB per state piece
NOTES_PARQUET = dict(compression="zstd", compression_level=3, use_dictionary=["doc_id"], write_statistics=True,
                     data_page_version="2.0", version="2.6", row_group_size=S.NOTES_ROW_GROUP, store_schema=True)
DOCS_PARQUET = dict(compression="zstd", compression_level=3, use_dictionary=False, write_statistics=True,
                    data_page_version="2.0", version="2.6", store_schema=True)


class ArchiveError(RuntimeError):
    """An archive file is missing, truncated, corrupted or inconsistent (the message names the file)."""


class FingerprintMismatch(RuntimeError):
    """The output folder (or an archive file) was written by another model/config."""


class LayoutError(RuntimeError):
    """The folder holds an archive in a layout this version does not read."""


class IntegrityError(ArchiveError):
    """A file's bytes are not the ones its commit record names (flipped, truncated or overwritten)."""


class CommitConflict(ArchiveError):
    """A group's commit record is already there with other content: a second writer wrote the group."""


# filesystems whose listings other processes change under us: no listing cache (a stale `ls` would
# hide the commits of the actors, which are other processes)
_CACHED_LISTING_OK = ("file", "local", "memory")


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint_digest(fp: dict) -> str:
    return sha256(json.dumps(fp, sort_keys=True, default=str).encode())[:20]


class Archive:
    def __init__(self, url: str):
        from fsspec.implementations.local import LocalFileSystem
        self.url = url.rstrip("/")
        proto = fsspec.utils.get_protocol(self.url)
        opts = {} if proto in _CACHED_LISTING_OK else {"use_listings_cache": False}
        self.fs, root = fsspec.core.url_to_fs(self.url, **opts)
        self.root = root.rstrip("/")
        # local: temporary name + rename; elsewhere: write once under the final name (module docstring)
        self.local = isinstance(self.fs, LocalFileSystem)
        self._verified: set[tuple[str, int, str]] = set()      # (path, size, sha256) checked in this process

    # ---- paths ---------------------------------------------------------------------------------
    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel)

    def url_of(self, rel: str) -> str:
        return self.fs.unstrip_protocol(self.path(rel))

    @staticmethod
    def rel_notes(group: str) -> str:
        return f"notes/{group}.parquet"

    @staticmethod
    def rel_documents(group: str) -> str:
        return f"documents/{group}.parquet"

    @staticmethod
    def rel_commit(group: str) -> str:
        return f"manifest/commits/{group}.json"

    @staticmethod
    def rel_state(key: str, gen: int, piece: int = 0, n_pieces: int = 1) -> str:
        if n_pieces == 1:
            return f"state/{key}.g{gen}.safetensors"
        return f"state/{key}.g{gen}/part-{piece:05d}-of-{n_pieces:05d}.safetensors"

    # ---- layout ----------------------------------------------------------------------------------
    def check_layout(self) -> None:
        """Refuse a folder written in layout 1 (one notes file and one manifest record per document)."""
        if self.fs.exists(self.path("manifest/docs")):
            raise LayoutError(
                f"{self.url} is an archive in layout 1 (notes/<doc>.parquet + manifest/docs/<doc>.json, notes "
                f"schema v1), which this version does not read: it writes and reads layout {S.LAYOUT_VERSION} "
                f"(notes dataset + documents table). Re-ingest the corpus into a new output folder.")

    # ---- writing -----------------------------------------------------------------------------------
    def atomic_write(self, rel: str, data: bytes) -> S.FileRef:
        """Write `rel` whole: readers see the old file (or none) or the new one, never a part."""
        final = self.path(rel)
        if not self.local:
            self.fs.pipe_file(final, data)         # one PUT, under the final name
            return S.FileRef(path=rel, size=len(data), sha256=sha256(data))
        self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
        tmp = f"{final}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, final)
        return S.FileRef(path=rel, size=len(data), sha256=sha256(data))

    def _atomic_stream(self, rel: str, chunks) -> S.FileRef:
        """Write an iterable of buffers to `rel`, hashing as it goes (local: temporary name + rename;
        object store: one upload under the final name, visible only once complete)."""
        final = self.path(rel)
        if self.local:
            self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
            target = f"{final}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        else:
            target = final
        h, n = hashlib.sha256(), 0
        with self.fs.open(target, "wb") as f:
            for buf in chunks:
                f.write(buf)
                h.update(buf)
                n += len(buf)
        if target != final:
            self.fs.mv(target, final)
        return S.FileRef(path=rel, size=n, sha256=h.hexdigest())

    def write_commit(self, rec: S.CommitRecord) -> S.CommitRecord:
        """Create the group's commit record, the one atomic step of a group's write. A record already
        there with the same content (but for its time stamps) is this commit, written by an earlier try
        of the same batch: it is kept and returned. A different one raises CommitConflict."""
        rel = self.rel_commit(rec.group)
        final = self.path(rel)
        data = rec.to_bytes()
        try:
            if self.local:
                self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
                tmp = f"{final}{TMP_MARK}{uuid.uuid4().hex[:12]}"
                self.fs.pipe_file(tmp, data)
                try:
                    os.link(tmp, final)              # fails if the record exists: create-only, atomic
                finally:
                    self.fs.rm_file(tmp)
            else:
                self._create_only(final, data)
            return rec
        except FileExistsError:
            pass
        try:
            there = S.CommitRecord.from_bytes(self.fs.cat_file(final), self.url_of(rel))
        except (SchemaError, FileNotFoundError) as e:
            raise CommitConflict(f"{self.url_of(rel)}: cannot commit group {rec.group}: a record is there "
                                 f"already and cannot be read ({e}); is another run writing here?") from e
        if _commit_substance(there) != _commit_substance(rec):
            raise CommitConflict(
                f"{self.url_of(rel)}: group {rec.group} is already committed with other files (committed at "
                f"{there.committed_at}): another writer wrote this group. Only one run may write an output "
                f"folder at a time.")
        return there

    def _create_only(self, path: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(path, data, mode="create")      # S3: PUT with If-None-Match: *
        except (NotImplementedError, TypeError):
            # a store without conditional writes: check, then write (the writer lease keeps others out)
            if self.fs.exists(path):
                raise FileExistsError(path) from None
            self.fs.pipe_file(path, data)

    def clean_tmp(self) -> int:
        """Delete temporaries of writes that were killed (local folders only: on an object store nothing
        is written under a temporary name, and readers skip any that an older version left)."""
        n = 0
        if not self.local or not self.fs.exists(self.root):
            return 0
        for p in self.fs.find(self.root):
            if TMP_MARK in posixpath.basename(p):
                self.fs.rm_file(p)
                n += 1
        return n

    def write_state(self, key: str, gen: int, tensors: dict[str, torch.Tensor], *, doc_id: str,
                    model_fingerprint: str, piece_bytes: int = DEFAULT_PIECE_BYTES) -> list[S.FileRef]:
        """One document's state as one safetensors file, or pieces of at most ~piece_bytes each."""
        pieces = plan_pieces(tensors, piece_bytes)
        meta = {"format": STATE_FORMAT, "version": STATE_VERSION, "doc_id": doc_id, "model": model_fingerprint,
                "n_pieces": len(pieces)}
        refs = []
        for i, piece in enumerate(pieces):
            refs.append(self._atomic_stream(self.rel_state(key, gen, i, len(pieces)),
                                            safetensors_chunks(piece, {**meta, "piece": i})))
        return refs

    def write_group(self, group: str, entries: list[S.DocEntry], note_rows: list[dict], doc_rows: list[dict],
                    *, n_slots: int, addr_dim: int, fp_digest: str, timings: dict | None = None) -> S.CommitRecord:
        """Write a group's notes part and documents part, then its commit record (the commit)."""
        rec = S.CommitRecord(group=group, fingerprint_digest=fp_digest, documents=entries, timings=timings or {})
        if note_rows:
            rec.notes = self.atomic_write(self.rel_notes(group),
                                          _parquet_bytes(S.notes_table(note_rows, n_slots, addr_dim), NOTES_PARQUET))
        rec.documents_file = self.atomic_write(self.rel_documents(group),
                                               _parquet_bytes(S.documents_table(doc_rows), DOCS_PARQUET))
        rec.committed_at = utc_now()
        return self.write_commit(rec)

    # ---- run fingerprint ----------------------------------------------------------------------------
    def read_run(self) -> dict | None:
        if not self.fs.exists(self.path(REL_RUN)):
            return None
        return parse_run_record(self.fs.cat_file(self.path(REL_RUN)), self.url_of(REL_RUN))

    def check_or_write_run(self, fingerprint: dict, defaults: dict | None = None) -> None:
        """Write the run fingerprint, or check it against the one there. `defaults`: values of keys
        that fingerprints written by earlier versions lack (e.g. ``memory: notebank``)."""
        run = self.read_run()
        if run is None:
            self.atomic_write(REL_RUN, run_record(fingerprint, utc_now()))
            return
        diff = fingerprint_diff({**(defaults or {}), **run["fingerprint"]}, fingerprint)
        if diff:
            raise FingerprintMismatch(
                f"refusing to write into {self.url}: it holds archives made with a different model or "
                f"memory config ({self.url_of(REL_RUN)}). Differences: " + "; ".join(diff[:8])
                + ". Use a new output folder, or the original model/config.")

    # ---- reading commits ----------------------------------------------------------------------------
    def load_commits(self) -> tuple[dict[str, S.CommitRecord], list[str]]:
        """-> ({group: record}, problems). An unreadable record counts as not committed."""
        d = self.path("manifest/commits")
        out, problems = {}, []
        if not self.fs.exists(d):
            return out, problems
        for p in sorted(self.fs.ls(d, detail=False)):
            name = posixpath.basename(p)
            if not name.endswith(".json") or TMP_MARK in name:
                continue
            try:
                rec = S.CommitRecord.from_bytes(self.fs.cat_file(p), self.fs.unstrip_protocol(p))
            except SchemaError as e:
                problems.append(str(e))
                continue
            out[name[:-len(".json")]] = rec
        return out, problems

    def file_sizes(self) -> dict[str, int]:
        """{relative path: size} of every data file (one listing per folder: cheap at scale)."""
        out = {}
        for sub in ("notes", "documents", "state"):
            base = self.path(sub)
            if not self.fs.exists(base):
                continue
            for p, info in self.fs.find(base, detail=True).items():
                if TMP_MARK not in p and info.get("type", "file") == "file":
                    out[posixpath.relpath(p, self.root)] = int(info["size"])
        return out

    def group_problems(self, rec: S.CommitRecord, sizes: dict[str, int], verify: bool = False) -> list[str]:
        """Why a committed group's files do not match its record ([] when they do)."""
        return list(self.file_problems(rec.files(), sizes, verify).values())

    def file_problems(self, refs, sizes: dict[str, int], verify: bool = False) -> dict[str, str]:
        """{path: why} for the refs whose files do not match their recorded size (and sha256)."""
        out = {}
        for ref in refs:
            got = sizes.get(ref.path)
            if got is None:
                out[ref.path] = f"{self.url_of(ref.path)}: missing"
            elif got != ref.size:
                out[ref.path] = f"{self.url_of(ref.path)}: {got} bytes, recorded {ref.size} (truncated or overwritten)"
            elif verify and self._sha256_file(ref.path) != ref.sha256:
                out[ref.path] = f"{self.url_of(ref.path)}: sha256 does not match the commit record"
        return out

    def _sha256_file(self, rel: str) -> str:
        h = hashlib.sha256()
        with self.fs.open(self.path(rel), "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        return h.hexdigest()

    def invalidate(self, group: str) -> None:
        """Take a damaged group out of the committed set (its record is kept aside, for the curious)."""
        src = self.path(self.rel_commit(group))
        if self.fs.exists(src):
            self.fs.makedirs(self.path("manifest/invalid"), exist_ok=True)
            self.fs.mv(src, self.path(f"manifest/invalid/{group}.{uuid.uuid4().hex[:8]}.json"))

    def clean_unreferenced(self, commits: dict[str, S.CommitRecord], sizes: dict[str, int], lease) -> list[str]:
        """Delete the data files (notes, documents, state) that no commit record in `commits` names:
        orphans of a write that never committed, or of a group taken out by `invalidate`. `sizes` is
        `file_sizes()` taken after `commits` were loaded. Only the lease holder may delete: the lease is
        checked first (OutputBusy if it is not ours), since another writer's uncommitted files look
        the same. -> the relative paths deleted."""
        lease.check()
        named = {r.path for rec in commits.values() for r in rec.files()}
        gone = sorted(p for p in sizes if p not in named)
        if gone:
            self.fs.rm([self.path(p) for p in gone])
        return gone

    # ---- reading one document ------------------------------------------------------------------------
    def read_verified(self, ref: S.FileRef, verify: bool = True) -> bytes:
        """The file's bytes, checked against its commit record: size always, sha256 when `verify`."""
        try:
            data = self.fs.cat_file(self.path(ref.path))
        except FileNotFoundError as e:
            raise ArchiveError(f"{self.url_of(ref.path)}: file not found") from e
        if len(data) != ref.size:
            raise ArchiveError(f"{self.url_of(ref.path)}: contents do not match the commit record (size "
                               f"{len(data)} vs recorded {ref.size}; truncated, corrupted or overwritten)")
        if verify:
            got = sha256(data)
            if got != ref.sha256:
                raise IntegrityError(f"integrity check failed: {self.url_of(ref.path)} has sha256 {got}, its "
                                     f"commit record says {ref.sha256} (corrupted or overwritten)")
            self._verified.add((ref.path, ref.size, ref.sha256))
        return data

    def read_state(self, refs: list[S.FileRef], expect_model: str | None = None, verify: bool = True) -> dict:
        """The tensors of a state written by write_state (pieces merged)."""
        from safetensors.torch import load
        parts: dict[str, list] = {}
        for ref in refs:
            data = self.read_verified(ref, verify)
            where = self.url_of(ref.path)
            try:
                meta = json.loads(safetensors_metadata(data).get("notebank", "{}"))
                tensors = load(data)
            except Exception as e:
                raise ArchiveError(f"{where}: not a readable safetensors state: {type(e).__name__}: {e}") from e
            if meta.get("format") != STATE_FORMAT or meta.get("version") != STATE_VERSION:
                raise ArchiveError(f"{where}: not a {STATE_FORMAT} v{STATE_VERSION} file (metadata {meta})")
            if expect_model is not None and meta.get("model") != expect_model:
                raise FingerprintMismatch(f"{where}: state was written by model {meta.get('model')!r}, but the "
                                          f"loaded model is {expect_model!r}")
            del data
            for name, t in tensors.items():
                base = name.split("@", 1)[0]         # "name@k" = the k-th dim-0 slice of a split tensor
                parts.setdefault(base, []).append((name, t))
        out = {}
        for base, items in parts.items():
            if len(items) == 1 and "@" not in items[0][0]:
                out[base] = items[0][1]
            else:
                items.sort(key=lambda it: int(it[0].split("@", 1)[1]))
                out[base] = torch.cat([t for _, t in items])
        return out

    def read_notes(self, doc_id: str, files: list, generation: int) -> pa.Table:
        """The live note rows of one document (sorted by note_index) from its groups' notes parts.
        `files`: the parts' FileRefs (or their dicts) from the commit records. A part is checked against
        its record's sha256 the first time this Archive object reads it (IntegrityError if it differs);
        later reads of a part already checked go straight to the rows of `doc_id`."""
        import pyarrow.compute as pc
        tables = []
        for ref in files:
            ref = _file_ref(ref)
            where = self.url_of(ref.path)
            try:
                if (ref.path, ref.size, ref.sha256) in self._verified:
                    with self.fs.open(self.path(ref.path), "rb") as f:
                        t = read_parquet_file(f, filters=[("doc_id", "=", doc_id)])
                else:
                    data = self.read_verified(ref)
                    t = read_parquet_bytes(data, filters=[("doc_id", "=", doc_id)])
                    del data
            except FileNotFoundError as e:
                raise ArchiveError(f"{where}: file not found") from e
            except ArchiveError:
                raise
            except Exception as e:
                raise ArchiveError(f"{where}: not a readable Parquet file (truncated or corrupted?): {e}") from e
            S.validate_notes_table(t, where)
            tables.append(t)
        if not tables:
            return None
        t = pa.concat_tables(tables)
        t = t.filter(pc.less_equal(t.column("generation"), generation))
        return t.sort_by("note_index")


def _file_ref(ref) -> S.FileRef:
    if isinstance(ref, S.FileRef):
        return ref
    if isinstance(ref, dict):
        return S.FileRef(**ref)
    raise TypeError(f"expected a FileRef (path, size, sha256) from a commit record, got {ref!r}: a bare path "
                    f"cannot be checked against its record")


def _commit_substance(rec: S.CommitRecord) -> bytes:
    """What a commit says (files, documents, fingerprint), without when it was made or how long it took."""
    import dataclasses
    return S.CommitRecord(**{**{f.name: getattr(rec, f.name) for f in dataclasses.fields(rec)},
                             "committed_at": None, "timings": {}}).to_bytes()


# ------------------------------------------------------------------------------------------------
# streaming safetensors

_DT = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
       torch.bool: "BOOL"}


def plan_pieces(tensors: dict[str, torch.Tensor], piece_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split {name: tensor} into pieces of about piece_bytes (sorted names; a tensor larger than a
    piece is cut along dim 0 into `name@k` slices). Views only: no data is copied."""
    pieces, cur, cur_n = [], {}, 0
    for name in sorted(tensors):
        if "@" in name:
            raise ValueError(f"state tensor name {name!r} may not contain '@'")
        t = tensors[name].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        nb = t.numel() * t.element_size()
        if nb > piece_bytes and t.dim() > 0 and t.shape[0] > 1:
            row = nb // t.shape[0]
            per = max(1, piece_bytes // max(row, 1))
            for k, lo in enumerate(range(0, t.shape[0], per)):
                if cur:
                    pieces.append(cur)
                    cur, cur_n = {}, 0
                pieces.append({f"{name}@{k}": t[lo:lo + per]})
            continue
        if cur and cur_n + nb > piece_bytes:
            pieces.append(cur)
            cur, cur_n = {}, 0
        cur[name] = t
        cur_n += nb
    if cur or not pieces:
        pieces.append(cur)
    return pieces


def safetensors_chunks(tensors: dict[str, torch.Tensor], meta: dict):
    """Yield the bytes of a safetensors file for `tensors` without building it in memory."""
    header, off, order = {}, 0, sorted(tensors)
    for name in order:
        t = tensors[name]
        if t.dtype not in _DT:
            raise ValueError(f"state tensor {name!r}: dtype {t.dtype} not supported")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DT[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"notebank": json.dumps(meta, sort_keys=True)}
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    yield struct.pack("<Q", len(raw)) + raw
    for name in order:
        t = tensors[name].contiguous()
        if t.numel():
            yield memoryview(t.view(torch.uint8).reshape(-1).numpy())   # the tensor's own memory


def safetensors_metadata(data: bytes) -> dict:
    if len(data) < 8:
        raise ValueError("file shorter than the 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise ValueError(f"header length {n} exceeds file size {len(data)}")
    return json.loads(data[8:8 + n]).get("__metadata__", {}) or {}


def _parquet_bytes(table: pa.Table, opts: dict) -> bytes:
    import io
    buf = io.BytesIO()
    pq.write_table(table, buf, **opts)
    return buf.getvalue()
