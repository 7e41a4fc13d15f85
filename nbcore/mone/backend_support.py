"""Pure-PyTorch pieces of the MoNe worker that the pipeline used to hold (the removed
pipeline/mone_pipeline.py), here so that ``nbcore.memory.MoneBackend`` needs nothing from pipeline/
(never imports ray). The pipeline's actors (pipeline/actors.py) use MoneBackend.

- ``files_digest`` / ``model_fingerprint`` / ``adapters_dir``: the same values the old pipeline
  functions of the same names gave (MoNe run fingerprints stay comparable);
- ``weights_fingerprint``: for a MoNeModel built in memory (no files);
- ``state_to_tensors`` / ``state_from_tensors``: a MoNeState as ONE flat tensor dict (fast weights,
  pending ids and the counters as int64 tensors), so that a generic safetensors writer can persist it
  without the ``mone-state/1`` metadata and a state file alone is enough to continue a document;
- ``cut_at_stop``: the stop-string rule of the MoNe answers.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from nbcore.mone import memory as mem
from nbcore.mone.state import MoNeState

COUNTERS = ("n_segments", "n_tokens", "segment_len")
COUNTER_PREFIX = "counters."


# ------------------------------------------------------------------------------------------------
# fingerprints

def files_digest(paths: list[Path]) -> str:
    """sha256 over (name, bytes) of the given files, in order (20 hex digits)."""
    h = hashlib.sha256()
    for p in paths:
        p = Path(p)
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:20]


def adapters_dir(model_path: str, adapters: str | None) -> str:
    """Where the meta-trained MoNe parameters live: ``adapters`` or ``<model_path>/mone``."""
    return adapters or os.path.join(model_path, "mone")


def model_fingerprint(base_dir: str, adapters_dir: str) -> str:
    """Digest of the frozen base (config + weights) and the meta-trained MoNe parameters."""
    base, ad = Path(base_dir), Path(adapters_dir)
    files = [base / "config.json", *sorted(base.glob("*.safetensors")), ad / "mone_config.json",
             ad / "mone_adapters.safetensors"]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"MoNe model files missing: {missing}")
    return files_digest(files)


def weights_fingerprint(model) -> str:
    """Digest of an in-memory MoNeModel: its MoNe config, then name, dtype, shape and bytes of every
    tensor of the base and of the MoNe parameters (sorted by name). Not equal to
    ``model_fingerprint`` of the files it may have come from (use that one when files exist)."""
    h = hashlib.sha256(json.dumps(asdict(model.cfg), sort_keys=True).encode())
    for prefix, module in (("base.", model.base), ("mone.", model.mone)):
        for name, t in sorted(module.state_dict().items()):
            t = t.detach().cpu().contiguous()
            h.update(f"{prefix}{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
            if t.numel():
                h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()[:20]


# ------------------------------------------------------------------------------------------------
# state <-> one flat tensor dict

def state_to_tensors(state: MoNeState) -> dict[str, torch.Tensor]:
    """``state.tensors()`` (``layers.<l>.<w_in|...|m_out>``, ``pending_ids``) plus the counters as
    int64 1-element tensors under ``counters.``: everything ``state_from_tensors`` needs."""
    out = {k: v.detach().cpu().contiguous() for k, v in state.tensors().items()}
    for name in COUNTERS:
        out[COUNTER_PREFIX + name] = torch.tensor([int(getattr(state, name))], dtype=torch.int64)
    return out


def state_from_tensors(tensors: dict[str, torch.Tensor], where: str = "MoNe state") -> MoNeState:
    """Inverse of ``state_to_tensors``; a clear ValueError when a tensor is missing."""
    missing = [COUNTER_PREFIX + n for n in COUNTERS if COUNTER_PREFIX + n not in tensors]
    if "pending_ids" not in tensors:
        missing.append("pending_ids")
    if missing:
        raise ValueError(f"{where}: not a MoNe state tensor dict (missing {missing})")
    layers = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.")})
    if layers != list(range(len(layers))):
        raise ValueError(f"{where}: layer indices {layers} are not 0..{len(layers) - 1}")
    meta = {"n_layers": len(layers), **{n: int(tensors[COUNTER_PREFIX + n].reshape(-1)[0]) for n in COUNTERS}}
    st = MoNeState._from_parts(tensors, meta, where)
    # own the tensors (the dict may be a view of a file or of another state)
    st.layers = [mem.FastWeights(**{k: v.clone() for k, v in fw.tensors().items()}) for fw in st.layers]
    return st


def check_state_fits(model, state: MoNeState, where: str = "MoNe state") -> None:
    """Same check as the pipeline worker's ``load_fast_weights``: layer count and segment length."""
    if len(state.layers) != model.n_layers or state.segment_len != model.cfg.segment_len:
        raise ValueError(f"{where}: state ({len(state.layers)} layers, T={state.segment_len}) does not "
                         f"fit this model ({model.n_layers} layers, T={model.cfg.segment_len})")


# ------------------------------------------------------------------------------------------------
# answers

def cut_at_stop(text: str, stop) -> str:
    """Text up to the first stop string (stop strings themselves removed)."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=len(text))
    return text[:cut]
