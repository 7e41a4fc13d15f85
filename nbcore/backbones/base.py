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
        # Cheap, deterministic digest of the weights (a few values from every tensor), so that two
        # random-init models of the same config do not share archives.
        h = hashlib.sha256()
        for name, p in sorted(model.state_dict().items()):
            if "lora_" in name:            # read adapters never touch what the archive depends on
                continue
            name = name.replace(".base_layer.", ".")
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 16)][:16].float().cpu().numpy().tobytes()
            h.update(name.encode())
            h.update(sample)
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
