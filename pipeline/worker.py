"""The Ray actor body: one loaded, frozen backbone per actor; ingest / answer / one-pass calls.

Plain class (Ray wraps it in pipeline.pool), so it is also usable and testable without Ray.
"""
from __future__ import annotations

import json
import os
import time
import traceback

import torch

from nbcore.config import NoteBankConfig, ReadConfig
from notebank.pipeline import archive_io
from notebank.pipeline.store import ArchiveError, ArchiveStore, FingerprintMismatch
from notebank.schemas._base import SchemaError

# Model loading lives in nbcore (pure PyTorch); imported here for the worker and older callers.
from nbcore.backbones.loading import DTYPES, build_backbone, build_tokenizer, byte_tokenizer, tokenizer_fingerprint  # noqa: E402,F401


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class NoteBankWorker:
    def __init__(self, model: dict, torch_threads: int = 1):
        from notebank.pipeline.allocator import runs_on_cpu, tune_cpu_malloc
        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        if runs_on_cpu(model):
            tune_cpu_malloc()          # stable heap reuse for the forward's temporaries (pipeline/allocator.py)
        self.model_spec = model
        self.bb = build_backbone(model)
        self.fp = self.bb.fingerprint()
        self.tokenizer_fp = tokenizer_fingerprint(self.bb.tokenizer)

    def info(self) -> dict:
        return {"pid": os.getpid(), "fingerprint": self.fp, "tokenizer": self.tokenizer_fp, "family": self.bb.family,
                "n_channels": self.bb.n_channels, "device": str(self.bb.device),
                "has_tokenizer": self.bb.tokenizer is not None}

    # ---- ingest ---------------------------------------------------------------------------------
    @torch.no_grad()
    def ingest_doc(self, task: dict, nb: dict, block_size: int) -> dict:
        """task: {doc_id, text}. -> {ok, error | notes, state, n_tokens, n_notes, n_archived_tokens, timings}."""
        from nbcore import ingest
        cfg = NoteBankConfig(**nb)
        t0 = time.perf_counter()
        try:
            res = ingest(self.bb, task["text"], cfg, block_size=block_size)
        except ValueError as e:       # empty document, tokenizer problems: a property of the input
            return {"ok": False, "error": _err(e)}
        t1 = time.perf_counter()
        notes = archive_io.archive_to_notes_bytes(task["doc_id"], res.archive, self.bb.n_channels)
        state = archive_io.state_to_bytes(self.bb.state_to_tensors(res.state), doc_id=task["doc_id"],
                                          model_fingerprint=self.fp)
        timings = {k: float(v) for k, v in res.timings.items()}
        timings.update(ingest_s=t1 - t0, serialize_s=time.perf_counter() - t1)
        return {"ok": True, "notes": notes, "state": state, "n_tokens": int(res.n_tokens),
                "n_notes": len(res.archive), "n_archived_tokens": int(res.archive.n_archived_tokens),
                "timings": timings}

    @torch.no_grad()
    def prefill_doc(self, text: str, nb: dict, block_size: int) -> dict:
        """Plain prefill of the same document through the same blocks (benchmark baseline)."""
        from nbcore import ingest
        t0 = time.perf_counter()
        res = ingest(self.bb, text, NoteBankConfig(**nb), block_size=block_size, write=False)
        return {"n_tokens": int(res.n_tokens), "wall_s": time.perf_counter() - t0}

    # ---- query ----------------------------------------------------------------------------------
    def load_document(self, doc: dict):
        """doc: {"payload": {...}} (bytes shipped by the driver) or {"archive": url, "key": key}."""
        payload = doc.get("payload") or ArchiveStore(doc["archive"]).document_payload(doc["key"])
        archive = archive_io.notes_bytes_to_archive(payload["notes"], payload["notes_url"], expect_model=self.fp)
        tensors = archive_io.bytes_to_state_tensors(payload["state"], payload["state_url"], expect_model=self.fp)
        try:
            state = self.bb.state_from_tensors(tensors)
        except Exception as e:
            raise ArchiveError(f"{payload['state_url']}: state does not fit this model: {_err(e)}") from e
        return state, archive

    @torch.no_grad()
    def answer_doc(self, doc: dict, questions: list[dict], read_cfgs: list[dict]) -> list[dict]:
        """Load one document's state and notes once, answer all its questions with every method."""
        rcs = [ReadConfig(**rc) for rc in read_cfgs]
        t0 = time.perf_counter()
        try:
            state, archive = self.load_document(doc)
        except (ArchiveError, FingerprintMismatch, SchemaError) as e:
            return [_failed_row(q, rc, _err(e)) for q in questions for rc in rcs]
        load_s = time.perf_counter() - t0
        rows = []
        for q in questions:
            for rc in rcs:
                rows.append(self._answer_one(state, archive, q, rc, load_s=load_s))
        return rows

    def _answer_one(self, state, archive, q: dict, rc: ReadConfig, context_ids=None, **extra) -> dict:
        from nbcore import answer
        t0 = time.perf_counter()
        try:
            if rc.method == "jrt" and context_ids is None:
                raise ValueError("jrt re-reads the context, which is not persisted: use the one-pass mode")
            a = answer(self.bb, state, archive, q["question"], rc, answers=q.get("answers"), context_ids=context_ids)
        except Exception as e:  # one bad question must not sink the document
            row = _failed_row(q, rc, _err(e))
            row["trace"] = traceback.format_exc(limit=3)
            return row
        return {
            "question_id": q["question_id"], "doc_id": q["doc_id"], "method": rc.method,
            "read_config": rc_json_of(rc), "status": "ok", "error": None, "answer": a.text,
            "token_ids": [int(t) for t in a.token_ids], "retrieved": [int(i) for i in a.retrieved],
            "votes": [float(v) for v in a.votes], "replay_len": int(a.replay_len),
            "probe_s": float(a.timings.get("probe_s", 0.0)), "route_s": float(a.timings.get("route_s", 0.0)),
            "replay_generate_s": float(a.timings.get("replay_generate_s", 0.0)),
            "total_s": time.perf_counter() - t0, "answers": q.get("answers"), **extra,
        }

    # ---- one pass (evaluation sweeps) -------------------------------------------------------------
    @torch.no_grad()
    def onepass(self, example: dict, nb_cfgs: list[dict], read_cfgs: list[dict], block_size: int) -> list[dict]:
        """Ingest one example's context (per NoteBank config) and answer its questions; nothing persisted."""
        from nbcore import ingest
        rows = []
        rcs = [ReadConfig(**rc) for rc in read_cfgs]
        questions = [{**q, "doc_id": example["doc_id"]} for q in example["questions"]]
        for nbd in nb_cfgs:
            nb = NoteBankConfig(**nbd)
            t0 = time.perf_counter()
            try:
                res = ingest(self.bb, example["text"], nb, block_size=block_size)
            except Exception as e:
                rows += [{**_failed_row(q, rc, _err(e)), "notebank": json.dumps(nbd, sort_keys=True)}
                         for q in questions for rc in rcs]
                continue
            ingest_s = time.perf_counter() - t0
            for q in questions:
                for rc in rcs:
                    row = self._answer_one(res.state, res.archive, q, rc, context_ids=res.token_ids)
                    row.update(notebank=json.dumps(nbd, sort_keys=True), n_tokens=int(res.n_tokens),
                               n_notes=len(res.archive), ingest_s=ingest_s)
                    rows.append(row)
        return rows


def rc_json_of(rc: ReadConfig) -> str:
    d = dict(rc.__dict__)
    d["stop"] = list(d.get("stop") or ())
    return json.dumps(d, sort_keys=True)


def _failed_row(q: dict, rc: ReadConfig, error: str) -> dict:
    return {"question_id": q["question_id"], "doc_id": q["doc_id"], "method": rc.method,
            "read_config": rc_json_of(rc), "status": "failed", "error": error, "answers": q.get("answers")}
