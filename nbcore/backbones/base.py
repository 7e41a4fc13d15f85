"""The backbone adapter protocol: what NoteBank needs from a frozen recurrent/hybrid LM.

Every adapter wraps a real model class (transformers or fla) and exposes:
  - a state (recurrent states, conv caches, attention KV for hybrids, a token counter),
  - `forward(state, ids, tap=...)` that advances the state in place and can capture native
    per-channel key/query features of the processed tokens,
  - `copy_state`, `reset_state(lam)` (App. C.3), greedy generation continuing from a state,
  - safetensors-friendly (de)serialisation of the state.

One tensor layout is used for features everywhere: `[T, J, d]` (tokens, channels, feature dim),
channels ordered (recurrent layer, head/group) as the model stacks them.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


def _tensor_sha256(t: torch.Tensor) -> bytes:
    """sha256 of a tensor's raw bytes in row-major order, without a copy for contiguous CPU tensors."""
    if t.device.type != "cpu":
        t = t.cpu()                      # one tensor at a time (GPU backbones)
    if not t.is_contiguous():
        t = t.contiguous()
    h = hashlib.sha256()
    if t.numel():
        # reshape(-1) is a view of a contiguous tensor; viewing as uint8 works for every dtype
        # (numpy has no bfloat16) and numpy() shares the memory.
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.digest()


@dataclass
class BackboneState:
    """Retained inference state S_t. `cache` is the model's cache object; `n_tokens` counts every
    token processed so far, so positions of the next token continue from here (App. B.4)."""

    cache: object
    n_tokens: int = 0


class FeatureTap:
    """Receives native (query, key) features layer by layer during a forward pass.

    `on_layer(rec_idx, q, k)` is called once per recurrent layer per kernel call with
    q, k: [T, H, d] (batch 0, fp32). Subclasses reduce them on the fly so that no O(T·J·d)
    tensor survives the forward (see notebank.features.ChunkReducer)."""

    def on_layer(self, rec_idx: int, q: torch.Tensor, k: torch.Tensor) -> None:  # pragma: no cover
        raise NotImplementedError


