"""Per-document MoNe fast-weight state: a small fixed set of tensors, saved as safetensors, with
incremental ingest (appending tokens continues from a saved state).

The state holds, per decoder layer, W_in / W_gate / W_out and their momenta ([1, H, F, D] each:
6 x L tensors whose size does not depend on the document length), the token ids of the current
incomplete segment (< T tokens, so that an append continues exactly where the last one stopped:
ingesting A then B equals ingesting A+B at any split point), and counters.

Queries read ``finalized(model, state)``: the fast weights with the incomplete tail segment (if
any) written as a short segment, computed on a copy; the stored state is never changed by reads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nbcore.mone import memory as mem
from nbcore.mone.memory import FastWeights

FORMAT = "mone-state/1"


@dataclass
class MoNeState:
    layers: list[FastWeights]
    pending: list[int] = field(default_factory=list)
    n_segments: int = 0
    n_tokens: int = 0
    segment_len: int = 512

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for l, fw in enumerate(self.layers):
            for k, v in fw.tensors().items():
                out[f"layers.{l}.{k}"] = v.detach().contiguous()
        out["pending_ids"] = torch.tensor(self.pending, dtype=torch.int64)
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def meta(self, extra_meta: dict | None = None) -> dict:
        """Counters and format tag (JSON-able)."""
        return {"format": FORMAT, "n_layers": len(self.layers), "n_segments": self.n_segments,
                "n_tokens": self.n_tokens, "segment_len": self.segment_len, "extra": extra_meta or {}}

    def to_bytes(self, extra_meta: dict | None = None) -> bytes:
        """Deterministic safetensors bytes (ONE metadata key holding sorted JSON: safetensors writes
        several metadata keys in hash order, which would make the bytes vary run to run)."""
        from safetensors.torch import save
        return save(self.tensors(), metadata={"mone": json.dumps(self.meta(extra_meta), sort_keys=True)})

    def save(self, path: str | Path, extra_meta: dict | None = None) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(self.to_bytes(extra_meta))
        return p

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "MoNe state") -> "MoNeState":
        """Inverse of ``to_bytes``; a clear ValueError for anything that is not a MoNe state."""
        from safetensors.torch import load
        try:
            meta = json.loads(safetensors_metadata(data).get("mone", "{}"))
            tensors = load(data)
        except Exception as e:  # noqa: BLE001 - truncated/corrupted bytes of any kind
            raise ValueError(f"{where}: not a readable safetensors file ({type(e).__name__}: {e})") from e
        if meta.get("format") != FORMAT:
            raise ValueError(f"{where}: not a {FORMAT} file (format={meta.get('format')!r})")
        return cls._from_parts(tensors, meta, where)

    @classmethod
    def _from_parts(cls, tensors: dict, meta: dict, where: str) -> "MoNeState":
        n_layers = int(meta["n_layers"])
        try:
            layers = [FastWeights(**{k: tensors[f"layers.{l}.{k}"] for k in mem.WEIGHTS + mem.MOMENTA})
                      for l in range(n_layers)]
        except KeyError as e:
            raise ValueError(f"{where}: missing tensor {e.args[0]!r}") from e
        return cls(layers=layers, pending=tensors["pending_ids"].tolist(), n_segments=int(meta["n_segments"]),
                   n_tokens=int(meta["n_tokens"]), segment_len=int(meta["segment_len"]))

    @classmethod
    def load(cls, path: str | Path) -> "MoNeState":
        return cls.from_bytes(Path(path).read_bytes(), str(path))


def safetensors_metadata(data: bytes) -> dict:
    """The ``__metadata__`` map of safetensors bytes (header only)."""
    if len(data) < 8:
        raise ValueError("shorter than the 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise ValueError(f"header length {n} exceeds the size {len(data)}")
    return json.loads(data[8:8 + n]).get("__metadata__", {}) or {}


def new_state(model) -> MoNeState:
    return MoNeState(layers=model.fresh(1), segment_len=model.cfg.segment_len)


@torch.no_grad()
def append(model, state: MoNeState, ids: list[int]) -> MoNeState:
    """Write ``ids`` after what ``state`` already holds (returns a new state; input unchanged).
    Complete segments are written ``model.cfg.write_batch`` at a time (frozen forward batched over
    segments, fast-weight updates sequential), so peak memory does not grow with the document."""
    T = state.segment_len
    if T != model.cfg.segment_len:
        raise ValueError(f"state segment_len {T} != model segment_len {model.cfg.segment_len}")
    buf = list(state.pending) + list(ids)
    n_full = len(buf) // T
    layers = state.layers
    wb = max(1, model.cfg.write_batch)
    for s0 in range(0, n_full, wb):
        s1 = min(n_full, s0 + wb)
        seg = torch.tensor(buf[s0 * T:s1 * T], device=model.device).view(1, s1 - s0, T)
        layers = model.write(layers, seg, torch.ones_like(seg, dtype=torch.bool))
    return MoNeState(layers=[fw.detach() for fw in layers], pending=buf[n_full * T:],
                     n_segments=state.n_segments + n_full, n_tokens=state.n_tokens + len(ids),
                     segment_len=T)


def ingest(model, ids: list[int], state: MoNeState | None = None) -> MoNeState:
    return append(model, state if state is not None else new_state(model), ids)


@torch.no_grad()
def finalized(model, state: MoNeState) -> list[FastWeights]:
    """Fast weights to read from: the state with its incomplete tail written as a short segment."""
    if not state.pending:
        return state.layers
    seg = torch.tensor(state.pending, device=model.device).view(1, 1, -1)
    return model.write(state.layers, seg, torch.ones_like(seg, dtype=torch.bool))
