"""Adapters for transformers' recurrent and hybrid models.

- GDN: `qwen3_5` (text) and `qwen3_next`, pure (all `linear_attention` layers) or hybrid (3:1
  GDN:attention). Channels = (GDN layer, key head); query/key = native q/k after short conv + SiLU,
  before the kernel's L2 norm (which does not change cosines).
- Mamba-2: `mamba2`. Channels = (layer, B/C group); C plays the query, B the key.

Capture: transformers applies the conv functionally, so hooks on `conv1d` never fire and hooks on
input projections see pre-conv values. We instead wrap the modeling module's kernel entry points
(`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`, `mamba2_chunk_scan` /
`mamba2_selective_state_update`) for the duration of one forward, and a forward pre-hook on each
mixer records which layer is calling. The names resolve to fla / mamba-ssm kernels on GPU when
those are installed, so the same capture works there. `tests/test_backbones.py` checks the
captured features against an independent recomputation from the layer's own weights.

On CPU, `forward` first puts `nbcore.kernels`' faster pure-torch kernels on the modeling module
(chunked delta rule, short conv, Mamba-2 chunk scan; same results to float rounding), then the tap
wraps them, so captured q/k are the same tensors either way. `NB_FAST_KERNELS=0` or
`nbcore.kernels.reference_kernels()` runs transformers' reference functions instead.
"""
from __future__ import annotations

import contextlib
import importlib

import torch
from transformers import DynamicCache

from nbcore.backbones.base import Backbone, BackboneState, FeatureTap
from nbcore.kernels import fast_kernels_enabled, installed as fast_kernels


