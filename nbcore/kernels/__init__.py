"""Faster CPU kernels for the pure-torch fallbacks transformers runs without fla / mamba-ssm.

On a CPU machine transformers' Gated DeltaNet (qwen3_5, qwen3_next) and Mamba-2 layers call
module-level pure-torch functions (`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`,
`mamba2_chunk_scan`). `gdn_cpu` and `mamba2_cpu` hold drop-in replacements (same signatures, same
results up to float rounding; tolerances in their docstrings); `installed(module, device)` puts
them on a modeling module for one block, and `HFBackbone.forward` does that around every forward,
*before* its kernel tap wraps the same names (so the tap sees the same q/k as on the reference
path).

The switch:
- on by default for CPU forwards without autograd (the backbone's no-grad forward);
- never on CUDA (there the fla / mamba-ssm kernels, or the reference, run untouched);
- `NB_FAST_KERNELS=0` in the environment turns them off process-wide;
- `set_fast_kernels(False)` (or `True`; `None` = back to the environment), and the context
  managers `reference_kernels()` / `use_fast_kernels(flag)`, force the choice in code.

Nothing here imports triton (importing it on CPU makes transformers swap in fla kernels that fail)
and nothing here needs it: the kernels are plain torch ops.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

__all__ = ["fast_kernels_enabled", "set_fast_kernels", "use_fast_kernels", "reference_kernels", "installed",
           "overrides_for"]

ENV = "NB_FAST_KERNELS"
_FORCED: bool | None = None


def fast_kernels_enabled(device: torch.device | str | None = None) -> bool:
    """Whether forwards on `device` (None: assume CPU) use the fast CPU kernels."""
    if device is not None and torch.device(device).type != "cpu":
        return False
    if _FORCED is not None:
        return _FORCED
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def set_fast_kernels(enabled: bool | None) -> None:
    """Force the fast kernels on (True) or off (False) for this process; None: follow NB_FAST_KERNELS."""
    global _FORCED
    _FORCED = None if enabled is None else bool(enabled)


@contextlib.contextmanager
def use_fast_kernels(enabled: bool = True):
    """Inside this block the fast kernels are forced on (CPU forwards) or off, whatever the
    environment says; the previous setting comes back on exit."""
    global _FORCED
    prev, _FORCED = _FORCED, bool(enabled)
    try:
        yield
    finally:
        _FORCED = prev


def reference_kernels():
    """Inside this block, forwards run transformers' own reference functions."""
    return use_fast_kernels(False)


def overrides_for(module_name: str, inplace_conv: bool = False) -> dict:
    """name -> fast function for a transformers modeling module ({} if none). `inplace_conv`: the
    short conv overwrites its input (see `gdn_cpu.causal_conv1d_fn`; only where the caller never
    reads that input again, which holds for these modules' mixers unless the cache records past
    conv inputs)."""
    short = module_name.rsplit(".", 1)[-1]
    from nbcore.kernels import gdn_cpu
    conv = functools.partial(gdn_cpu.causal_conv1d_fn, inplace=True) if inplace_conv else gdn_cpu.causal_conv1d_fn
    if short in ("modeling_qwen3_5", "modeling_qwen3_next"):
        return {"torch_chunk_gated_delta_rule": gdn_cpu.chunk_gated_delta_rule, "causal_conv1d_fn": conv}
    if short == "modeling_mamba2":
        from nbcore.kernels import mamba2_cpu
        return {"mamba2_chunk_scan": mamba2_cpu.mamba2_chunk_scan, "causal_conv1d_fn": conv}
    return {}


@contextlib.contextmanager
def installed(module, device: torch.device | str | None = None, inplace_conv: bool = False):
    """Within the block, `module`'s kernel functions are the fast CPU ones, when enabled for
    `device` and autograd is off (the kernels are inference-only); otherwise a no-op. The
    previous attributes are restored on exit (whatever they were: a tap's wrapper, fla's).
    `inplace_conv`: see `overrides_for`."""
    if torch.is_grad_enabled() or not fast_kernels_enabled(device):
        yield False
        return
    fns = overrides_for(module.__name__, inplace_conv)
    saved = {name: getattr(module, name) for name in fns if hasattr(module, name)}
    try:
        for name in saved:
            setattr(module, name, fns[name])
        yield bool(saved)
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
