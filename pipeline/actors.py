"""Callable classes for Ray Data's `map_batches`: one loaded memory backend per actor.

Both actors hold one ``nbcore.memory.MemoryBackend`` (``get_backend(memory, ...)``: NoteBank on the
frozen backbone, or MoNe: the frozen base + its meta-trained parameters) and only call its generic
interface (ingest / append / to_files / from_files / answer / read_fields). What a backend persists
is ``MemoryFiles``: the state tensors (one safetensors state, maybe in pieces) and, for NoteBank,
its notes (MoNe has none: its groups write no notes part).

IngestActor: one batch = one group of corpus rows. For each document it ingests (or appends to) the
memory, writes the state straight to the store, and at the end of the group writes the notes part,
the documents part and the commit record (pipeline/archive.py). It returns one small record per
row: ids, counts, status; never notes or states.

QueryActor: one batch = all questions of one document. It loads the document's memory once from
the store, answers every question with every method still missing, writes the answers part itself
(temporary name + rename) and returns small records.

Both are plain classes: usable and testable without Ray.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import traceback

import numpy as np
import torch

from nbcore.config import NoteBankConfig
from nbcore.memory import MemoryFiles
from notebank.pipeline.archive import Archive, ArchiveError, FingerprintMismatch
from notebank.schemas import archive as S
from notebank.schemas._base import SchemaError

RECORD_COLUMNS = ("doc_id", "group", "status", "error", "n_tokens", "n_notes", "bytes", "source_shard",
                  "source_row", "generation", "pid", "retried")


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def build_memory(model: dict, memory: str = "notebank", nb: dict | None = None, block_size: int = 8192,
                 mone_adapters: str | None = None, torch_threads: int = 1):
    """-> (MemoryBackend, tokenizer fingerprint). NoteBank: the backbone of the ModelSpec dict
    (nbcore.backbones.loading.build_backbone); MoNe: ``MoneBackend.load(model.path, mone_adapters, tokenizer)``
    (the tokenizer of model.tokenizer, else the checkpoint's own)."""
    from nbcore.memory import get_backend
    from nbcore.backbones.loading import build_backbone, build_tokenizer, tokenizer_fingerprint
    from notebank.pipeline.allocator import runs_on_cpu, tune_cpu_malloc
    if torch_threads > 0:
        torch.set_num_threads(torch_threads)
    if runs_on_cpu(model):
        tune_cpu_malloc()              # stable heap reuse for the forward's temporaries (pipeline/allocator.py)
    if memory == "mone":
        tok = build_tokenizer(model["tokenizer"]) if model.get("tokenizer") else None
        backend = get_backend("mone", base_dir=model["path"], adapters=mone_adapters, tokenizer=tok,
                              gguf_file=model.get("gguf_file"), cache_dir=model.get("cache_dir"))
    elif memory == "notebank":
        backend = get_backend("notebank", bb=build_backbone(model), nb_cfg=NoteBankConfig(**(nb or {})),
                              block_size=block_size)
    else:
        raise ValueError(f"unknown memory {memory!r}")
    return backend, tokenizer_fingerprint(backend.tokenizer)


def memory_info(backend, tokenizer_fp) -> dict:
    """What the driver's probe reports: fingerprint, tokenizer hash, memory and the write config."""
    d = backend.describe()
    info = {"pid": os.getpid(), "fingerprint": backend.fingerprint(), "tokenizer": tokenizer_fp,
            "memory": backend.name, "has_tokenizer": backend.tokenizer is not None}
    for k in ("family", "n_channels", "mone", "n_layers"):
        if k in d:
            info[k] = d[k]
    return info


class MemoryLoader:
    """Loads the memory backend once per actor."""

    def __init__(self, model: dict, memory: str, nb: dict | None, block_size: int, mone_adapters: str | None,
                 torch_threads: int):
        self.backend, self.tokenizer_fp = build_memory(model, memory, nb, block_size, mone_adapters, torch_threads)
        self.fp = self.backend.fingerprint()
        d = self.backend.describe()
        # the write config as the documents table records it (NoteBank: its config; MoNe: none)
        self.notebank_json = json.dumps(d["notebank"], sort_keys=True) if d.get("notebank") is not None else None

    def load_files(self, store: Archive, doc_id: str, state: list, notes_files: list[str], generation: int,
                   n_tokens: int) -> MemoryFiles:
        """A committed document's MemoryFiles: its state (pieces merged) and its live notes."""
        tensors = store.read_state([S.FileRef(**r) for r in state], expect_model=self.fp)
        notes = note_dicts(store.read_notes(doc_id, notes_files, generation)) if notes_files else []
        facts = {"backend": self.backend.name, "doc_id": doc_id, "model": self.fp, "n_tokens": int(n_tokens)}
        return MemoryFiles(tensors, notes, facts)

    def load_memory(self, store: Archive, doc_id: str, info: dict):
        files = self.load_files(store, doc_id, info["state"], info["notes_files"], info["generation"],
                                info["n_tokens"])
        try:
            return self.backend.from_files(files)
        except ValueError as e:
            raise ArchiveError(f"{store.url}: memory of {doc_id!r} cannot be loaded: {e}") from e


def note_dicts(t) -> list[dict]:
    """Rows of a notes table as MemoryFiles.notes dicts (addresses: uint16 bits, slot-major)."""
    if t is None or t.num_rows == 0:
        return []
    bits = S.address_bits(t).reshape(t.num_rows, -1)
    toks = S.token_id_lists(t)
    cols = {c: t.column(c).to_pylist() for c in ("note_index", "chunk_index", "start", "end", "text")}
    return [{"note_index": cols["note_index"][i], "chunk_index": cols["chunk_index"][i], "start": cols["start"][i],
             "end": cols["end"][i], "token_ids": toks[i], "text": cols["text"][i], "addresses": bits[i]}
            for i in range(t.num_rows)]


class IngestActor(MemoryLoader):
    def __init__(self, model: dict, nb: dict, block_size: int, output: str, fp_digest: str,
                 tokenizer_name: str | None, torch_threads: int = 1, piece_bytes: int = 1 << 30,
                 expect_fingerprint: str | None = None, memory: str = "notebank", mone_adapters: str | None = None):
        super().__init__(model, memory, nb, block_size, mone_adapters, torch_threads)
        if expect_fingerprint is not None and self.fp != expect_fingerprint:
            raise FingerprintMismatch(f"this actor loaded model {self.fp}, the run expects {expect_fingerprint}: is "
                                      f"the checkpoint identical on every node?")
        self.nb = NoteBankConfig(**(nb or {}))
        self.store = Archive(output)
        self.fp_digest = fp_digest
        self.tokenizer_name = tokenizer_name
        self.piece_bytes = piece_bytes

    def __call__(self, batch: dict) -> dict:
        out = {c: [] for c in RECORD_COLUMNS}
        for group, payload in zip(batch["group"], batch["payload"]):
            for rec in self.ingest_group(str(group), json.loads(payload)):
                for c in RECORD_COLUMNS:
                    out[c].append(rec.get(c))
        return out

    @torch.no_grad()
    def ingest_group(self, group: str, docs: list[dict]) -> list[dict]:
        t0 = time.perf_counter()
        entries, note_rows, doc_rows, records = [], [], [], []
        notes_rel = self.store.rel_notes(group)
        addr_dim = self.nb.addr_dim
        for d in sorted(docs, key=lambda d: d["row"]):
            src = {"shard": d["shard"], "row": d["row"]}
            entry = S.DocEntry(doc_id=d.get("doc_id"), key=d.get("key"), status="failed", source=src,
                               generation=int(d.get("generation", 0)), retried=bool(d.get("retried")))
            rec = {"doc_id": entry.doc_id, "group": group, "status": "failed", "error": None, "n_tokens": 0,
                   "n_notes": 0, "bytes": 0, "source_shard": d["shard"], "source_row": d["row"],
                   "generation": entry.generation, "pid": os.getpid(), "retried": entry.retried}
            if d["action"] in ("ingest", "append"):
                try:
                    n_tok, n_new, n_live, n_arch, refs, dim = self._ingest_one(d, entry, note_rows)
                    addr_dim = dim or addr_dim
                    entry.status, entry.n_tokens, entry.n_notes, entry.state = "ok", n_tok, n_new, refs
                    entry.text_sha256 = sha256_text(d["text"])
                    rec.update(status="ok", n_tokens=n_tok, n_notes=n_new, bytes=sum(r.size for r in refs))
                    doc_rows.append(self._doc_row(d, entry, n_live, n_arch, notes_rel, refs))
                except (ValueError, ArchiveError, FingerprintMismatch, SchemaError) as e:
                    entry.error = _err(e)                     # a property of the input: recorded, not retried
            else:
                entry.error = d.get("reason") or "rejected"
                if d["action"] == "skip":
                    entry.status, entry.error = "skipped", None
            if entry.status == "failed":
                # the failed text's hash: a rerun retries this row only once its text changes
                entry.text_sha256 = d.get("text_sha256") or (sha256_text(d["text"]) if isinstance(d.get("text"), str)
                                                             else None)
            rec.update(status=entry.status, error=entry.error)
            if entry.status == "failed" and d["action"] in ("ingest", "append"):
                doc_rows.append(self._doc_row(d, entry, 0, 0, None, []))
            entries.append(entry)
            records.append(rec)
        # the notes part's shape comes from the notes themselves (slots x addr_dim values per note)
        n_slots = len(note_rows[0]["addresses"]) // addr_dim if note_rows else 0
        commit = self.store.write_group(group, entries, note_rows, doc_rows, n_slots=n_slots, addr_dim=addr_dim,
                                        fp_digest=self.fp_digest, timings={"group_s": time.perf_counter() - t0})
        extra = (commit.notes.size if commit.notes else 0) + commit.documents_file.size
        if records:
            records[0]["bytes"] += extra          # the group's shared files, counted once
        return records

    def _ingest_one(self, d: dict, entry: S.DocEntry, note_rows: list):
        gen = int(d.get("generation", 0))
        if d["action"] == "append":
            prev = d["previous"]   # {"state": [FileRef dicts], "notes_files": [...], "generation": g, "n_tokens"}
            files = self.load_files(self.store, d["doc_id"], prev["state"], prev["notes_files"],
                                    int(prev["generation"]), int(prev["n_tokens"]))
            first_new = len(files.notes or ())
            mem = self.backend.append(self.backend.from_files(files), d["text"])
            del files
        else:
            mem = self.backend.ingest(entry.doc_id, d["text"])
            first_new = 0
        out = self.backend.to_files(mem)
        del mem
        notes = out.notes or []
        for n in notes[first_new:]:
            note_rows.append({"doc_id": entry.doc_id, "generation": gen, **n})
        facts = out.facts
        refs = self.store.write_state(entry.key, gen, out.tensors, doc_id=entry.doc_id, model_fingerprint=self.fp,
                                      piece_bytes=self.piece_bytes)
        dim = (facts.get("notebank") or {}).get("addr_dim") if notes else None
        return (int(facts["n_tokens"]), len(notes) - first_new, len(notes), int(facts.get("n_archived_tokens", 0)),
                refs, dim)

    def _doc_row(self, d, entry: S.DocEntry, n_live: int, n_arch: int, notes_rel, refs) -> dict:
        return {"doc_id": entry.doc_id, "key": entry.key, "generation": entry.generation, "status": entry.status,
                "error": entry.error, "memory": self.backend.name, "n_tokens": entry.n_tokens, "n_notes": n_live,
                "n_archived_tokens": n_arch, "text_sha256": entry.text_sha256, "source_shard": d["shard"],
                "source_row": d["row"], "metadata": json.dumps(d.get("metadata") or {}, sort_keys=True),
                "model_fingerprint": self.fp, "tokenizer": self.tokenizer_name,
                "tokenizer_hash": self.tokenizer_fp, "notebank": self.notebank_json, "group": d.get("group_id"),
                "notes_file": notes_rel if entry.n_notes else None, "state_files": [r.path for r in refs],
                "state_bytes": sum(r.size for r in refs)}


def load_archive(store: Archive, doc_id: str, notes_files: list[str], generation: int, nb: NoteBankConfig,
                 fp: str, n_tokens: int, n_channels: int):
    """nbcore Archive of one document (its live notes) from the notes dataset."""
    from nbcore.notebank.archive import Archive as NoteArchive
    t = store.read_notes(doc_id, notes_files, generation)
    if t is None or t.num_rows == 0:
        return NoteArchive.empty(n_channels, nb, fp, n_tokens)
    idx = t.column("note_index").to_numpy()
    if not np.array_equal(idx, np.arange(len(idx))):
        raise ArchiveError(f"{store.url}: notes of {doc_id!r} are not 0..{len(idx) - 1} (a damaged or partial archive)")
    bits = S.address_bits(t)
    return NoteArchive(token_ids=S.token_id_lists(t), starts=t.column("start").to_numpy().astype(np.int64),
                       ends=t.column("end").to_numpy().astype(np.int64),
                       chunk_index=t.column("chunk_index").to_numpy().astype(np.int64),
                       addresses=torch.from_numpy(bits.copy()).view(torch.bfloat16), config=nb,
                       model_fingerprint=fp, n_tokens=n_tokens)


class QueryActor(MemoryLoader):
    def __init__(self, model: dict, archive: str, output: str, read: dict, nb: dict | None, docs_ref,
                 provenance: dict, torch_threads: int = 1, memory: str = "notebank",
                 mone_adapters: str | None = None, block_size: int = 8192):
        super().__init__(model, memory, nb, block_size, mone_adapters, torch_threads)
        import ray
        self.store = Archive(archive) if archive else None      # None: one-pass mode (read the corpus)
        self.out = Archive(output)
        self.read = read                              # shared read settings; method set per row
        if isinstance(docs_ref, list):              # [ObjectRef]: wrapped so Ray does not resolve it per call
            docs_ref = docs_ref[0]
        self.docs = ray.get(docs_ref) if isinstance(docs_ref, ray.ObjectRef) else docs_ref
        self.provenance = provenance

    def __call__(self, batch: dict) -> dict:
        """batch: documents, each a row whose `questions` holds its question rows as JSON
        (pipeline.dataplane._pack_document) -> the records of every answer row, as columns."""
        out: dict[str, list] = {}
        for packed in batch["questions"]:
            for k, v in self.answer_document(json.loads(packed)).items():
                out.setdefault(k, []).extend(v)
        return out

    @torch.no_grad()
    def answer_document(self, questions: list[dict]) -> dict:
        from notebank.pipeline.query import answer_rows_table
        doc_id = questions[0]["doc_id"]
        info = self.docs.get(doc_id)
        t0 = time.perf_counter()
        mem = None
        try:
            if info is None:
                raise ArchiveError(f"document {doc_id!r} is not archived in {self.store.url if self.store else '-'}")
            if "text_at" in info:       # one-pass: ingest here, answer from memory, persist nothing
                mem = self.backend.ingest(doc_id, read_corpus_text(info["text_at"]))
            else:
                mem = self.load_memory(self.store, doc_id, info)
            err = None
        except (ArchiveError, FingerprintMismatch, SchemaError, ValueError, RuntimeError) as e:
            err = _err(e)
        load_s = time.perf_counter() - t0
        out_rows = []
        for q in sorted(questions, key=lambda q: q["question_id"]):
            for m in json.loads(q["methods"]):
                read = {**self.read, "method": m}
                try:
                    fields = self.backend.read_fields(read)
                except ValueError as e:
                    fields, err_q = {"method": m, "read_config": "{}"}, _err(e)
                else:
                    err_q = err
                base = {"question_id": q["question_id"], "doc_id": doc_id, **fields,
                        "answers": json.loads(q["answers"]), "source_shard": q["source_shard"],
                        "source_row": int(q["source_row"]), "load_s": load_s, **self.provenance,
                        "retried": m in json.loads(q.get("retried") or "[]")}
                if err_q is not None:
                    out_rows.append({**base, "status": "failed", "error": err_q})
                    continue
                out_rows.append({**base, **self._answer(mem, q, read)})
        key = hashlib.sha1(json.dumps(sorted((r["question_id"], r["method"]) for r in out_rows)).encode()).hexdigest()[:16]
        dk = S.doc_key(doc_id)[0] or hashlib.sha1(doc_id.encode()).hexdigest()[:16]
        table = answer_rows_table(out_rows)
        from notebank.schemas._base import table_to_parquet_bytes
        self.out.atomic_write(f"part-{dk}-{key}.parquet", table_to_parquet_bytes(table))
        return {"question_id": [r["question_id"] for r in out_rows], "method": [r["method"] for r in out_rows],
                "status": [r["status"] for r in out_rows], "error": [r.get("error") for r in out_rows],
                "score": [r.get("score") for r in out_rows]}

    def _answer(self, mem, q: dict, read: dict) -> dict:
        from notebank.pipeline.query import score_fn
        t0 = time.perf_counter()
        refs = json.loads(q["answers"])
        try:
            row = self.backend.answer(mem, q["question"], read, answers=refs)
        except Exception as e:  # one bad question must not sink the document
            return {"status": "failed", "error": _err(e), "trace": traceback.format_exc(limit=3)}
        fn, _ = score_fn()
        return {"status": "ok", "error": None, **row, "total_s": time.perf_counter() - t0,
                "score": float(fn(row["answer"], refs)) if refs else None}


def read_corpus_text(at: dict) -> str:
    """One-pass mode: the text of one corpus row, read from its shard at the scan's seek point."""
    from notebank.pipeline.corpus import iter_shard
    from notebank.schemas.inputs import check_corpus_row
    for i, raw, err, _ in iter_shard(at["shard"], at["seek"]):
        if i == at["row"]:
            _doc_id, text, _meta, err = check_corpus_row(raw) if raw is not None else (None, None, {}, err)
            if err:
                raise ValueError(f"{at['shard']}:{i}: {err}")
            return text
        if i > at["row"]:
            break
    raise ArchiveError(f"{at['shard']}: row {at['row']} is gone (the shard changed during the job?)")