class RawTap(FeatureTap):
    """Keeps full q/k per layer. Reference/testing only: memory is O(T·J·d)."""

    def __init__(self, n_layers: int):
        self.q: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        self.k: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]

    def on_layer(self, rec_idx, q, k):
        self.q[rec_idx].append(q.detach().float().clone())
        self.k[rec_idx].append(k.detach().float().clone())

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (q, k), each [T, J, d]."""
        q = torch.cat([torch.cat(parts, 0) for parts in self.q], dim=1)
        k = torch.cat([torch.cat(parts, 0) for parts in self.k], dim=1)
        return q, k


class Backbone:
    """Base adapter. Subclasses set: family, model, tokenizer, rec_layers (model layer indices of the
    recurrent layers that supply channels), heads_per_layer, key_dim."""

    family: str = "?"
    model: torch.nn.Module
    tokenizer: object | None
    rec_layers: list[int]
    heads_per_layer: int
    key_dim: int

    # ---- read adapters (App. B.4) -----------------------------------------------------------
    # Optional LoRA readers are OFF for context processing and retrieval and ON for replay,
    # question processing and generation. `nbcore.lora` attaches them; `reading()` turns them on.
    _read_mode: bool = False

    @property
    def has_adapter(self) -> bool:
        return hasattr(self.model, "disable_adapter") and hasattr(self.model, "peft_config")

    @contextlib.contextmanager
    def reading(self):
        """Adapters enabled inside this block (no-op without adapters)."""
        prev, self._read_mode = self._read_mode, True
        try:
            yield
        finally:
            self._read_mode = prev

    def _adapter_ctx(self):
        if self.has_adapter and not self._read_mode:
            return self.model.disable_adapter()
        return contextlib.nullcontext()

    # ---- channels -------------------------------------------------------------------------
    @property
    def n_channels(self) -> int:
        """J = |L x H|: indexed recurrent layer-head (or layer-group) channels."""
        return len(self.rec_layers) * self.heads_per_layer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def fingerprint(self) -> str:
        """Hash of the model config, weights and channel layout (an archive is only valid for it).
        Cached: the backbone is frozen (read adapters do not count: they are off while writing)."""
        fp = self.__dict__.get("_fingerprint")
        if fp is None:
            fp = self.__dict__["_fingerprint"] = self._compute_fingerprint()
        return fp

    def _compute_fingerprint(self) -> str:
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        cfg = model.config.to_dict()
        for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures"):
            cfg.pop(k, None)
        blob = json.dumps(
            {"family": self.family, "config": cfg, "rec_layers": self.rec_layers,
             "heads": self.heads_per_layer, "key_dim": self.key_dim,
             "weights": self._weights_digest(model)},
            sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    @staticmethod
    def _weights_digest(model) -> str:
        """sha256 over every base tensor in full: per tensor (sorted by name) its name, dtype, shape
        and a sha256 of its raw bytes, so that changing any single weight element changes the
        fingerprint (the former scheme hashed 16 sampled values per tensor and missed almost every
        change). Read adapters (`lora_` tensors) are skipped and peft's `.base_layer.` rename is
        undone, so attaching adapters never changes the value. Tensors that share storage (tied
        embeddings) are hashed once. The dtype is part of the digest: the same checkpoint loaded in
        bfloat16 and in float32 gets two fingerprints (its archives differ numerically too).

        Bytes are read in place (a uint8 view of the contiguous CPU tensor through numpy; bfloat16
        is fine, the view is dtype-agnostic); only non-contiguous or non-CPU tensors are copied, one
        tensor at a time, so peak extra memory is one tensor, never the whole model.

        Cost, measured on a shared 2-core CPU box (torch 2.13 CPU, hashlib sha256 at ~1.8 GB/s, one
        core): a GDN-1.3B-sized random tensor set (1.30e9 bf16 params, 2.6 GB, 24 layers + untied
        32000 x 2048 embedding/head) digests in 1.6-1.8 s with no extra memory (peak RSS 2.8 GB,
        i.e. the weights themselves); fp32 weights take twice as long (bytes-bound). GPU weights add
        one device-to-host copy per tensor.
        Computed once per backbone (`fingerprint()` caches it).
        """
        h = hashlib.sha256()
        seen: dict[tuple, bytes] = {}
        for name, p in sorted(model.state_dict().items()):
            if "lora_" in name:            # read adapters never touch what the archive depends on
                continue
            name = name.replace(".base_layer.", ".")
            t = p.detach()
            h.update(name.encode())
            h.update(b"\0" + str(t.dtype).encode() + b"\0" + json.dumps(list(t.shape)).encode() + b"\0")
            alias = (t.device.type, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) if t.numel() else None
            digest = seen.get(alias) if alias is not None else None
            if digest is None:
                digest = _tensor_sha256(t)
                if alias is not None:
                    seen[alias] = digest
            h.update(digest)
        return h.hexdigest()[:16]

    # ---- state ----------------------------------------------------------------------------
    def new_state(self) -> BackboneState:
        raise NotImplementedError

    def copy_state(self, state: BackboneState) -> BackboneState:
        """Independent deep copy (recurrent + conv states, attention KV, position)."""
        return copy.deepcopy(state)

    def reset_state(self, state: BackboneState, lam: float) -> None:
        """S <- lam * S for every recurrent state (App. C.3); conv caches, attention KV and the
        position counter are kept. lam=1 is a no-op, lam=0 the clean start."""
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {lam}")
        for layer in getattr(state.cache, "layers", []):
            rec = getattr(layer, "recurrent_states", None)
            if not rec:
                continue
            for i, t in rec.items():
                if t is not None:
                    t.mul_(lam)

    def state_to_tensors(self, state: BackboneState) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def state_from_tensors(self, tensors: dict[str, torch.Tensor]) -> BackboneState:
        raise NotImplementedError

    # ---- compute --------------------------------------------------------------------------
    def forward(self, state: BackboneState, ids: torch.Tensor, tap: FeatureTap | None = None,
                need_logits: bool = True) -> torch.Tensor | None:
        """Advance `state` in place over ids [T] (int64). Returns logits of the last position [V]
        (fp32) or None. If `tap` is given, native q/k features of these tokens are passed to it."""
        raise NotImplementedError

    @torch.no_grad()
    def generate(self, state: BackboneState, first_logits: torch.Tensor, max_new_tokens: int,
                 stop: Sequence[str] = (), stop_at_eos: bool = True) -> list[int]:
        """Greedy decoding from `state` (mutated). `first_logits` [V] are the logits after the
        last prompt token. Stops at EOS (not included) or when a stop string appears in the
        decoded text (the text is cut there by the caller via `decode_until_stop`)."""
        out: list[int] = []
        logits = first_logits
        eos = self.eos_token_ids() if stop_at_eos else set()
        for step in range(max_new_tokens):
            tok = int(torch.argmax(logits).item())
            if tok in eos:
                break
            out.append(tok)
            if stop and self.tokenizer is not None:
                text = self.tokenizer.decode(out)
                if any(s in text for s in stop):
                    break
            if step + 1 == max_new_tokens:
                break
            logits = self.forward(state, torch.tensor([tok], dtype=torch.long))
        return out

    def eos_token_ids(self) -> set[int]:
        ids = set()
        cfg_eos = getattr(self.model.config, "eos_token_id", None)
        if isinstance(cfg_eos, int):
            ids.add(cfg_eos)
        elif isinstance(cfg_eos, (list, tuple)):
            ids.update(int(x) for x in cfg_eos)
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids
