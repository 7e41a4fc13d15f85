"""Cost of one phase (write or query) of a MoNe / ICL / RAG example: FLOPs and peak tensor memory.

FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions and attention; element-wise
ops are not counted).

Peak memory: torch CPU memory accounting by a ``TorchDispatchMode`` (``LiveTensorPeak``): every tensor
an aten op returns inside the phase is registered by its storage; a storage's bytes count from its
first appearance until the last Python tensor viewing it is freed. The peak of that live sum is the
phase's peak memory *above what existed before the phase* (model weights, a saved state passed in).
Exact and deterministic (unlike RSS), but blind to scratch buffers that a fused kernel allocates and
frees inside one op (e.g. SDPA's internal blocks). tracemalloc would not work here: torch's CPU
allocator bypasses Python's allocator.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorPeak(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the mode and still referenced (see module doc)."""

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._owners: dict[int, int] = {}     # storage data_ptr -> number of live tensors viewing it
        self._bytes: dict[int, int] = {}      # storage data_ptr -> bytes
        self._seen: dict[int, weakref.ref] = {}   # id(tensor) -> weak ref (registered once per tensor)

    def _release(self, tid: int, ptr: int) -> None:
        self._seen.pop(tid, None)
        n = self._owners.get(ptr, 0) - 1
        if n <= 0:
            self._owners.pop(ptr, None)
            self.current -= self._bytes.pop(ptr, 0)
        else:
            self._owners[ptr] = n

    def _register(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or t.is_sparse:
            return
        ref = self._seen.get(id(t))
        if ref is not None and ref() is t:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        ptr, nbytes = st.data_ptr(), st.nbytes()
        if ptr == 0 or nbytes == 0:
            return
        if ptr not in self._owners:
            self._bytes[ptr] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        self._owners[ptr] = self._owners.get(ptr, 0) + 1
        tid = id(t)
        self._seen[tid] = weakref.ref(t, lambda _r, tid=tid, ptr=ptr: self._release(tid, ptr))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._register(t)
        return out


@dataclass
class PhaseCost:
    flops: int
    peak_bytes: int
    seconds: float


def measure(fn: Callable[[], Any], enabled: bool = True) -> tuple[Any, PhaseCost]:
    """Run ``fn()`` -> (its result, PhaseCost). ``enabled=False``: wall time only (FLOPs/bytes = -1)."""
    import time
    from torch.utils.flop_counter import FlopCounterMode
    t0 = time.perf_counter()
    if not enabled:
        out = fn()
        return out, PhaseCost(-1, -1, time.perf_counter() - t0)
    with FlopCounterMode(display=False) as fc, LiveTensorPeak() as mem:
        out = fn()
    return out, PhaseCost(int(fc.get_total_flops()), int(mem.peak), time.perf_counter() - t0)
