"""LoRA read adapters for NoteBank (NB-LoRA, paper Sec. 3.2 "Readout", App. B.4, C.4).

    from nbcore.lora import attach_adapter, load_adapter, save_adapter, LoraSpec
    attach_adapter(bb, LoraSpec())             # fresh zero-initialised adapters (training)
    save_adapter(bb, "out/adapter")            # peft layout + notebank_adapter.json
    load_adapter(bb, "out/adapter")            # query / evaluation jobs (`--adapter`), also fsspec URLs

Adapters are low-rank updates dW = (alpha/r) B A with B zero-initialised (peft's default
`init_lora_weights=True`), on the projections App. B.4 names, at the layers App. C.4 lists:

| family | adapted modules (per selected layer) |
|---|---|
| `gdn`, transformers `qwen3_5` | `linear_attn.in_proj_qkv` (the fused q, k, v projection) and `linear_attn.out_proj` |
| `gdn`, transformers `qwen3_next` | `linear_attn.in_proj_qkvz` (fused q, k, v and the output gate z, interleaved per key head; adapted whole) and `linear_attn.out_proj` |
| `fla-gdn` | `attn.q_proj`, `attn.k_proj`, `attn.v_proj`, `attn.o_proj` |
| `mamba2` | the x, B and C output rows of `mixer.in_proj` (not z, not dt) and `mixer.out_proj` |

Mamba-2. peft refuses `out_proj` (and `conv1d`) by *name* for `model_type` mamba2, because the
fused CUDA training kernel (`mamba_split_conv1d_scan_combined`, used when the mixer is in training
mode without a cache) reads `out_proj.weight` directly and would bypass a LoRA wrapper. We do not
rename or skip anything: `Mamba2MixerLora` is a peft custom LoRA layer (registered through
`LoraConfig._register_custom_module`) that wraps the whole `Mamba2Mixer` (peft's target name is then
`mixer`). It owns two low-rank pairs, `lora_A/lora_B` for in_proj (B has exactly
`conv_dim = d_inner + 2 * n_groups * d_state` rows: the x/B/C slice) and `lora_out_A/lora_out_B`
for out_proj, and adds them with forward hooks on the mixer's own `in_proj` and `out_proj` for the
duration of the mixer call. It always routes the mixer through the unfused path (the wrapper calls
the mixer with `training=False` when no cache is given), where both projections are called as
modules, so the deltas can never be bypassed. merge/unmerge write the deltas into the weights.
Saved adapters keep peft's layout (`adapter_config.json` + `adapter_model.safetensors`); loading a
Mamba-2 adapter with peft needs the custom module registered on the config again (peft does not
serialise custom mappings): `PeftModel.from_pretrained(model, path, config=lora_config_for(path))`.
GDN adapters load with plain `PeftModel.from_pretrained(model, path)`.

Default layers (App. C.4): GDN-1.3B (24 recurrent layers) 11, 15, 18, 22; GDN-2 (18) 8, 11, 13,
16; Mamba-2-1.3B (48) 23, 31, 37, 45. Other depths (our rule, the paper is silent): the paper's
relative depths (GDN list for GDN families, Mamba-2 list for Mamba-2) mapped onto the model's
recurrent layers, k -> floor(p_k * n / N_paper), deduplicated; with 4 or fewer recurrent layers,
all of them. For hybrids the indices count recurrent (GDN) layers only, then map to model layers.

On/off switch: the same one the query job uses. `Backbone.forward` runs the model under peft's
`disable_adapter()` unless inside `Backbone.reading()` (context processing and retrieval: off;
replay, question, generation: on).

Archive compatibility: archives record `Backbone.fingerprint()`, which covers the base weights.
peft renames the state dict (and adds adapter tensors), which could change that value although
writing never uses the adapters; `attach_adapter`/`load_adapter` therefore freeze the backbone's
fingerprint at its adapter-free value, so archives written without adapters stay valid for NB-LoRA
reading (and vice versa).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import types
from contextlib import contextmanager

import torch
import torch.nn as nn

from nbcore.training.configs import LoraSpec  # noqa: F401  (its home is torch-free: configs are checked first)

ADAPTER_META = "notebank_adapter.json"
META_VERSION = 1

# App. C.4, zero-indexed layers, keyed by (family kind, number of recurrent layers).
PAPER_LAYERS = {
    ("gdn", 24): (11, 15, 18, 22),       # GDN-1.3B (m-a-p/1.3B-100B-GatedDeltaNet-pure)
    ("gdn", 18): (8, 11, 13, 16),        # GDN-2 (1.3B)
    ("mamba2", 48): (23, 31, 37, 45),    # Mamba-2-1.3B
}
_RELATIVE = {"gdn": ((11, 15, 18, 22), 24), "mamba2": ((23, 31, 37, 45), 48)}


def _kind(bb) -> str:
    return "mamba2" if bb.family == "mamba2" else "gdn"


def default_layers(bb) -> list[int]:
    """Model layer indices that get adapters by default (see module docstring)."""
    rec = list(bb.rec_layers)
    n = len(rec)
    kind = _kind(bb)
    paper = PAPER_LAYERS.get((kind, n))
    if paper is not None:
        return [rec[i] for i in paper]
    if n <= 4:
        return rec
    idx, n_paper = _RELATIVE[kind]
    picked = sorted({min(n - 1, (p * n) // n_paper) for p in idx})
    return [rec[i] for i in picked]


def _model_type(bb) -> str:
    return str(getattr(bb.model.config, "model_type", ""))


def target_pattern(bb, layers: list[int]) -> tuple[str, list[str]]:
    """-> (peft `target_modules` regex (full match on module names), module suffixes per layer)."""
    if not layers:
        raise ValueError("no layer selected for adapters")
    bad = [l for l in layers if l not in bb.rec_layers]
    if bad:
        raise ValueError(f"adapter layers {bad} are not recurrent layers of this backbone "
                         f"(recurrent layers: {list(bb.rec_layers)})")
    alt = "|".join(str(int(l)) for l in sorted(set(layers)))
    fam = bb.family
    if fam == "mamba2":
        suffixes = ["mixer"]
        return rf"(?:.*\.)?layers\.({alt})\.mixer", suffixes
    if fam == "fla-gdn":
        suffixes = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj"]
        return rf"(?:.*\.)?layers\.({alt})\.attn\.(q_proj|k_proj|v_proj|o_proj)", suffixes
    if fam == "gdn":
        mt = _model_type(bb)
        qkv = "in_proj_qkvz" if mt == "qwen3_next" else "in_proj_qkv"
        suffixes = [f"linear_attn.{qkv}", "linear_attn.out_proj"]
        return rf"(?:.*\.)?layers\.({alt})\.linear_attn\.({qkv}|out_proj)", suffixes
    raise ValueError(f"no LoRA target rule for backbone family {fam!r}")


# ---------------------------------------------------------------------------------------------
# Mamba-2: a peft custom LoRA layer wrapping the whole mixer

def _mamba_mixer_cls():
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
    return Mamba2Mixer


def _make_mamba_lora_cls():
    from peft.tuners.tuners_utils import BaseTunerLayer

    class Mamba2MixerLora(nn.Module, BaseTunerLayer):
        """LoRA on the x/B/C rows of `in_proj` and on `out_proj` of one transformers Mamba2Mixer.

        in_proj rows are [z (d_inner) | x (d_inner) | B (G*N) | C (G*N) | dt (heads)]; the in_proj
        delta covers exactly rows [d_inner, d_inner + conv_dim) (x, B, C). See the module docstring."""

        adapter_layer_names = ("lora_A", "lora_B", "lora_out_A", "lora_out_B")
        other_param_names = ("r", "lora_alpha", "scaling")

        def __init__(self, base_layer, adapter_name, config=None, r: int = 8, lora_alpha: float = 16, **kwargs):
            super().__init__()
            BaseTunerLayer.__init__(self)
            self.base_layer = base_layer
            self.r, self.lora_alpha, self.scaling = {}, {}, {}
            self.lora_A, self.lora_B = nn.ModuleDict(), nn.ModuleDict()
            self.lora_out_A, self.lora_out_B = nn.ModuleDict(), nn.ModuleDict()
            self._disable_adapters = False
            self.merged_adapters = []
            self.kwargs = kwargs
            m = base_layer
            self.row_start = int(m.intermediate_size)
            self.row_end = int(m.intermediate_size + m.conv_dim)
            self.in_features = m.in_proj.in_features
            self.out_features = m.in_proj.out_features
            self.update_layer(adapter_name, r, lora_alpha, config)
            self._active_adapter = adapter_name

        # -- peft protocol --------------------------------------------------------------
        def update_layer(self, adapter_name, r, lora_alpha, config=None, **kwargs):
            if r <= 0:
                raise ValueError(f"`r` should be a positive integer value but the value passed is {r}")
            if config is not None and getattr(config, "lora_dropout", 0.0):
                raise ValueError("Mamba2MixerLora does not support lora_dropout")
            m = self.base_layer
            dev = m.in_proj.weight.device
            hidden, d_inner = m.in_proj.in_features, m.out_proj.in_features
            conv_dim = self.row_end - self.row_start
            self.r[adapter_name] = r
            self.lora_alpha[adapter_name] = lora_alpha
            self.scaling[adapter_name] = lora_alpha / r
            a_in, b_in = nn.Linear(hidden, r, bias=False), nn.Linear(r, conv_dim, bias=False)
            a_out, b_out = nn.Linear(d_inner, r, bias=False), nn.Linear(r, m.out_proj.out_features, bias=False)
            init = True if config is None else config.init_lora_weights
            for a, b in ((a_in, b_in), (a_out, b_out)):
                nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))   # peft's default A init
                if init is False:
                    nn.init.normal_(b.weight, std=1.0 / r)           # peft's init_lora_weights=False (tests)
                else:
                    nn.init.zeros_(b.weight)                         # App. B.4: B = 0
            self.lora_A[adapter_name], self.lora_B[adapter_name] = a_in.to(dev), b_in.to(dev)
            self.lora_out_A[adapter_name], self.lora_out_B[adapter_name] = a_out.to(dev), b_out.to(dev)
            self.set_adapter(self.active_adapters)

        def _active(self) -> list[str]:
            if self.disable_adapters or self.merged:
                return []
            return [a for a in self.active_adapters if a in self.lora_A]

        def get_delta_weight(self, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
            """-> (delta for in_proj rows [row_start, row_end), delta for out_proj)."""
            s = self.scaling[adapter]
            d_in = s * (self.lora_B[adapter].weight @ self.lora_A[adapter].weight)
            d_out = s * (self.lora_out_B[adapter].weight @ self.lora_out_A[adapter].weight)
            return d_in, d_out

        @torch.no_grad()
        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            m = self.base_layer
            for a in (adapter_names or self.active_adapters):
                if a not in self.lora_A or a in self.merged_adapters:
                    continue
                d_in, d_out = self.get_delta_weight(a)
                w_in = m.in_proj.weight.data.clone()
                w_in[self.row_start:self.row_end] += d_in.to(w_in.dtype)
                w_out = m.out_proj.weight.data + d_out.to(m.out_proj.weight.dtype)
                if safe_merge and not (torch.isfinite(w_in).all() and torch.isfinite(w_out).all()):
                    raise ValueError(f"NaNs detected in the merged weights; adapter {a} seems broken")
                m.in_proj.weight.data.copy_(w_in)
                m.out_proj.weight.data.copy_(w_out)
                self.merged_adapters.append(a)

        @torch.no_grad()
        def unmerge(self) -> None:
            m = self.base_layer
            while self.merged_adapters:
                a = self.merged_adapters.pop()
                d_in, d_out = self.get_delta_weight(a)
                m.in_proj.weight.data[self.row_start:self.row_end] -= d_in.to(m.in_proj.weight.dtype)
                m.out_proj.weight.data -= d_out.to(m.out_proj.weight.dtype)

        # -- forward ------------------------------------------------------------------------
        def forward(self, *args, **kwargs):
            active = self._active()
            if not active:
                return self.base_layer(*args, **kwargs)
            m = self.base_layer

            def in_hook(mod, inp, out):
                x = inp[0]
                delta = 0
                for a in active:
                    A, B = self.lora_A[a], self.lora_B[a]
                    delta = delta + B(A(x.to(A.weight.dtype))) * self.scaling[a]
                pad = (self.row_start, out.shape[-1] - self.row_end)
                return out + nn.functional.pad(delta.to(out.dtype), pad)

            def out_hook(mod, inp, out):
                x = inp[0]
                delta = 0
                for a in active:
                    A, B = self.lora_out_A[a], self.lora_out_B[a]
                    delta = delta + B(A(x.to(A.weight.dtype))) * self.scaling[a]
                return out + delta.to(out.dtype)

            # prepend: other hooks on the projections see the adapted output
            hooks = [m.in_proj.register_forward_hook(in_hook, prepend=True),
                     m.out_proj.register_forward_hook(out_hook, prepend=True)]
            # The fused kernel (training mode, no cache) reads out_proj.weight directly: never take it.
            was_training = m.training
            if was_training:
                m.training = False
            try:
                return m(*args, **kwargs)
            finally:
                m.training = was_training
                for h in hooks:
                    h.remove()

        def __repr__(self) -> str:
            return "lora." + super().__repr__()

    return Mamba2MixerLora


_MAMBA_LORA = None


def mamba_lora_cls():
    global _MAMBA_LORA
    if _MAMBA_LORA is None:
        _MAMBA_LORA = _make_mamba_lora_cls()
    return _MAMBA_LORA


def register_custom_modules(config, model_type: str):
    """Register the custom LoRA layers a LoraConfig needs for this model type (in place)."""
    if model_type == "mamba2":
        config._register_custom_module({_mamba_mixer_cls(): mamba_lora_cls()})
    return config


def lora_config_for(path: str, model_type: str | None = None, inference_mode: bool = True):
    """LoraConfig of a saved adapter, with the custom modules it needs registered (what peft's
    `PeftModel.from_pretrained(model, path, config=...)` needs for Mamba-2 adapters)."""
    from peft import LoraConfig
    cfg = LoraConfig.from_pretrained(path)
    cfg.inference_mode = inference_mode
    if model_type is None:
        meta = read_meta(path)
        model_type = meta.get("model_type", "") if meta else ""
    return register_custom_modules(cfg, model_type)


# ---------------------------------------------------------------------------------------------
# fingerprints: adapters never change what the archive is a function of

def base_state_dict(model) -> dict[str, torch.Tensor]:
    """State dict of the base weights under a peft wrapper, with the base model's own key names."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = {}
    for k, v in base.state_dict().items():
        if "lora_" in k:
            continue
        out[k.replace(".base_layer.", ".")] = v
    return out