class CountingCache(DynamicCache):
    """DynamicCache that counts processed tokens itself.

    The position of the next token is ours, not transformers': its `get_seq_length` has changed
    meaning across releases (5.2x before 5.25 looked up the first attention layer and raised on
    pure-recurrent configs; 5.25 reads layer 0, which in a hybrid is a linear layer with its own
    token counter). `n_seen` is set by the backbone after every forward and on restore, so
    positions are the same on every supported release, pure or hybrid."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.n_seen = 0

    def _has_attention(self) -> bool:
        from transformers.cache_utils import CacheLayerMixin
        return any(isinstance(l, CacheLayerMixin) for l in self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.n_seen

    def sync_linear_counters(self) -> None:
        """Set transformers' per-linear-layer token counter (5.25+: `cumulative_length_linear`) to
        `n_seen`, so that its own bookkeeping (crop, layer-level `get_seq_length`) agrees."""
        for layer in self.layers:
            c = getattr(layer, "cumulative_length_linear", None)
            if isinstance(c, torch.Tensor):
                c.fill_(self.n_seen)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        """transformers' conv-state update; on the fast CPU path, a carried-state prefill block
        concatenates [cached conv state | new inputs] time-major, i.e. in the layout of the
        mixer's projection ([B, T, D] buffer seen as [B, D, T]), instead of `torch.cat`'s
        channel-major copy: a straight copy rather than a transposing one, and the short conv and
        the delta rule then read time-major inputs. Same values, same cached state."""
        from transformers.cache_utils import LinearAttentionLayer
        layer = self.layers[layer_idx]
        if (type(layer) is LinearAttentionLayer and layer.has_previous_state[state_idx] and not layer.record_past
                and conv_states.dim() == 3 and not torch.is_grad_enabled()
                and fast_kernels_enabled(conv_states.device)):
            prev = layer.conv_states[state_idx]                       # [B, D, K]
            B, D, T = conv_states.shape
            K = prev.shape[-1]
            full = torch.empty((B, K + T, D), dtype=prev.dtype, device=prev.device).transpose(1, 2)
            full[..., :K].copy_(prev)
            full[..., K:].copy_(conv_states)
            prev.copy_(full[..., -layer.conv_kernel_size[state_idx]:])
            counter = getattr(layer, "cumulative_length_linear", None)    # what the parent would count
            if state_idx == 0 and isinstance(counter, torch.Tensor):
                counter.add_(T)
            return full
        return super().update_conv_state(conv_states, layer_idx, state_idx=state_idx, **kwargs)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if self._has_attention():
            return super().get_mask_sizes(query_length, layer_idx)
        # No attention layer reads a mask over past keys: report only the current block, so the
        # mask transformers builds is [block, block], not [block, T] (which grew with the document).
        return query_length, self.n_seen


class _KernelTap:
    """Context manager wrapping module-level kernel functions to pass (q, k) to a FeatureTap."""

    def __init__(self, module, wrappers: dict, mixers: list[torch.nn.Module], tap: FeatureTap):
        self.module = module
        self.wrappers = wrappers          # name -> fn(orig, tap_fn) -> wrapped
        self.mixers = mixers
        self.tap = tap
        self.current = None
        self._saved = {}
        self._hooks = []

    def emit(self, q: torch.Tensor, k: torch.Tensor):
        # q, k: [B, T, H, d] -> batch 0, [T, H, d]
        self.tap.on_layer(self.current, q[0].detach().float(), k[0].detach().float())

    def __enter__(self):
        for rec_idx, mixer in enumerate(self.mixers):
            def pre_hook(mod, args, kwargs, _i=rec_idx):
                self.current = _i
            self._hooks.append(mixer.register_forward_pre_hook(pre_hook, with_kwargs=True))
        for name, make in self.wrappers.items():
            orig = getattr(self.module, name)
            self._saved[name] = orig
            setattr(self.module, name, make(orig, self))
        return self

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(self.module, name, orig)
        for h in self._hooks:
            h.remove()
        return False


def _gdn_wrap(orig, tap: _KernelTap):
    # A kernel that takes a `feature_sink` (nbcore.kernels.gdn_cpu) hands the tap its own
    # chunk-major copies of q/k, segment by segment: the capture then reads cache-resident copies
    # instead of strided views of the fused projection (about 3x cheaper on CPU).
    from nbcore.kernels import gdn_cpu
    sinkable = getattr(orig, "accepts_feature_sink", False) and hasattr(tap.tap, "on_segment")

    def wrapped(query, key, *args, **kwargs):
        layer = tap.current
        if (sinkable and query.shape[0] == 1 and kwargs.get("chunk_size", gdn_cpu.CHUNK) == gdn_cpu.CHUNK
                and tap.tap.accepts_segments(layer, gdn_cpu.CHUNK, gdn_cpu.SEGMENT)):
            kwargs["feature_sink"] = lambda a, t, q, k: tap.tap.on_segment(layer, a, t, q, k)
            kwargs["segment"] = gdn_cpu.SEGMENT
        else:
            tap.emit(query, key)                  # [B, T, H_k, d_k]
        return orig(query, key, *args, **kwargs)
    return wrapped


def _mamba_chunk_wrap(orig, tap: _KernelTap):
    def wrapped(hidden_states, dt, A, B, C, *args, **kwargs):
        tap.emit(C, B)                            # [B, T, G, N]: C = query, B = key
        return orig(hidden_states, dt, A, B, C, *args, **kwargs)
    return wrapped


def _mamba_step_wrap(orig, tap: _KernelTap):
    def wrapped(state, hidden_states, dt, A, B, C, *args, **kwargs):
        tap.emit(C[:, None], B[:, None])          # [B, G, N] -> [B, 1, G, N]
        return orig(state, hidden_states, dt, A, B, C, *args, **kwargs)
    return wrapped


class HFBackbone(Backbone):
    """Common code for transformers causal LMs whose cache is a (Counting)DynamicCache."""

    modeling_module: str = ""
    kernel_wrappers: dict = {}

    def __init__(self, model, tokenizer=None):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self._module = importlib.import_module(self.modeling_module)
        self._mixers = self._find_mixers()
        if not self._mixers:
            raise ValueError(f"{type(model).__name__} has no recurrent layer to index")

    def _find_mixers(self) -> list[torch.nn.Module]:
        raise NotImplementedError

    def _base_model(self):
        """The transformers model under an optional peft wrapper."""
        m = self.model
        return m.get_base_model() if hasattr(m, "get_base_model") else m

    # ---- state ----------------------------------------------------------------------------
    def new_state(self) -> BackboneState:
        return BackboneState(cache=CountingCache(config=self.model.config), n_tokens=0)

    def state_to_tensors(self, state: BackboneState) -> dict[str, torch.Tensor]:
        out = {"n_tokens": torch.tensor([state.n_tokens], dtype=torch.int64)}
        for i, layer in enumerate(state.cache.layers):
            rec = getattr(layer, "recurrent_states", None)
            if rec is not None:
                for s, t in layer.conv_states.items():
                    if t is not None:
                        out[f"layers.{i}.conv.{s}"] = t.contiguous()
                for s, t in rec.items():
                    if t is not None:
                        out[f"layers.{i}.recurrent.{s}"] = t.contiguous()
            keys = getattr(layer, "keys", None)
            if keys is not None and getattr(layer, "is_initialized", False):
                out[f"layers.{i}.keys"] = layer.keys.contiguous()
                out[f"layers.{i}.values"] = layer.values.contiguous()
        return out

    def state_from_tensors(self, tensors: dict[str, torch.Tensor]) -> BackboneState:
        state = self.new_state()
        cache = state.cache
        dev = self.device
        for i, layer in enumerate(cache.layers):
            if getattr(layer, "recurrent_states", None) is not None:
                for s in list(layer.conv_states):
                    c = tensors.get(f"layers.{i}.conv.{s}")
                    r = tensors.get(f"layers.{i}.recurrent.{s}")
                    if c is not None:
                        layer.lazy_initialization(conv_states=c.to(dev), state_idx=s, conv_kernel_size=c.shape[-1])
                        layer.conv_states[s].copy_(c)
                        layer.has_previous_state[s] = True
                    if r is not None:
                        layer.lazy_initialization(recurrent_states=r.to(dev), state_idx=s)
                        layer.recurrent_states[s].copy_(r)
            k = tensors.get(f"layers.{i}.keys")
            if k is not None:
                layer.update(k.to(dev), tensors[f"layers.{i}.values"].to(dev))
        n = int(tensors["n_tokens"][0])
        cache.n_seen = n
        cache.sync_linear_counters()
        state.n_tokens = n
        return state

    # ---- compute --------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, state, ids, tap=None, need_logits=True):
        if ids.dim() != 1:
            raise ValueError(f"ids must be 1-D [T], got shape {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise ValueError("forward over zero tokens")
        ctx = _KernelTap(self._module, self.kernel_wrappers, self._mixers, tap) if tap else contextlib.nullcontext()
        # Fast CPU kernels first, so the tap wraps them (nbcore.kernels: on by default on CPU). The
        # short conv may overwrite its input (the mixer's projection, never read again) unless the
        # cache keeps past conv inputs (transformers' record_past, for rollback).
        recording = any(getattr(layer, "record_past", False) for layer in getattr(state.cache, "layers", ()))
        with fast_kernels(self._module, self.device, inplace_conv=not recording), ctx, self._adapter_ctx():
            out = self.model(
                input_ids=ids.to(self.device)[None],
                cache=state.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        state.cache = out.cache if getattr(out, "cache", None) is not None else state.cache
        state.n_tokens += int(ids.numel())
        state.cache.n_seen = state.n_tokens
        if not need_logits:
            return None
        return out.logits[0, -1].float()


class GDNBackbone(HFBackbone):
    """Gated DeltaNet layers of transformers' qwen3_5 / qwen3_next (pure or hybrid)."""

    family = "gdn"
    kernel_wrappers = {
        "torch_chunk_gated_delta_rule": _gdn_wrap,
        "torch_recurrent_gated_delta_rule": _gdn_wrap,
    }

    def __init__(self, model, tokenizer=None):
        mt = model.config.model_type
        self.modeling_module = {
            "qwen3_5_text": "transformers.models.qwen3_5.modeling_qwen3_5",
            "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5",
            "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
        }[mt]
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.heads_per_layer = cfg.linear_num_key_heads
        self.key_dim = cfg.linear_key_head_dim
        self.rec_layers = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
        super().__init__(model, tokenizer)

    def _find_mixers(self):
        layers = self._base_model().model.layers
        return [layers[i].linear_attn for i in self.rec_layers]


class Mamba2Backbone(HFBackbone):
    """transformers' Mamba2ForCausalLM. Channels = (layer, group)."""

    family = "mamba2"
    modeling_module = "transformers.models.mamba2.modeling_mamba2"
    kernel_wrappers = {
        "mamba2_chunk_scan": _mamba_chunk_wrap,
        "mamba2_selective_state_update": _mamba_step_wrap,
    }

    def __init__(self, model, tokenizer=None):
        cfg = model.config
        self.heads_per_layer = cfg.n_groups
        self.key_dim = cfg.state_size
        self.rec_layers = list(range(cfg.num_hidden_layers))
        super().__init__(model, tokenizer)

    def _find_mixers(self):
        return [blk.mixer for blk in self._base_model().backbone.layers]
