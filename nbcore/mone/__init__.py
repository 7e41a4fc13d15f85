"""MoNe: layer-local fast-weight memory for a frozen Transformer (arXiv 2608.17616).

``memory``: the SwiGLU fast-weight memory and its write rule; ``model``: the frozen Qwen2 wrapper
(write via segment-local frozen forwards, read via extra memory K/V tokens); ``state``: per-document
state (safetensors, incremental append). Pure torch + transformers; never imports ray.
"""
from nbcore.mone.memory import FastWeights
from nbcore.mone.model import MoNeConfig, MoNeModel
from nbcore.mone.state import MoNeState, append, finalized, ingest, new_state

__all__ = ["FastWeights", "MoNeConfig", "MoNeModel", "MoNeState", "append", "finalized", "ingest",
           "new_state"]
