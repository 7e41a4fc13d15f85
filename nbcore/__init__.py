"""nbcore: NoteBank (and MoNe) in pure PyTorch. Never imports ray.

Public surface (what pipeline/ and jobs/ use):

    from nbcore import load_backbone, ingest, answer, NoteBankConfig, ReadConfig, Archive

    bb = load_backbone("models/tiny-gdn")            # or a transformers config object
    res = ingest(bb, text, NoteBankConfig())          # -> IngestResult(state, archive, n_tokens, timings)
    ans = answer(bb, res.state, res.archive, question, ReadConfig(method="notebank", top_r=2))
    ans.text, ans.retrieved, ans.votes, ans.replay_len, ans.timings

    tensors = bb.state_to_tensors(res.state)          # dict[str, Tensor] for safetensors
    state = bb.state_from_tensors(tensors)
"""
from nbcore.config import NoteBankConfig, ReadConfig
from nbcore.notebank.archive import Archive

__all__ = ["NoteBankConfig", "ReadConfig", "Archive", "load_backbone", "ingest", "answer"]


def __getattr__(name):
    # Lazy: importing nbcore must stay cheap (transformers is heavy).
    if name == "load_backbone":
        from nbcore.backbones import load_backbone
        return load_backbone
    if name in ("ingest", "answer", "IngestResult", "Answer"):
        from nbcore import reader
        return getattr(reader, name)
    raise AttributeError(name)
