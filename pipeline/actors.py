"""Callable classes for Ray Data's `map_batches` / `map_groups`: one frozen backbone per actor.

IngestActor: one batch = one group of corpus rows. For each document it ingests (or appends to) the
memory, writes the state straight to the store, and at the end of the group writes the notes part,
the documents part and the commit record (pipeline/archive.py). It returns one small record per
row: ids, counts, status; never notes or states.

QueryActor: one batch = all questions of one document. It loads the document's state and notes once
from the store, answers every question with every method still missing, writes the answers part
itself (temporary name + rename) and returns small records.

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

from nbcore.config import NoteBankConfig, ReadConfig
from pipeline.archive import Archive, ArchiveError, FingerprintMismatch, bf16_bits
from schemas import archive as S
from schemas._base import SchemaError

RECORD_COLUMNS = ("doc_id", "group", "status", "error", "n_tokens", "n_notes", "bytes", "source_shard",
                  "source_row", "generation", "pid")


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _decode(tok, ids) -> str | None:
    if tok is None:
        return None
    return tok.decode([int(t) for t in ids], skip_special_tokens=False)


class _Backbone:
    """Loads the model once (pipeline.worker.NoteBankWorker does the loading and fingerprints)."""

    def __init__(self, model: dict, torch_threads: int):
        from pipeline.worker import NoteBankWorker
        self.worker = NoteBankWorker(model, torch_threads)
        self.bb = self.worker.bb
        self.fp = self.worker.fp


class IngestActor(_Backbone):
    def __init__(self, model: dict, nb: dict, block_size: int, output: str, fp_digest: str,
                 tokenizer_name: str | None, torch_threads: int = 1, piece_bytes: int = 1 << 30,
                 expect_fingerprint: str | None = None):
        super().__init__(model, torch_threads)
        if expect_fingerprint is not None and self.fp != expect_fingerprint:
            raise FingerprintMismatch(f"this actor loaded model {self.fp}, the run expects {expect_fingerprint}: is "
                                      f"the checkpoint identical on every node?")
        self.nb = NoteBankConfig(**nb)
        self.nb_json = json.dumps(self.nb.to_dict(), sort_keys=True)
        self.block_size = block_size
        self.store = Archive(output)
        self.fp_digest = fp_digest
        self.tokenizer_name = tokenizer_name
        self.piece_bytes = piece_bytes
        self.n_slots = self.bb.n_channels * self.nb.addr_positions

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
        for d in sorted(docs, key=lambda d: d["row"]):
            src = {"shard": d["shard"], "row": d["row"]}
            entry = S.DocEntry(doc_id=d.get("doc_id"), key=d.get("key"), status="failed", source=src,
                               generation=int(d.get("generation", 0)))
            rec = {"doc_id": entry.doc_id, "group": group, "status": "failed", "error": None, "n_tokens": 0,
                   "n_notes": 0, "bytes": 0, "source_shard": d["shard"], "source_row": d["row"],
                   "generation": entry.generation, "pid": os.getpid()}
            if d["action"] in ("ingest", "append"):
                try:
                    n_tok, n_new, n_live, n_arch, refs = self._ingest_one(d, entry, note_rows)
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
            rec.update(status=entry.status, error=entry.error)
            if entry.status == "failed" and d["action"] in ("ingest", "append"):
                doc_rows.append(self._doc_row(d, entry, 0, 0, None, []))
            entries.append(entry)
            records.append(rec)
        commit = self.store.write_group(group, entries, note_rows, doc_rows, n_slots=self.n_slots,
                                        addr_dim=self.nb.addr_dim, fp_digest=self.fp_digest,
                                        timings={"group_s": time.perf_counter() - t0})
        extra = (commit.notes.size if commit.notes else 0) + commit.documents_file.size
        if records:
            records[0]["bytes"] += extra          # the group's shared files, counted once
        return records

    def _ingest_one(self, d: dict, entry: S.DocEntry, note_rows: list):
        from nbcore import ingest
        text, key, gen = d["text"], d["key"], int(d.get("generation", 0))
        if d["action"] == "append":
            state, archive, carry = self._load_for_append(d)
            from nbcore import append
            res = append(self.bb, state, archive, carry, text, self.nb, block_size=self.block_size)
            first_new = len(archive)
        else:
            res = ingest(self.bb, text, self.nb, block_size=self.block_size)
            first_new = 0
        a = res.archive
        if len(a):
            bits = bf16_bits(a.addresses)
        for i in range(first_new, len(a)):
            note_rows.append({"doc_id": entry.doc_id, "generation": gen, "note_index": i,
                              "chunk_index": int(a.chunk_index[i]), "start": int(a.starts[i]),
                              "end": int(a.ends[i]), "token_ids": a.token_ids[i],
                              "text": _decode(self.bb.tokenizer, a.token_ids[i]), "addresses": bits[i]})
        tensors = dict(self.bb.state_to_tensors(res.state))
        carry = getattr(res, "carry", None)
        if carry is not None:
            tensors.update(carry.to_tensors())
        refs = self.store.write_state(key, gen, tensors, doc_id=entry.doc_id, model_fingerprint=self.fp,
                                      piece_bytes=self.piece_bytes)
        return int(res.n_tokens), len(a) - first_new, len(a), int(a.n_archived_tokens), refs

    def _load_for_append(self, d: dict):
        from nbcore.notebank.write import WriterCarry
        prev = d["previous"]   # {"state": [FileRef dicts], "notes_files": [...], "generation": g}
        tensors = self.store.read_state([S.FileRef(**r) for r in prev["state"]], expect_model=self.fp)
        carry_t = {k: v for k, v in tensors.items() if k.startswith("carry.")}
        if not carry_t:
            raise ArchiveError(f"document {d['doc_id']!r}: its stored state has no writer carry (archived before "
                               f"appends were supported): re-ingest it")
        state = self.bb.state_from_tensors({k: v for k, v in tensors.items() if not k.startswith("carry.")})
        archive = load_archive(self.store, d["doc_id"], prev["notes_files"], prev["generation"], self.nb,
                               self.fp, int(prev["n_tokens"]), self.bb.n_channels)
        return state, archive, WriterCarry.from_tensors(carry_t)

    def _doc_row(self, d, entry: S.DocEntry, n_live: int, n_arch: int, notes_rel, refs) -> dict:
        return {"doc_id": entry.doc_id, "key": entry.key, "generation": entry.generation, "status": entry.status,
                "error": entry.error, "memory": "notebank", "n_tokens": entry.n_tokens, "n_notes": n_live,
                "n_archived_tokens": n_arch, "text_sha256": entry.text_sha256, "source_shard": d["shard"],
                "source_row": d["row"], "metadata": json.dumps(d.get("metadata") or {}, sort_keys=True),
                "model_fingerprint": self.fp, "tokenizer": self.tokenizer_name,
                "tokenizer_hash": self.worker.tokenizer_fp, "notebank": self.nb_json, "group": d.get("group_id"),
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


class QueryActor(_Backbone):
    def __init__(self, model: dict, archive: str, output: str, read: dict, nb: dict, docs_ref,
                 provenance: dict, torch_threads: int = 1):
        super().__init__(model, torch_threads)
        import ray
        self.store = Archive(archive)
        self.out = Archive(output)
        self.read = read                              # shared ReadConfig fields; method set per row
        self.nb = NoteBankConfig(**nb)
        if isinstance(docs_ref, list):              # [ObjectRef]: wrapped so Ray does not resolve it per call
            docs_ref = docs_ref[0]
        self.docs = ray.get(docs_ref) if isinstance(docs_ref, ray.ObjectRef) else docs_ref
        self.provenance = provenance

    def __call__(self, batch) -> dict:
        rows = batch.to_pylist() if hasattr(batch, "to_pylist") else _rows_of(batch)
        return self.answer_document(rows)

    @torch.no_grad()
    def answer_document(self, questions: list[dict]) -> dict:
        from pipeline.query import answer_rows_table, rc_json
        doc_id = questions[0]["doc_id"]
        info = self.docs.get(doc_id)
        t0 = time.perf_counter()
        try:
            if info is None:
                raise ArchiveError(f"document {doc_id!r} is not archived in {self.store.url}")
            tensors = self.store.read_state([S.FileRef(**r) for r in info["state"]], expect_model=self.fp)
            state = self.bb.state_from_tensors({k: v for k, v in tensors.items() if not k.startswith("carry.")})
            del tensors
            archive = load_archive(self.store, doc_id, info["notes_files"], info["generation"], self.nb, self.fp,
                                   info["n_tokens"], self.bb.n_channels)
            err = None
        except (ArchiveError, FingerprintMismatch, SchemaError, ValueError, RuntimeError) as e:
            err = _err(e)
        load_s = time.perf_counter() - t0
        out_rows = []
        for q in sorted(questions, key=lambda q: q["question_id"]):
            for m in json.loads(q["methods"]):
                rc = ReadConfig(**{**self.read, "method": m})
                base = {"question_id": q["question_id"], "doc_id": doc_id, "method": m, "read_config": rc_json(rc),
                        "answers": json.loads(q["answers"]), "source_shard": q["source_shard"],
                        "source_row": int(q["source_row"]), "load_s": load_s, **self.provenance}
                if err is not None:
                    out_rows.append({**base, "status": "failed", "error": err})
                    continue
                out_rows.append({**base, **self._answer(state, archive, q, rc)})
        key = hashlib.sha1(json.dumps(sorted((r["question_id"], r["method"]) for r in out_rows)).encode()).hexdigest()[:16]
        from pipeline.store import doc_key
        dk = doc_key(doc_id)[0] or hashlib.sha1(doc_id.encode()).hexdigest()[:16]
        table = answer_rows_table(out_rows)
        from schemas._base import table_to_parquet_bytes
        self.out.atomic_write(f"part-{dk}-{key}.parquet", table_to_parquet_bytes(table))
        return {"question_id": [r["question_id"] for r in out_rows], "method": [r["method"] for r in out_rows],
                "status": [r["status"] for r in out_rows], "error": [r.get("error") for r in out_rows],
                "score": [r.get("score") for r in out_rows]}

    def _answer(self, state, archive, q: dict, rc: ReadConfig) -> dict:
        from nbcore import answer
        from pipeline.query import score_fn
        t0 = time.perf_counter()
        try:
            a = answer(self.bb, state, archive, q["question"], rc, answers=json.loads(q["answers"]))
        except Exception as e:  # one bad question must not sink the document
            return {"status": "failed", "error": _err(e), "trace": traceback.format_exc(limit=3)}
        refs = json.loads(q["answers"])
        fn, _ = score_fn()
        return {"status": "ok", "error": None, "answer": a.text, "token_ids": [int(t) for t in a.token_ids],
                "retrieved": [int(i) for i in a.retrieved], "votes": [float(v) for v in a.votes],
                "replay_len": int(a.replay_len), "probe_s": float(a.timings.get("probe_s", 0.0)),
                "route_s": float(a.timings.get("route_s", 0.0)),
                "replay_generate_s": float(a.timings.get("replay_generate_s", 0.0)),
                "total_s": time.perf_counter() - t0, "score": float(fn(a.text, refs)) if refs else None}


def _rows_of(batch: dict) -> list[dict]:
    cols = list(batch)
    n = len(batch[cols[0]]) if cols else 0
    return [{c: (batch[c][i].item() if hasattr(batch[c][i], "item") else batch[c][i]) for c in cols} for i in range(n)]
