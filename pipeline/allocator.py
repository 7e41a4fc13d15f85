"""glibc malloc settings for the processes that run a backbone on CPU (ingest / query actors).

Why: a CPU forward over a block allocates and frees the same large temporaries every layer. With
glibc's defaults, whether those come back from the heap or are mapped fresh (and page-faulted again)
depends on a threshold glibc moves as the process runs, so the same read can take 0.1 s or 1 s of
kernel time for its faults, run to run. Measured on the 2-core VM with tiny-gdn-v5 and 8K-token
blocks: one 128K-token read took 6.8 s with 537K minor faults under the defaults and 4.8 s with 0
faults under these settings (README, "Speed"). Fixing the thresholds makes every block reuse the
heap: the cost is that a worker keeps up to `TRIM_THRESHOLD` of freed memory instead of returning it.

Applied once per process by `tune_cpu_malloc()`; skipped where it cannot apply (not glibc) or where
the user chose (`NB_MALLOC=default`, or any `MALLOC_*` variable of their own, which glibc has read
already at start).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 256 << 20      # allocations below this come from the heap (8K-token activations of models
#                                 up to hidden 8,192 in fp32); fixing it also stops glibc moving it
TRIM_THRESHOLD = 1 << 30        # free memory at the heap's top is returned to the OS only beyond 1 GiB

_STATE: dict = {}


def tune_cpu_malloc() -> bool:
    """Set glibc's mmap and trim thresholds for this process (once). -> whether they are set now."""
    if "done" in _STATE:
        return _STATE["done"]
    _STATE["done"] = False
    if os.environ.get("NB_MALLOC", "tuned") == "default":
        return False
    if any(k.startswith("MALLOC_") for k in os.environ):      # the user's own glibc settings win
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version                               # AttributeError where libc is not glibc
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.info("glibc refused the malloc thresholds; keeping its defaults")
    _STATE["done"] = ok
    return ok


def runs_on_cpu(model: dict) -> bool:
    """Whether a ModelSpec dict's backbone will run on the CPU (device cpu, or auto without CUDA)."""
    device = str(model.get("device", "auto"))
    if device == "cpu":
        return True
    if device != "auto":
        return False
    import torch
    return not torch.cuda.is_available()
