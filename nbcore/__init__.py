"""nbcore: NoteBank (and MoNe) in pure PyTorch. Never imports ray.

Public surface (what pipeline/ and jobs/ use):

    from nbcore import load_backbone, ingest, answer, NoteBankConfig, ReadConfig, Archive

    bb = load_backbone("models/tiny-gdn")            # or a transformers config object
    res = ingest(bb, text, NoteBankConfig())          # -> IngestResult(state, archive, n_tokens, timings, carry)
    res2 = append(bb, res.state, res.archive, res.carry, more_text)   # == ingest(bb, parts=[text, more_text])
    ans = answer(bb, res.state, res.archive, question, ReadConfig(method="notebank", top_r=2))
    ans.text, ans.retrieved, ans.votes, ans.replay_len, ans.timings

    tensors = bb.state_to_tensors(res.state)          # dict[str, Tensor] for safetensors
    state = bb.state_from_tensors(tensors)

    from nbcore import get_backend                     # one interface for both memories (nbcore.memory)
    backend = get_backend("notebank", bb=bb, nb_cfg=NoteBankConfig(), block_size=8192)
    mem = backend.ingest("doc", text); files = backend.to_files(mem); row = backend.answer(mem, q, {})

    arc = open_archive("out/archive", model="models/tiny-gdn")   # an ingest job's output, in a notebook
    arc.documents(); arc.notes("doc-0"); arc.ask("doc-0", "What is ...?").answer
"""
from typing import TYPE_CHECKING

from nbcore.config import NoteBankConfig, ReadConfig

if TYPE_CHECKING:   # the lazy names below, visible to static tools (go-to-definition) without importing them
    from nbcore.backbones import load_backbone
    from nbcore.memory import (BACKENDS, Memory, MemoryBackend, MemoryFiles, MemoryMismatch, MoneBackend,
                               NoteBankBackend, get_backend)
    from nbcore.notebank.write import WriterCarry
    from nbcore.reader import Answer, IngestResult, answer, append, encode_parts, ingest
    from notebank.pipeline.notebook import open_archive

__all__ = ["NoteBankConfig", "ReadConfig", "Archive", "load_backbone", "ingest", "append", "answer", "open_archive"]

# one memory-backend interface for the pipeline's worker (nbcore/memory.py)
_MEMORY_NAMES = ("MemoryBackend", "Memory", "MemoryFiles", "MemoryMismatch", "NoteBankBackend", "MoneBackend",
                 "BACKENDS", "get_backend")
__all__ += list(_MEMORY_NAMES)


def __getattr__(name):
    # Lazy: importing nbcore must stay cheap (transformers is heavy).
    if name == "load_backbone":
        from nbcore.backbones import load_backbone
        return load_backbone
    if name in ("ingest", "append", "encode_parts", "answer", "IngestResult", "Answer"):
        from nbcore import reader
        return getattr(reader, name)
    if name in _MEMORY_NAMES:
        from nbcore import memory
        return getattr(memory, name)
    if name == "open_archive":
        # An ingest output in a notebook (reads the pipeline's on-disk layout; no Ray). The one
        # nbcore name that reaches into pipeline/, lazily, so `import nbcore` stays pure PyTorch.
        from notebank.pipeline.notebook import open_archive
        return open_archive
    if name == "Archive":              # lazy too: configs are checked before torch is imported
        from nbcore.notebank.archive import Archive
        return Archive
    if name == "WriterCarry":
        from nbcore.notebank.write import WriterCarry
        return WriterCarry
    raise AttributeError(name)
