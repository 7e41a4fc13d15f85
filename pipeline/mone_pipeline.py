"""`memory: mone` in the ingest and query jobs (issue 7): per-document MoNe fast-weight state.

Ingest: each document's text is tokenised and written segment by segment into fresh fast weights
(``nbcore.mone.state``); the state (safetensors) and a MoneDocRecord are committed with the archive
store's protocol (pipeline/store.py: temporary name + rename, record last; the driver is the only
writer, reruns skip committed documents). With ``append: true`` a row whose doc_id is already
committed with another text continues that document's state from where it stopped (incremental
ingest: the appended text is tokenised on its own, so parts split at a token boundary give the state
of the whole text).

Query: questions grouped by document; an actor loads the document's state once (checked against
the record's sha256), writes its incomplete tail segment on a copy (``state.finalized``) and answers
every question with the question alone plus memory tokens. The context is never read.

The actor (``MoneWorker``) is a plain class, wrapped by Ray here; it is usable without Ray.

    python jobs/ingest.py -c configs/ingest.yaml --set memory=mone --set model.path=models/tiny-qwen2 \
        --set corpus=data/corpus --set output=out/mone
    python jobs/ingest.py ... --set append=true --set corpus=data/more     # continue documents' states
    python jobs/query.py -c configs/query.yaml --set memory=mone --set model.path=models/tiny-qwen2 \
        --set questions=data/questions.jsonl --set archive=out/mone --set output=out/answers.parquet
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

import torch

from schemas.mone import VERSION as RECORD_VERSION, MoneDocRecord, MonePart

STATE_VERSION = 1


# ------------------------------------------------------------------------------------------------
# fingerprints

def files_digest(paths: list[Path]) -> str:
    """sha256 over (name, bytes) of the given files, in order."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:20]


def model_fingerprint(base_dir: str, adapters_dir: str) -> str:
    """Digest of the frozen base (config + weights) and the meta-trained MoNe parameters."""
    base, ad = Path(base_dir), Path(adapters_dir)
    files = [base / "config.json", *sorted(base.glob("*.safetensors")), ad / "mone_config.json",
             ad / "mone_adapters.safetensors"]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"MoNe model files missing: {missing}")
    return files_digest(files)


def run_fingerprint(info: dict) -> dict:
    """What every state in a `memory: mone` output folder is a pure function of (besides the texts)."""
    return {"memory": "mone", "model": info["fingerprint"], "tokenizer": info["tokenizer"], "mone": info["mone"],
            "schema_versions": {"mone_state": STATE_VERSION, "manifest_mone_doc": RECORD_VERSION}}


def adapters_dir(model_path: str, adapters: str | None) -> str:
    return adapters or os.path.join(model_path, "mone")


# ------------------------------------------------------------------------------------------------
# the actor body