def base_weights_digest(model) -> str:
    """Digest of the base weights (a few values of every tensor), identical before and after
    adapters are attached; recorded in notebank_adapter.json and checked by `load_adapter`."""
    import hashlib
    h = hashlib.sha256()
    for name, p in sorted(base_state_dict(model).items()):
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 16)][:16].float().cpu().numpy().tobytes()
        h.update(name.encode())
        h.update(sample)
    return h.hexdigest()[:16]


def _pin_fingerprint(bb) -> None:
    """Freeze `bb.fingerprint()` at its adapter-free value (computed now, before peft wraps the
    model). Works whether or not Backbone itself ignores adapter tensors / caches the value."""
    fp = bb.fingerprint()
    bb.__dict__["_fingerprint"] = fp
    bb.fingerprint = types.MethodType(lambda self, _f=fp: _f, bb)


# ---------------------------------------------------------------------------------------------
# attach / save / load

def _check_injected(bb, layers: list[int], suffixes: list[str]) -> list[str]:
    """Every expected module must carry an adapter (never silently skip)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    names = [n for n, m in bb.model.named_modules() if isinstance(m, BaseTunerLayer)]
    missing = []
    for l in layers:
        for s in suffixes:
            pat = re.compile(rf"(?:.*\.)?layers\.{l}\.{re.escape(s)}$")
            if not any(pat.match(n) for n in names):
                missing.append(f"layers.{l}.{s}")
    if missing:
        raise RuntimeError(f"adapters were not attached to: {missing}")
    return names


def attach_adapter(bb, spec: LoraSpec | None = None, adapter_name: str = "default", seed: int | None = 0):
    """Attach fresh adapters (B = 0, so outputs are unchanged) to `bb.model` in place.
    Returns the list of adapted module names."""
    from peft import LoraConfig, get_peft_model
    spec = (spec or LoraSpec()).validate()
    if bb.has_adapter:
        raise ValueError("this backbone already has adapters (load_adapter / attach once)")
    layers = list(spec.layers) if spec.layers is not None else default_layers(bb)
    pattern, suffixes = target_pattern(bb, layers)
    cfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=pattern,
                     bias="none", init_lora_weights=True)
    register_custom_modules(cfg, _model_type(bb))
    if seed is not None:
        torch.manual_seed(seed)                   # A's init is random: make it reproducible
    _pin_fingerprint(bb)
    bb.model = get_peft_model(bb.model, cfg, adapter_name=adapter_name)
    bb.model.eval()
    names = _check_injected(bb, layers, suffixes)
    bb.lora_layers = layers
    return names


def trainable_parameters(bb) -> list[torch.nn.Parameter]:
    """Adapter parameters (the only trainable ones)."""
    return [p for n, p in bb.model.named_parameters() if "lora_" in n]


def adapter_meta(bb) -> dict:
    return {
        "version": META_VERSION,
        "family": bb.family,
        "model_type": _model_type(bb),
        "layers": list(getattr(bb, "lora_layers", []) or []),
        "base_weights_digest": base_weights_digest(bb.model),
        "n_rec_layers": len(bb.rec_layers),
    }


def read_meta(path: str) -> dict | None:
    p = os.path.join(path, ADAPTER_META)
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        return json.load(f)


def _is_url(s: str) -> bool:
    return "://" in s and not s.startswith("file://")


def save_adapter(bb, dest: str, adapter_name: str = "default", extra: dict | None = None) -> str:
    """Save the adapter (peft layout + notebank_adapter.json) to a local dir or an fsspec URL."""
    if not bb.has_adapter:
        raise ValueError("this backbone has no adapter to save")
    dest = os.fspath(dest)
    meta = adapter_meta(bb)
    if extra:
        meta["extra"] = extra
    if _is_url(dest):
        import fsspec
        with tempfile.TemporaryDirectory() as tmp:
            _save_local(bb, tmp, adapter_name, meta)
            fs, root = fsspec.core.url_to_fs(dest)
            fs.makedirs(root, exist_ok=True)
            for name in os.listdir(tmp):
                fs.put_file(os.path.join(tmp, name), f"{root.rstrip('/')}/{name}")
        return dest
    local = dest[len("file://"):] if dest.startswith("file://") else dest
    _save_local(bb, local, adapter_name, meta)
    return dest


def _save_local(bb, path: str, adapter_name: str, meta: dict) -> None:
    os.makedirs(path, exist_ok=True)
    bb.model.save_pretrained(path, selected_adapters=[adapter_name])
    sub = os.path.join(path, adapter_name)
    if adapter_name != "default" and os.path.isdir(sub):      # peft nests non-default adapters
        for name in os.listdir(sub):
            shutil.move(os.path.join(sub, name), os.path.join(path, name))
        os.rmdir(sub)
    with open(os.path.join(path, ADAPTER_META), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)


@contextmanager
def local_copy(src: str):
    """Yield a local directory holding the adapter at `src` (local path or fsspec URL)."""
    src = os.fspath(src)
    if not _is_url(src):
        path = src[len("file://"):] if src.startswith("file://") else src
        if not os.path.isdir(path):
            raise FileNotFoundError(f"adapter {src!r} not found (expected a directory with adapter_config.json)")
        yield path
        return
    import fsspec
    fs, root = fsspec.core.url_to_fs(src)
    if not fs.exists(f"{root.rstrip('/')}/adapter_config.json"):
        raise FileNotFoundError(f"adapter {src!r} not found (no adapter_config.json)")
    with tempfile.TemporaryDirectory() as tmp:
        for f in fs.ls(root, detail=False):
            name = f.rstrip("/").rsplit("/", 1)[-1]
            if fs.isfile(f):
                fs.get_file(f, os.path.join(tmp, name))
        yield tmp


def load_adapter(bb, src: str, adapter_name: str = "default", trainable: bool = False, strict: bool = True):
    """Load a saved adapter into `bb` (in place) from a local dir or fsspec URL.

    strict: refuse an adapter trained on different base weights (notebank_adapter.json digest)."""
    from peft import PeftModel
    if bb.has_adapter:
        raise ValueError("this backbone already has adapters; load into a fresh backbone")
    with local_copy(src) as path:
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise FileNotFoundError(f"{src!r} is not a peft adapter directory (no adapter_config.json)")
        meta = read_meta(path)
        if meta is not None:
            if meta.get("family") != bb.family:
                raise ValueError(f"adapter {src!r} was trained for a {meta.get('family')!r} backbone, "
                                 f"this backbone is {bb.family!r}")
            mine = base_weights_digest(bb.model)
            if strict and meta.get("base_weights_digest") not in (None, mine):
                raise ValueError(f"adapter {src!r} was trained on different base weights "
                                 f"(digest {meta.get('base_weights_digest')} != {mine}); pass strict=False to force")
        cfg = lora_config_for(path, _model_type(bb), inference_mode=not trainable)
        _pin_fingerprint(bb)
        bb.model = PeftModel.from_pretrained(bb.model, path, adapter_name=adapter_name, config=cfg,
                                             is_trainable=trainable)
    bb.model.eval()
    bb.lora_layers = list(meta.get("layers", [])) if meta else []
    return bb


def detach_adapter(bb):
    """Remove adapters (unmerged) and return the backbone to its base model."""
    if bb.has_adapter:
        bb.model = bb.model.unload()
        vars(bb).pop("fingerprint", None)      # the base weights did not change: the cached value stays
    bb.lora_layers = []
    return bb


__all__ = ["LoraSpec", "PAPER_LAYERS", "default_layers", "target_pattern", "attach_adapter", "load_adapter",
           "save_adapter", "detach_adapter", "trainable_parameters", "lora_config_for", "base_weights_digest",
           "mamba_lora_cls", "register_custom_modules"]
