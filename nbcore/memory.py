"""One memory-backend interface for the pipeline's worker: NoteBank and MoNe behind the same calls.

    backend = get_backend("notebank", bb=bb, nb_cfg=NoteBankConfig(), block_size=8192)
    backend = get_backend("mone", base_dir="models/tiny-qwen2")           # adapters: <base>/mone
    mem = backend.ingest("doc1", text)                 # fresh document -> Memory
    mem = backend.append(mem, more_text)               # continue it (consumes `mem`; use the result)
    files = backend.to_files(mem)                      # MemoryFiles: plain data, no backend knowledge
    mem = backend.from_files(files)                    # what the query side loads
    row = backend.answer(mem, question, read)          # one answer row (without question_id, ...)
    row.update(backend.read_fields(read))              # method + canonical read_config JSON

``MemoryFiles`` is what a worker persists, without knowing the backend:
  tensors  dict[str, Tensor], CPU, contiguous: one safetensors state file. NoteBank: the backbone
           state (``bb.state_to_tensors``) plus the writer carry under ``carry.``; MoNe: the fast
           weights, the pending ids and the counters (``nbcore.mone.backend_support.state_to_tensors``).
  notes    NoteBank: one dict per note, in write order: note_index, chunk_index, start, end,
           token_ids (list[int]), text (decoded, or None without a tokenizer), addresses (uint16
           numpy [slots * d_rho]: the bfloat16 bits, slot-major). MoNe: None.
  facts    JSON-able: backend, doc_id, model (= backend.fingerprint()), n_tokens (all parts), parts
           ([{text_sha256, n_tokens}]), timings (of the last ingest/append), plus NoteBank: n_notes,
           n_archived_tokens, notebank (the writer config); MoNe: n_segments, n_pending, mone.

Errors: ``ValueError`` for bad input (empty document, unknown method, files that do not fit);
``MemoryMismatch`` (a ValueError) when files were written by another backend or model.
Pure PyTorch: never imports ray or pipeline/.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np
import torch

from nbcore.config import METHODS as NOTEBANK_METHODS, NoteBankConfig, ReadConfig
from nbcore.notebank.archive import Archive

CARRY_PREFIX = "carry."


class MemoryMismatch(ValueError):
    """Files written by another backend or another model than the one loaded."""


@dataclass
class Memory:
    """One document's memory, as a backend holds it between calls.

    state:   NoteBank: the backbone state S_T (BackboneState); MoNe: the MoNeState (fast weights,
             pending ids, counters).
    archive: NoteBank's Archive (None for MoNe).
    carry:   NoteBank's writer carry (``nbcore.WriterCarry``: what ``nbcore.append`` needs to continue
             writing; None for MoNe).
    parts:   [{text_sha256, n_tokens}] of every ingested/appended text, in order.
    context_ids: NoteBank: the token ids of a document ingested/appended in this process (jrt
             re-reads them); never persisted, so None after ``from_files``.
    timings: of the last ingest/append call.
    """
    backend: str
    doc_id: str
    state: Any
    archive: Archive | None = None
    carry: Any = None
    parts: list[dict] = field(default_factory=list)
    context_ids: np.ndarray | None = None
    timings: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict, repr=False, compare=False)   # derived, per process

    @property
    def n_tokens(self) -> int:
        return int(sum(p["n_tokens"] for p in self.parts))


@dataclass
class MemoryFiles:
    """Plain data a worker persists (see the module docstring)."""
    tensors: dict[str, torch.Tensor]
    notes: list[dict] | None = None
    facts: dict = field(default_factory=dict)


@runtime_checkable
class MemoryBackend(Protocol):
    name: str                       # "notebank" | "mone"
    methods: tuple[str, ...]        # answer methods it supports
    tokenizer: Any                  # the tokenizer it reads with (None: a NoteBank backbone without one)

    def fingerprint(self) -> str:
        """The model fingerprint that files written by this backend are valid for (the same value the
        pipeline stores today: ``bb.fingerprint()`` / ``nbcore.mone.backend_support.model_fingerprint``)."""

    def describe(self) -> dict:
        """JSON-able: memory, model and the write config (what a run's states are a function of)."""

    def ingest(self, doc_id: str, text: str) -> Memory: ...

    def append(self, memory: Memory, text: str) -> Memory: ...

    def read_fields(self, read: dict) -> dict:
        """{"method", "read_config"} of a read config (for ok and failed rows alike)."""

    def answer(self, memory: Memory, question: str, read: dict, answers: list[str] | None = None) -> dict:
        """One answer row: answer, token_ids, retrieved, votes, replay_len, probe_s, route_s,
        replay_generate_s (the caller adds question_id, doc_id, status, total_s, ...)."""

    def to_files(self, memory: Memory) -> MemoryFiles: ...

    def from_files(self, files: MemoryFiles) -> Memory: ...


def sha256_text(text: str) -> str:
    """Hex sha256 of the UTF-8 text (same as pipeline.ingest.sha256_text)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check_memory(backend, memory: Memory) -> None:
    if not isinstance(memory, Memory) or memory.backend != backend.name:
        got = memory.backend if isinstance(memory, Memory) else type(memory).__name__
        raise ValueError(f"{backend.name} backend got a memory of {got!r}")


def _check_files(backend, files: MemoryFiles) -> dict:
    facts = dict(files.facts or {})
    where = f"memory files of {facts.get('doc_id')!r}"
    if facts.get("backend", backend.name) != backend.name:
        raise MemoryMismatch(f"{where} were written by the {facts['backend']!r} backend, not {backend.name!r}")
    model = facts.get("model")
    if model is not None and model != backend.fingerprint():
        raise MemoryMismatch(f"{where} were written by model {model!r}, but the loaded model is "
                             f"{backend.fingerprint()!r}")
    return facts


def _row(text: str, toks, retrieved=(), votes=(), replay_len: int = 0, timings: dict | None = None) -> dict:
    t = timings or {}
    return {"answer": text, "token_ids": [int(x) for x in toks], "retrieved": [int(i) for i in retrieved],
            "votes": [float(v) for v in votes], "replay_len": int(replay_len),
            "probe_s": float(t.get("probe_s", 0.0)), "route_s": float(t.get("route_s", 0.0)),
            "replay_generate_s": float(t.get("replay_generate_s", 0.0))}


# ------------------------------------------------------------------------------------------------
# NoteBank

def _nbcore_append() -> Callable | None:
    """``nbcore.append`` (incremental NoteBank ingest), or None while nbcore has none."""
    from nbcore import reader
    fn = getattr(reader, "append", None)
    if fn is None:
        import nbcore
        try:
            fn = getattr(nbcore, "append")
        except AttributeError:
            fn = None
    return fn


def _writer_carry_cls():
    """nbcore's ``WriterCarry`` class, or None while nbcore has none."""
    for mod in ("nbcore.notebank.write", "nbcore.reader"):
        cls = getattr(importlib.import_module(mod), "WriterCarry", None)
        if cls is not None:
            return cls
    return None


def notebank_append_available() -> bool:
    """Whether nbcore provides incremental NoteBank ingest (``nbcore.append`` + ``WriterCarry``)."""
    return _nbcore_append() is not None and _writer_carry_cls() is not None


class NoteBankBackend:
    """NoteBank (nbcore.ingest / nbcore.answer) on one loaded backbone."""

    name = "notebank"
    methods = NOTEBANK_METHODS

    def __init__(self, bb, nb_cfg: NoteBankConfig | None = None, block_size: int = 8192):
        self.bb = bb
        self.nb_cfg = (nb_cfg or NoteBankConfig()).validate()
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size

    @property
    def tokenizer(self):
        return self.bb.tokenizer

    def fingerprint(self) -> str:
        return self.bb.fingerprint()

    def describe(self) -> dict:
        return {"memory": self.name, "model": self.fingerprint(), "family": self.bb.family,
                "n_channels": int(self.bb.n_channels), "notebank": self.nb_cfg.to_dict(),
                "notebank_digest": self.nb_cfg.digest(), "projection_seed": self.nb_cfg.seed}

    # ---- write ----------------------------------------------------------------------------------
    @torch.no_grad()
    def ingest(self, doc_id: str, text: str) -> Memory:
        from nbcore.reader import ingest
        t0 = time.perf_counter()
        res = ingest(self.bb, text, self.nb_cfg, block_size=self.block_size)
        timings = {k: float(v) for k, v in res.timings.items()}
        timings["ingest_s"] = time.perf_counter() - t0
        return Memory(self.name, doc_id, res.state, res.archive, getattr(res, "carry", None),
                      parts=[{"text_sha256": sha256_text(text), "n_tokens": int(res.n_tokens)}],
                      context_ids=res.token_ids, timings=timings)

    @torch.no_grad()
    def append(self, memory: Memory, text: str) -> Memory:
        """Continue the document with ``text`` (``nbcore.append``, with the archive's own config; the
        part is tokenised on its own). ``memory`` is left unchanged."""
        _check_memory(self, memory)
        fn = _nbcore_append()
        if fn is None:
            raise NotImplementedError("NoteBank append needs nbcore.append (incremental ingest), which this "
                                      "nbcore does not provide")
        if memory.carry is None:
            raise ValueError(f"document {memory.doc_id!r}: its memory has no writer carry (written without "
                             f"one?), so it cannot be continued")
        before = int(memory.archive.n_tokens)
        t0 = time.perf_counter()
        res = fn(self.bb, memory.state, memory.archive, memory.carry, text, memory.archive.config,
                 block_size=self.block_size)
        timings = {k: float(v) for k, v in (getattr(res, "timings", None) or {}).items()}
        timings["ingest_s"] = time.perf_counter() - t0
        part = int(res.archive.n_tokens) - before
        ctx = None
        if memory.context_ids is not None and res.token_ids is not None:   # jrt: the whole document's ids
            ctx = np.concatenate([np.asarray(memory.context_ids), np.asarray(res.token_ids)]).astype(np.int64)
        return Memory(self.name, memory.doc_id, res.state, res.archive, res.carry,
                      parts=list(memory.parts) + [{"text_sha256": sha256_text(text), "n_tokens": part}],
                      context_ids=ctx, timings=timings)

    # ---- read -----------------------------------------------------------------------------------
    def _read_config(self, read: dict) -> ReadConfig:
        try:
            rc = ReadConfig(**read)
        except TypeError as e:
            raise ValueError(f"notebank read config not understood: {e}") from e
        if isinstance(rc.stop, list):
            rc = dataclasses.replace(rc, stop=tuple(rc.stop))
        return rc.validate()

    def read_fields(self, read: dict) -> dict:
        rc = self._read_config(read)
        d = dict(rc.__dict__)
        d["stop"] = list(d.get("stop") or ())
        return {"method": rc.method, "read_config": json.dumps(d, sort_keys=True)}

    @torch.no_grad()
    def answer(self, memory: Memory, question: str, read: dict, answers: list[str] | None = None) -> dict:
        from nbcore.reader import answer
        _check_memory(self, memory)
        rc = self._read_config(read)
        if rc.method == "jrt" and memory.context_ids is None:
            raise ValueError("jrt re-reads the context, which is not persisted: use the one-pass mode")
        a = answer(self.bb, memory.state, memory.archive, question, rc, answers=answers,
                   context_ids=memory.context_ids)
        return _row(a.text, a.token_ids, a.retrieved, a.votes, a.replay_len, a.timings)

    # ---- persist --------------------------------------------------------------------------------
    def to_files(self, memory: Memory) -> MemoryFiles:
        _check_memory(self, memory)
        tensors = {k: v.detach().cpu().contiguous().clone()
                   for k, v in self.bb.state_to_tensors(memory.state).items()}
        if any(k.startswith(CARRY_PREFIX) for k in tensors):
            raise ValueError(f"backbone state tensor names must not start with {CARRY_PREFIX!r}")
        if memory.carry is not None:
            # WriterCarry.to_tensors() names its tensors carry.<field> already; prefix any that are not
            for k, v in memory.carry.to_tensors().items():
                name = k if k.startswith(CARRY_PREFIX) else CARRY_PREFIX + k
                tensors[name] = v.detach().cpu().contiguous().clone()
        arch = memory.archive
        tok = self.bb.tokenizer
        bits = arch.addresses.detach().cpu().contiguous().view(torch.uint16).numpy()
        bits = bits.reshape(len(arch), int(np.prod(bits.shape[1:])))     # (also for an empty archive)
        notes = []
        for i in range(len(arch)):
            ids = [int(t) for t in arch.token_ids[i]]
            notes.append({"note_index": i, "chunk_index": int(arch.chunk_index[i]), "start": int(arch.starts[i]),
                          "end": int(arch.ends[i]), "token_ids": ids,
                          "text": tok.decode(ids) if tok is not None else None,
                          "addresses": bits[i].copy()})
        facts = {"backend": self.name, "doc_id": memory.doc_id, "model": arch.model_fingerprint,
                 "n_tokens": int(arch.n_tokens), "n_notes": len(arch), "n_archived_tokens": int(arch.n_archived_tokens),
                 "notebank": arch.config.to_dict(), "parts": [dict(p) for p in memory.parts],
                 "timings": dict(memory.timings)}
        return MemoryFiles(tensors, notes, facts)

    def from_files(self, files: MemoryFiles) -> Memory:
        facts = _check_files(self, files)
        where = f"memory files of {facts.get('doc_id')!r}"
        if files.notes is None:
            raise ValueError(f"{where}: NoteBank files need notes")
        try:
            cfg = NoteBankConfig(**facts["notebank"]).validate() if "notebank" in facts else self.nb_cfg
        except TypeError as e:
            raise ValueError(f"{where}: NoteBank config in the facts not understood: {e}") from e
        state_t = {k: v for k, v in files.tensors.items() if not k.startswith(CARRY_PREFIX)}
        carry_t = {k: v for k, v in files.tensors.items() if k.startswith(CARRY_PREFIX)}
        try:
            state = self.bb.state_from_tensors(state_t)
        except Exception as e:  # noqa: BLE001 - any shape/key problem: the files do not fit this model
            raise ValueError(f"{where}: state does not fit this model: {type(e).__name__}: {e}") from e
        carry = None
        if carry_t:
            cls = _writer_carry_cls()
            if cls is None:
                raise ValueError(f"{where}: files hold a writer carry, but this nbcore has no WriterCarry")
            try:
                carry = cls.from_tensors(carry_t)      # reads the carry.<field> names
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{where}: writer carry not readable: {type(e).__name__}: {e}") from e
        notes = sorted(files.notes, key=lambda r: int(r["note_index"]))
        if [int(r["note_index"]) for r in notes] != list(range(len(notes))):
            raise ValueError(f"{where}: note_index is not 0..{len(notes) - 1}")
        slots = self.bb.n_channels * cfg.addr_positions
        fp = facts.get("model", self.fingerprint())
        n_tokens = int(facts.get("n_tokens", 0))
        if notes:
            bits = np.stack([np.asarray(r["addresses"], dtype=np.uint16).reshape(-1) for r in notes])
            if bits.shape[1] != slots * cfg.addr_dim:
                raise ValueError(f"{where}: {bits.shape[1]} address values per note, this model needs "
                                 f"{slots} x {cfg.addr_dim}")
            archive = Archive(
                token_ids=[np.asarray(r["token_ids"], dtype=np.int32) for r in notes],
                starts=np.asarray([int(r["start"]) for r in notes], np.int64),
                ends=np.asarray([int(r["end"]) for r in notes], np.int64),
                chunk_index=np.asarray([int(r["chunk_index"]) for r in notes], np.int64),
                addresses=torch.from_numpy(bits.reshape(len(notes), slots, cfg.addr_dim).copy()).view(torch.bfloat16),
                config=cfg, model_fingerprint=fp, n_tokens=n_tokens)
        else:
            archive = Archive.empty(self.bb.n_channels, cfg, fp, n_tokens)
        parts = [dict(p) for p in facts.get("parts") or [{"text_sha256": None, "n_tokens": n_tokens}]]
        return Memory(self.name, facts.get("doc_id"), state, archive, carry, parts=parts,
                      timings=dict(facts.get("timings") or {}))


# ------------------------------------------------------------------------------------------------
# MoNe

MONE_READ_KEYS = ("method", "max_new_tokens", "stop", "stop_at_eos")


class MoneBackend:
    """MoNe (nbcore.mone.state ingest/append/finalized + MoNeModel.generate) on one loaded model.

    ``MoneBackend.load(base_dir, adapters=None, tokenizer=None)`` loads the frozen base and its
    meta-trained parameters (``<base_dir>/mone`` by default) with the files' fingerprint (what the
    pipeline's actors do, pipeline/actors.py:build_memory); the constructor takes a model already in
    memory."""

    name = "mone"
    methods = ("mone",)

    def __init__(self, model, tokenizer, fingerprint: str | None = None):
        from nbcore.mone.backend_support import weights_fingerprint
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._fp = fingerprint or weights_fingerprint(model)

    @classmethod
    def load(cls, base_dir: str, adapters: str | None = None, tokenizer=None, *, gguf_file: str | None = None,
             cache_dir: str | None = None) -> "MoneBackend":
        """``base_dir``: a checkpoint directory or a GGUF source (nbcore.backbones.gguf); a GGUF base
        has no ``<base_dir>/mone`` folder, so it needs ``adapters``."""
        from nbcore.backbones.gguf import is_gguf_source, is_pkg_source, resolve_checkpoint
        from nbcore.mone.backend_support import adapters_dir, model_fingerprint
        from nbcore.mone.model import MoNeModel
        if adapters is None and (is_gguf_source(base_dir, gguf_file) or is_pkg_source(base_dir)):
            raise ValueError(f"MoNe on {base_dir!r}: a GGUF / pkg: base has no <base>/mone folder; name the "
                             f"meta-trained MoNe parameters (mone_adapters)")
        base_dir = resolve_checkpoint(base_dir, gguf_file=gguf_file, cache_dir=cache_dir)
        ad = adapters_dir(base_dir, adapters)
        fp = model_fingerprint(base_dir, ad)
        model = MoNeModel.from_pretrained(base_dir, ad)
        if tokenizer is None:
            from nbcore.tasks.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(base_dir)
        return cls(model, tokenizer, fp)

    def fingerprint(self) -> str:
        return self._fp

    def describe(self) -> dict:
        return {"memory": self.name, "model": self._fp, "mone": dataclasses.asdict(self.model.cfg),
                "n_layers": int(self.model.n_layers)}

    def _tokenize(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ---- write ----------------------------------------------------------------------------------
    def _write(self, doc_id: str, prev, parts: list[dict], text: str) -> Memory:
        from nbcore.mone import state as mstate
        t0 = time.perf_counter()
        ids = self._tokenize(text)
        if not ids:
            raise ValueError("empty document (no tokens)")
        t1 = time.perf_counter()
        st = mstate.append(self.model, prev if prev is not None else mstate.new_state(self.model), ids)
        timings = {"tokenize_s": t1 - t0, "write_s": time.perf_counter() - t1}
        return Memory(self.name, doc_id, st, parts=list(parts) + [{"text_sha256": sha256_text(text),
                                                                   "n_tokens": len(ids)}], timings=timings)

    def ingest(self, doc_id: str, text: str) -> Memory:
        return self._write(doc_id, None, [], text)

    def append(self, memory: Memory, text: str) -> Memory:
        """Continue the document with ``text`` (tokenised on its own); ``memory`` is left unchanged."""
        from nbcore.mone.backend_support import check_state_fits
        _check_memory(self, memory)
        check_state_fits(self.model, memory.state, f"state of {memory.doc_id!r}")
        return self._write(memory.doc_id, memory.state, memory.parts, text)

    # ---- read -----------------------------------------------------------------------------------
    def _gen(self, read: dict) -> dict:
        unknown = sorted(set(read) - set(MONE_READ_KEYS))
        if unknown:
            raise ValueError(f"mone read config: unknown keys {unknown}; known: {list(MONE_READ_KEYS)}")
        if read.get("method", "mone") not in self.methods:
            raise ValueError(f"mone backend: method must be one of {self.methods}, got {read['method']!r}")
        gen = {k: v for k, v in read.items() if k != "method"}
        n = gen.get("max_new_tokens", ReadConfig.max_new_tokens)
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {n!r}")
        return gen

    def read_fields(self, read: dict) -> dict:
        gen = self._gen(read)
        # the JSON the old pipeline/mone_pipeline.py wrote (answers stay comparable)
        return {"method": "mone", "read_config": json.dumps(
            {"method": "mone", **{k: (list(v) if isinstance(v, tuple) else v) for k, v in gen.items()}},
            sort_keys=True)}

    def fast_weights(self, memory: Memory):
        """The fast weights queries read (``nbcore.mone.state.finalized``), computed once per memory."""
        from nbcore.mone import state as mstate
        _check_memory(self, memory)
        if "fast" not in memory.cache:
            memory.cache["fast"] = mstate.finalized(self.model, memory.state)
        return memory.cache["fast"]

    @torch.no_grad()
    def answer(self, memory: Memory, question: str, read: dict, answers: list[str] | None = None) -> dict:
        from nbcore.mone.backend_support import cut_at_stop
        gen = self._gen(read)
        fast = self.fast_weights(memory)
        t0 = time.perf_counter()
        ids = self._tokenize(question)
        n = int(gen.get("max_new_tokens", ReadConfig.max_new_tokens))
        eos = self.tokenizer.eos_token_id if gen.get("stop_at_eos", True) else None
        out = self.model.generate(ids, fast, n, eos) if n else []
        text = cut_at_stop(self.tokenizer.decode(out), gen.get("stop") or ())
        return _row(text, out, timings={"replay_generate_s": time.perf_counter() - t0})

    # ---- persist --------------------------------------------------------------------------------
    def to_files(self, memory: Memory) -> MemoryFiles:
        from nbcore.mone.backend_support import state_to_tensors
        _check_memory(self, memory)
        st = memory.state
        facts = {"backend": self.name, "doc_id": memory.doc_id, "model": self._fp, "n_tokens": int(st.n_tokens),
                 "n_segments": int(st.n_segments), "n_pending": len(st.pending),
                 "mone": dataclasses.asdict(self.model.cfg), "parts": [dict(p) for p in memory.parts],
                 "timings": dict(memory.timings)}
        return MemoryFiles({k: v.clone() for k, v in state_to_tensors(st).items()}, None, facts)

    def from_files(self, files: MemoryFiles) -> Memory:
        from nbcore.mone.backend_support import check_state_fits, state_from_tensors
        facts = _check_files(self, files)
        where = f"memory files of {facts.get('doc_id')!r}"
        st = state_from_tensors(files.tensors, where)
        check_state_fits(self.model, st, where)
        parts = [dict(p) for p in facts.get("parts") or [{"text_sha256": None, "n_tokens": st.n_tokens}]]
        return Memory(self.name, facts.get("doc_id"), st, parts=parts, timings=dict(facts.get("timings") or {}))


# ------------------------------------------------------------------------------------------------
# registry

BACKENDS: dict[str, type] = {"notebank": NoteBankBackend, "mone": MoneBackend}


def get_backend(name: str, **kwargs) -> MemoryBackend:
    """A backend by name. notebank: ``bb``, ``nb_cfg``, ``block_size``; mone: either ``model``,
    ``tokenizer``, ``fingerprint`` (a model in memory) or ``base_dir``, ``adapters``, ``tokenizer``
    [, ``gguf_file``, ``cache_dir``] (load from files, ``MoneBackend.load``)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown memory backend {name!r}; valid: {sorted(BACKENDS)}")
    cls = BACKENDS[name]
    if cls is MoneBackend and "base_dir" in kwargs:
        return MoneBackend.load(**kwargs)
    return cls(**kwargs)