class MoneWorker:
    """One loaded MoNe model (frozen base + meta-trained parameters) per actor, CPU, float32."""

    def __init__(self, model: dict, adapters: str | None, torch_threads: int = 1):
        from nbcore.mone.model import MoNeModel
        from pipeline.worker import build_tokenizer, tokenizer_fingerprint
        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        path = model["path"]
        self.adapters = adapters_dir(path, adapters)
        self.fp = model_fingerprint(path, self.adapters)
        self.model = MoNeModel.from_pretrained(path, self.adapters).eval()
        if model.get("tokenizer"):
            self.tok = build_tokenizer(model["tokenizer"])
        else:
            from nbcore.tasks.tokenizer import load_tokenizer
            self.tok = load_tokenizer(path)
        self.tokenizer_fp = tokenizer_fingerprint(self.tok)

    def info(self) -> dict:
        return {"pid": os.getpid(), "fingerprint": self.fp, "tokenizer": self.tokenizer_fp, "memory": "mone",
                "mone": dataclasses.asdict(self.model.cfg), "n_layers": self.model.n_layers}

    def tokenize(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def ingest_doc(self, task: dict, previous: bytes | None = None) -> dict:
        """task: {doc_id, text}; previous: the committed state bytes to continue (append), or None.
        -> {ok, error | state, n_tokens (this part), n_tokens_total, n_segments, n_pending, timings}."""
        from nbcore.mone import state as mstate
        t0 = time.perf_counter()
        ids = self.tokenize(task["text"])
        if not ids:
            return {"ok": False, "error": "ValueError: empty document (no tokens)"}
        prev = (mstate.MoNeState.from_bytes(previous, f"previous state of {task['doc_id']!r}")
                if previous is not None else mstate.new_state(self.model))
        t1 = time.perf_counter()
        st = mstate.append(self.model, prev, ids)
        t2 = time.perf_counter()
        data = st.to_bytes({"doc_id": task["doc_id"], "model": self.fp})
        return {"ok": True, "state": data, "n_tokens": len(ids), "n_tokens_total": st.n_tokens,
                "n_segments": st.n_segments, "n_pending": len(st.pending),
                "timings": {"tokenize_load_s": t1 - t0, "write_s": t2 - t1, "serialize_s": time.perf_counter() - t2}}

    def load_fast_weights(self, doc: dict):
        """doc: {"payload": {...}} (shipped by the driver) or {"archive": url, "key": key}."""
        from nbcore.mone import state as mstate
        from pipeline.store import ArchiveStore
        payload = doc.get("payload") or ArchiveStore(doc["archive"]).mone_payload(doc["key"])
        st = mstate.MoNeState.from_bytes(payload["state"], payload["state_url"])
        if len(st.layers) != self.model.n_layers or st.segment_len != self.model.cfg.segment_len:
            raise ValueError(f"{payload['state_url']}: state ({len(st.layers)} layers, T={st.segment_len}) does not "
                             f"fit this model ({self.model.n_layers} layers, T={self.model.cfg.segment_len})")
        return mstate.finalized(self.model, st)

    @torch.no_grad()
    def answer_doc(self, doc: dict, questions: list[dict], gen: dict) -> list[dict]:
        """Load one document's state once; answer every question from the question + memory tokens."""
        t0 = time.perf_counter()
        try:
            fast = self.load_fast_weights(doc)
        except Exception as e:  # noqa: BLE001 - a bad state fails its questions, not the job
            return [failed_row(q, gen, f"{type(e).__name__}: {e}") for q in questions]
        load_s = time.perf_counter() - t0
        return [self._answer_one(fast, q, gen, load_s) for q in questions]

    def _answer_one(self, fast, q: dict, gen: dict, load_s: float) -> dict:
        t0 = time.perf_counter()
        try:
            ids = self.tokenize(q["question"])
            eos = self.tok.eos_token_id if gen.get("stop_at_eos", True) else None
            out = self.model.generate(ids, fast, int(gen["max_new_tokens"]), eos) if gen["max_new_tokens"] else []
            text = cut_at_stop(self.tok.decode(out), gen.get("stop") or ())
        except Exception as e:  # noqa: BLE001
            return failed_row(q, gen, f"{type(e).__name__}: {e}")
        return {"question_id": q["question_id"], "doc_id": q["doc_id"], "method": "mone",
                "read_config": gen_json(gen), "status": "ok", "error": None, "answer": text,
                "token_ids": [int(t) for t in out], "retrieved": [], "votes": [], "replay_len": 0,
                "probe_s": 0.0, "route_s": 0.0, "replay_generate_s": time.perf_counter() - t0,
                "total_s": time.perf_counter() - t0 + load_s, "answers": q.get("answers")}


def cut_at_stop(text: str, stop) -> str:
    """Text up to the first stop string (stop strings themselves removed)."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=len(text))
    return text[:cut]


def gen_json(gen: dict) -> str:
    return json.dumps({"method": "mone", **{k: (list(v) if isinstance(v, tuple) else v) for k, v in gen.items()}},
                      sort_keys=True)


def failed_row(q: dict, gen: dict, error: str) -> dict:
    return {"question_id": q["question_id"], "doc_id": q["doc_id"], "method": "mone", "read_config": gen_json(gen),
            "status": "failed", "error": error, "answers": q.get("answers")}


# ------------------------------------------------------------------------------------------------
# Ray pool

def start_mone_workers(model, actors, adapters: str | None) -> tuple[list, list[dict]]:
    """Actors of MoneWorker (same options and fault tolerance as pipeline.pool.start_workers)."""
    import ray

    from pipeline.pool import stop_workers
    opts = dict(num_cpus=actors.num_cpus, num_gpus=actors.num_gpus, max_restarts=actors.max_restarts,
                max_task_retries=actors.max_task_retries)
    if actors.accelerator_type:
        opts["accelerator_type"] = actors.accelerator_type
    threads = actors.torch_threads or max(1, int(actors.num_cpus))
    spec = dataclasses.asdict(model)
    if spec.get("path") and "://" not in spec["path"] and os.path.exists(spec["path"]):
        spec["path"] = os.path.abspath(spec["path"])       # actors may run in another directory
    if adapters and "://" not in adapters and os.path.exists(adapters):
        adapters = os.path.abspath(adapters)
    cls = ray.remote(MoneWorker)
    handles = [cls.options(**opts).remote(spec, adapters, threads) for _ in range(actors.num_actors)]
    try:
        infos = ray.get([h.info.remote() for h in handles], timeout=actors.start_timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
        stop_workers(handles)
        raise RuntimeError(f"could not start the MoNe actors (model {spec}, adapters {adapters}): {e}") from e
    if len({(i["fingerprint"], i["tokenizer"]) for i in infos}) != 1:
        stop_workers(handles)
        raise RuntimeError("MoNe actors loaded different models or tokenizers; is the checkpoint identical everywhere?")
    return handles, infos


# ------------------------------------------------------------------------------------------------
# ingest driver

def run_ingest_mone(cfg, on_commit: Callable | None = None, workers: tuple | None = None) -> dict:
    """Ingest (or resume, or append to) a corpus into per-document MoNe states. -> summary dict."""
    from pipeline.ingest import Tally, new_rows, open_output, sha256_text
    from pipeline.pool import dispatch, worker_failure, worker_pool
    cfg.validate()
    t_start = time.perf_counter()
    store = open_output(cfg.output)
    with worker_pool(workers, start_mone_workers, cfg.model, cfg.actors, cfg.mone_adapters) as (handles, infos):
        fp = run_fingerprint(infos[0])
        store.check_or_write_run(fp)
        done = {k: r for k, r in store.load_records(MoneDocRecord).items() if r.status == "ok"}
        tally = Tally(dict(docs_ok=0, docs_appended=0, docs_skipped=0, docs_failed=0, tokens=0, bytes=0),
                      cfg.progress)

        def fail(rec: MoneDocRecord, keep_committed: bool = False):
            # an appended part that fails never replaces the document's committed record
            if not keep_committed:
                store.record_failure(rec)
            tally.failed(rec.doc_id, rec.error, rec.source)
            if on_commit:
                on_commit(rec)

        def reject(error, base, committed):
            fail(MoneDocRecord(error=error, **base), keep_committed=committed)

        def tasks():
            for row, key, base in new_rows(cfg, fp, done, reject):
                sha = sha256_text(row.text)
                prev = done.get(key)
                previous = None
                if prev is not None:
                    if sha in prev.text_shas:
                        tally.skipped()
                        continue
                    if not cfg.append:
                        tally.failed(row.doc_id, "already archived with different text; use a new output folder, "
                                                 "or append: true to continue its MoNe state", row.source)
                        continue
                    previous = store.read_verified(prev.state)
                base["key"] = key
                yield {"doc_id": row.doc_id, "text": row.text, "sha": sha, "prev": prev, "previous": previous,
                       "base": base}

        def submit(actor, t):
            return actor.ingest_doc.remote({"doc_id": t["doc_id"], "text": t["text"]}, t["previous"])

        def on_done(t, res, err):
            base, prev = t["base"], t["prev"]
            if err is not None or not res["ok"]:
                why = worker_failure(err) if err is not None else res["error"]
                return fail(MoneDocRecord(error=why, **base), keep_committed=prev is not None)
            parts = (list(prev.parts) if prev else []) + [MonePart(text_sha256=t["sha"], n_tokens=res["n_tokens"])]
            rec = MoneDocRecord(**{**base, "status": "ok"}, n_tokens=res["n_tokens_total"],
                                n_segments=res["n_segments"], n_pending=res["n_pending"], parts=parts,
                                timings=res["timings"])
            rec = store.commit_mone(base["key"], len(parts), res["state"], rec,
                                    previous=prev.state if prev else None)
            tally.stats["docs_appended" if prev else "docs_ok"] += 1
            tally.stats["tokens"] += res["n_tokens"]
            tally.stats["bytes"] += rec.bytes
            tally.bar.update(1)
            if on_commit:
                on_commit(rec)

        dispatch(handles, tasks(), submit, on_done, max_in_flight=cfg.actors.max_in_flight)
        tally.bar.close()
    return tally.summary(t_start, cfg.output, memory="mone")


# ------------------------------------------------------------------------------------------------
# query driver

def run_query_mone(cfg, workers: tuple | None = None) -> dict:
    """Answer questions from per-document MoNe states. Output: answers Parquet (schemas.answers)."""
    from pipeline.corpus import read_questions
    from pipeline.pool import worker_pool
    from pipeline.query import answer_documents, check_fingerprints, open_archive, write_answers
    from pipeline.store import FingerprintMismatch
    cfg.validate()
    t_start = time.perf_counter()
    store, run = open_archive(cfg.archive)
    if run["fingerprint"].get("memory", "notebank") != "mone":
        raise FingerprintMismatch(f"{cfg.archive} holds NoteBank archives, not MoNe states: set memory: notebank")
    questions, rejected = read_questions(cfg.questions)
    gen = {"max_new_tokens": cfg.read.max_new_tokens, "stop": list(cfg.read.stop or ()),
           "stop_at_eos": cfg.read.stop_at_eos}
    with worker_pool(workers, start_mone_workers, cfg.model, cfg.actors, cfg.mone_adapters) as (handles, infos):
        check_fingerprints(store, run, infos[0], "states")
        rows = answer_documents(cfg, store, handles, questions, gen,
                                fail_rows=lambda qs, why: [failed_row(q, gen, why) for q in qs],
                                record_cls=MoneDocRecord, payload=store.mone_payload, stored="ingested")
    return write_answers(cfg.output, rows, rejected, t_start, memory="mone")
