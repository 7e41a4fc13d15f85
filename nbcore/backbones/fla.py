"""flash-linear-attention `GatedDeltaNetForCausalLM` (e.g. m-a-p/1.3B-100B-GatedDeltaNet-pure).

GPU only: fla's kernels are Triton. Importing this module never imports fla; building the
adapter does, and fails with a clear message without it.

fla's GDN layer has separate q/k/v projections and `q_conv1d`/`k_conv1d`/`v_conv1d`
ShortConvolutions (kernel 4, SiLU) whose outputs are the native q/k (the kernel L2-normalises them
afterwards). With `use_cache=True` the convs are called as modules, so forward hooks on
`q_conv1d`/`k_conv1d` see exactly the features the kernel receives. Cache: fla's `Cache` holds one
dict per layer with `recurrent_state` [B, H, d_k, d_v], `conv_state` (q, k, v) and `attn_state`.
"""
from __future__ import annotations

import contextlib

import torch

from nbcore.backbones.base import Backbone, BackboneState, FeatureTap


def fla_gdn_channels(config: dict) -> tuple[int, int, int]:
    """(J, heads per layer, d_k) of an fla gated_deltanet config dict (no fla needed).
    GDN-1.3B: 24 layers x 8 heads, head_dim 256 -> (192, 8, 256)."""
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_heads"])
    head_dim = config.get("head_dim")
    if head_dim is None:                       # older configs: expand_k * hidden / heads
        head_dim = int(config["hidden_size"] * config.get("expand_k", 1) // heads)
    attn = config.get("attn") or {}
    n_attn = len(attn.get("layers", [])) if isinstance(attn, dict) else 0
    return (layers - n_attn) * heads, heads, int(head_dim)


def _layer_states(cache) -> list:
    """The per-layer state dicts of an fla Cache (two layouts across fla versions)."""
    if hasattr(cache, "states"):
        return list(cache.states)
    return [getattr(l, "state", l) for l in getattr(cache, "layers", [])]


class _ConvTap:
    def __init__(self, mixers, tap: FeatureTap):
        self.mixers, self.tap, self.hooks, self.pending = mixers, tap, [], {}

    def __enter__(self):
        for i, m in enumerate(self.mixers):
            self.hooks.append(m.q_conv1d.register_forward_hook(
                lambda mod, a, out, _i=i: self.pending.__setitem__(_i, out[0] if isinstance(out, tuple) else out)))
            self.hooks.append(m.k_conv1d.register_forward_hook(
                lambda mod, a, out, _i=i, _m=m: self._emit(_i, _m, out[0] if isinstance(out, tuple) else out)))
        return self

    def _emit(self, i, m, k):
        q = self.pending.pop(i)                                       # [B, T, H*d]
        H, d = m.num_heads, m.head_k_dim
        self.tap.on_layer(i, q[0].float().reshape(-1, H, d), k[0].float().reshape(-1, H, d))

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return False


class FlaGDNBackbone(Backbone):
    family = "fla-gdn"

    def __init__(self, model, tokenizer=None):
        try:
            import fla  # noqa: F401
        except ImportError as e:  # pragma: no cover - CPU machines
            raise ImportError("fla-gdn backbones need flash-linear-attention and a CUDA GPU: "
                              "pip install -e '.[gpu]'") from e
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        J, self.heads_per_layer, self.key_dim = fla_gdn_channels(model.config.to_dict())
        self._mixers = [blk.attn for blk in model.model.layers if hasattr(blk.attn, "q_conv1d")]
        self.rec_layers = [i for i, blk in enumerate(model.model.layers) if hasattr(blk.attn, "q_conv1d")]
        assert len(self._mixers) * self.heads_per_layer == J

    def new_state(self) -> BackboneState:
        return BackboneState(cache=None, n_tokens=0)

    def reset_state(self, state, lam):
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {lam}")
        if state.cache is None:
            return
        for st in _layer_states(state.cache):
            if isinstance(st, dict) and st.get("recurrent_state") is not None:
                st["recurrent_state"].mul_(lam)

    def state_to_tensors(self, state):
        out = {"n_tokens": torch.tensor([state.n_tokens], dtype=torch.int64)}
        if state.cache is None:
            return out
        for i, st in enumerate(_layer_states(state.cache)):
            if st.get("recurrent_state") is not None:
                out[f"layers.{i}.recurrent.0"] = st["recurrent_state"].contiguous()
            for n, c in zip("qkv", st.get("conv_state") or ()):
                if c is not None:
                    out[f"layers.{i}.conv.{n}"] = c.contiguous()
            attn = st.get("attn_state")
            if attn is not None:
                for n, t in zip(("keys", "values"), attn[:2]):
                    out[f"layers.{i}.{n}"] = t.contiguous()
        return out

    def state_from_tensors(self, tensors):
        # Rebuild by running zero tokens is not possible; construct the cache from the first
        # token of a dummy pass, then overwrite every tensor (layouts are the model's own).
        state = self.new_state()
        self.forward(state, torch.zeros(1, dtype=torch.long), need_logits=False)
        for i, st in enumerate(_layer_states(state.cache)):
            if f"layers.{i}.recurrent.0" in tensors:
                st["recurrent_state"].copy_(tensors[f"layers.{i}.recurrent.0"])
            if st.get("conv_state") is not None:
                st["conv_state"] = tuple(tensors[f"layers.{i}.conv.{n}"].to(self.device) for n in "qkv")
            if f"layers.{i}.keys" in tensors:
                st["attn_state"] = (tensors[f"layers.{i}.keys"].to(self.device),
                                    tensors[f"layers.{i}.values"].to(self.device))
        n = int(tensors["n_tokens"][0])
        state.n_tokens = n
        if hasattr(state.cache, "_seen_tokens"):
            state.cache._seen_tokens = n
        return state

    @torch.no_grad()
    def forward(self, state, ids, tap=None, need_logits=True):
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"ids must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
        ctx = _ConvTap(self._mixers, tap) if tap else contextlib.nullcontext()
        with ctx, self._adapter_ctx():
            out = self.model(input_ids=ids.to(self.device)[None], past_key_values=state.cache,
                             use_cache=True, logits_to_keep=1)
        state.cache = out.past_key_values
        state.n_tokens += int(ids.numel())
        return out.logits[0, -1].float() if need_logits else None
