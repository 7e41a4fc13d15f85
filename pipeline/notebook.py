"""An ingest output, opened in a notebook: list documents, read their notes, ask a question.

    import nbcore
    arc = nbcore.open_archive("out/archive", model="models/tiny-gdn")
    arc.documents()[:3]                      # [{"doc_id", "n_tokens", "n_notes", "generation", "source"}, ...]
    arc.notes("doc-0")[0]["text"]            # decoded note text (and token ids, span, chunk)
    arc.ask("doc-0", "What is the special magic number?").answer

No Ray: this reads the archive (pipeline/archive.py, layout 2) with pyarrow and fsspec in this
process, and answers with the same memory backend the query job's actors use (nbcore.memory). The
model is loaded on the first `ask` only; it must be the one that wrote the archive (the state's
model fingerprint is checked).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from nbcore.config import NoteBankConfig


@dataclass
class AskResult:
    """One answer: the text, the notes replayed (indices into `notes(doc_id)`) and the votes."""

    answer: str
    retrieved: list[int]
    votes: list[float]
    replay_len: int
    row: dict = field(repr=False)         # the full answer row (token ids, timings, ...)


class OpenArchive:
    def __init__(self, url: str, model: str | dict | None = None, device: str = "cpu", verbose: bool = False):
        self.verbose = verbose
        from notebank.pipeline.archive import Archive
        from notebank.pipeline.dataplane import committed_documents, held_memory
        self.store = Archive(url)
        self.store.check_layout()
        run = self.store.read_run()
        if run is None:
            raise FileNotFoundError(f"{url}: not an ingest output (no manifest/_run.json)")
        self.fingerprint = run["fingerprint"]
        self.memory = held_memory(run)
        _, self._docs, self.problems = committed_documents(self.store, verify=False, repair=False)
        self._model = ({"path": model, "device": device} if isinstance(model, str) else model)
        self._mem = None

    def __repr__(self) -> str:
        return f"OpenArchive({self.store.url!r}, {len(self._docs)} documents, memory={self.memory})"

    def documents(self) -> list[dict]:
        """Committed documents, sorted by doc_id."""
        out = []
        for doc_id in sorted(self._docs):
            d = self._docs[doc_id]
            if "damaged" in d:
                out.append({"doc_id": doc_id, "damaged": d["damaged"]})
                continue
            out.append({"doc_id": doc_id, "n_tokens": d["n_tokens"], "generation": d["generation"],
                        "n_notes_files": len(d["notes_files"]), "source": d["source"]})
        return out

    def _doc(self, doc_id: str) -> dict:
        d = self._docs.get(doc_id)
        if d is None:
            raise KeyError(f"document {doc_id!r} is not in {self.store.url} "
                           f"({len(self._docs)} documents; see .documents())")
        if "damaged" in d:
            raise ValueError(d["damaged"])
        return d

    def notes(self, doc_id: str) -> list[dict]:
        """The document's live notes in archive order: note_index, chunk_index, start, end, text, token_ids."""
        from notebank.pipeline.actors import note_dicts
        d = self._doc(doc_id)
        if not d["notes_files"]:
            return []
        rows = note_dicts(self.store.read_notes(doc_id, d["notes_files"], d["generation"]))
        for r in rows:
            r.pop("addresses")
        return rows

    def ask(self, doc_id: str, question: str, method: str = "notebank", **read) -> AskResult:
        """Answer `question` from the document's memory (ReadConfig keys in `read`, e.g. top_r=2,
        router="bm25", lam=0.0, max_new_tokens=32). The defaults are the best measured read
        (router embmax_centered, reset past 32K tokens); preset="paper" gives the paper's."""
        if "preset" in read:
            from notebank.pipeline.config import READ_PRESETS
            preset = read.pop("preset")
            if preset not in READ_PRESETS:
                raise ValueError(f"preset must be one of {sorted(READ_PRESETS)}, got {preset!r}")
            read = {**read, **READ_PRESETS[preset]}
        mem = self._memory()
        d = self._doc(doc_id)
        memory = mem.load_memory(self.store, doc_id, d)
        row = mem.backend.answer(memory, question, {**read, "method": method})
        return AskResult(answer=row["answer"], retrieved=list(row.get("retrieved") or []),
                         votes=list(row.get("votes") or []), replay_len=int(row.get("replay_len") or 0), row=row)

    def _memory(self):
        if self._mem is None:
            if self._model is None:
                raise ValueError("open_archive(url, model=...) is needed to answer: the checkpoint directory that "
                                 "wrote the archive (e.g. models/tiny-gdn)")
            from notebank.pipeline.actors import MemoryLoader
            if not self.verbose:
                from notebank.pipeline.quiet import quiet_in_process
                quiet_in_process()
            nb = self.fingerprint.get("notebank")
            nb = json.loads(nb) if isinstance(nb, str) else (nb or NoteBankConfig().to_dict())
            self._mem = MemoryLoader(self._model, self.memory, nb, 8192, None, 0)
        return self._mem


def open_archive(url: str, model: str | dict | None = None, device: str = "cpu",
                 verbose: bool = False) -> OpenArchive:
    """Open an ingest output folder (local path or fsspec URL). `model`: the checkpoint dir (or a
    ModelSpec dict) that wrote it, needed only to `ask`. verbose: keep transformers' kernel-fallback
    notices and weight-loading bars (filtered by default)."""
    return OpenArchive(url, model, device, verbose)
