"""Backbone adapters and the loader. See base.Backbone for the protocol."""
from __future__ import annotations

import json
import os

import torch

from nbcore.backbones.base import Backbone, BackboneState, FeatureTap, RawTap

# model_type -> family; the loader's error message lists these.
SUPPORTED = {
    "qwen3_5_text": "gdn (transformers qwen3_5 text, pure GDN or GDN/attention hybrid)",
    "qwen3_next": "gdn (transformers qwen3_next)",
    "mamba2": "mamba2 (transformers Mamba2ForCausalLM)",
    "gated_deltanet": "fla-gdn (flash-linear-attention GatedDeltaNetForCausalLM; GPU only)",
    "llama": "streaming (Llama-architecture Transformer read with attention sinks + a sliding window)",
    "qwen2": "streaming (Qwen2, as llama)",
    "mistral": "streaming (Mistral, as llama)",
}
STREAMING_TYPES = ("llama", "qwen2", "mistral")


def _wrap(model, tokenizer, streaming: dict | None = None) -> Backbone:
    mt = model.config.model_type
    if streaming is not None and mt not in STREAMING_TYPES:
        raise ValueError(f"streaming options given for a {mt!r} checkpoint; the streaming family reads "
                         f"{STREAMING_TYPES}")
    if mt in STREAMING_TYPES:
        from nbcore.backbones.streaming import StreamingBackbone
        return StreamingBackbone(model, tokenizer, **_streaming_kwargs(streaming))
    if mt in ("qwen3_5_text", "qwen3_5", "qwen3_next"):
        from nbcore.backbones.hf import GDNBackbone
        return GDNBackbone(model, tokenizer)
    if mt == "mamba2":
        from nbcore.backbones.hf import Mamba2Backbone
        return Mamba2Backbone(model, tokenizer)
    if mt == "gated_deltanet":
        from nbcore.backbones.fla import FlaGDNBackbone
        return FlaGDNBackbone(model, tokenizer)
    raise ValueError(_unsupported(mt))


def _streaming_kwargs(streaming: dict | None) -> dict:
    """{sinks, window} of a model spec's `streaming` table (unset keys: the family's defaults)."""
    streaming = dict(streaming or {})
    bad = set(streaming) - {"sinks", "window"}
    if bad:
        raise ValueError(f"streaming: unknown option(s) {sorted(bad)}; known: sinks, window")
    return {k: int(v) for k, v in streaming.items()}


def _unsupported(mt) -> str:
    fams = "; ".join(f"{k}: {v}" for k, v in SUPPORTED.items())
    return f"unsupported backbone model_type {mt!r}. Supported families: {fams}"


def _import_fla():
    try:
        import fla  # noqa: F401  (registers the fla model classes with transformers)
    except ImportError as e:
        raise ImportError("gated_deltanet checkpoints (fla-gdn) need flash-linear-attention and a CUDA GPU: "
                          "pip install -e '.[gpu]'") from e


def model_from_config(config, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Random-init model for a transformers config (tests, speed benchmarks)."""
    from transformers import AutoModelForCausalLM
    if config.model_type not in SUPPORTED:
        raise ValueError(_unsupported(config.model_type))
    if config.model_type == "gated_deltanet":
        _import_fla()
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def load_backbone(spec, tokenizer=None, device: str | torch.device = "cpu", dtype=None, seed: int = 0, *,
                  gguf_file: str | None = None, cache_dir: str | None = None,
                  streaming: dict | None = None) -> Backbone:
    """Load a frozen backbone.

    spec: a local checkpoint directory (config.json + weights [+ tokenizer files]), a GGUF file,
          a directory with ``gguf_file``, a ``pkg:<package>/<path>`` file (nbcore.backbones.gguf:
          GGUF checkpoints are dequantised once into ``cache_dir``), a transformers config object
          (random init with `seed`), or an already built model.
    streaming: {sinks, window} for Llama-architecture checkpoints (family `streaming`,
          nbcore.backbones.streaming; defaults there). Refused for other families.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

    if isinstance(spec, PreTrainedModel):
        model = spec
    elif isinstance(spec, PretrainedConfig):
        model = model_from_config(spec, seed=seed, dtype=dtype or torch.float32)
    elif isinstance(spec, (str, os.PathLike)):
        from nbcore.backbones.gguf import resolve_checkpoint
        path = resolve_checkpoint(spec, gguf_file=gguf_file, cache_dir=cache_dir)
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{path!r} is not a checkpoint directory (no config.json)")
        with open(cfg_path) as f:
            mt = json.load(f).get("model_type")
        if mt not in SUPPORTED:
            raise ValueError(f"{path}: " + _unsupported(mt))
        if mt == "gated_deltanet":
            _import_fla()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")
        if tokenizer is None and (os.path.isfile(os.path.join(path, "tokenizer.json"))
                                  or os.path.isfile(os.path.join(path, "tokenizer_config.json"))):
            tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        raise TypeError(f"load_backbone: expected a directory, a transformers config or model, got {type(spec).__name__}")
    if streaming is not None:
        _streaming_kwargs(streaming)                 # bad options fail before the model moves
    model = model.to(device)
    return _wrap(model, tokenizer, streaming)


__all__ = ["Backbone", "BackboneState", "FeatureTap", "RawTap", "load_backbone", "model_from_config", "SUPPORTED"]
