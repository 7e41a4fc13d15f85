"""A small C kernel for NoteBank's CPU feature capture, built on first use with the system's C
compiler and loaded through ctypes (no torch headers, no ninja: one `cc` call of about a second).

`capture_segment` runs `capture.c`: the compacted queries (Eq. 9) and the chunk distinctiveness
(Eqs. 3, 8) of one segment of the CPU delta-rule kernel, one pass per tensor, instead of ~25 torch
ops on small tensors. `ChunkReducer.on_segment`'s torch path stays beside it as the reference
(tests/test_capture_native.py: compacted queries bit-equal, distinctiveness within 2e-6).

`l2norm_` is the delta-rule kernel's q/k preparation (transformers' `l2norm`, then q's scale) in
one pass per row instead of five torch ops over the segment; it reproduces ATen's summation
order, so its bits are torch's, and `l2norm_matches_torch` checks that once per head size before
it is used (gdn_cpu keeps the torch ops where it does not hold).

When it is used: CPU float32 contiguous segments, a compiler found (`$CC`, else `cc`), and
`NB_NATIVE_KERNELS` not set to 0. Otherwise `capture_segment` returns False and the caller takes
the torch path; a failed build is logged once, never raised.

The shared library is cached in `$NB_KERNEL_CACHE`, else `~/.cache/notebank/kernels`, under a name
keyed by the source, the flags, the compiler's version and the machine; it is written to a
temporary file and renamed, so concurrent actors on one host never load a partial file.
Flags: `-O3 -ffp-contract=off -fno-math-errno` (no fused multiply-add: the same numbers on every
x86-64 and aarch64 build; sqrt inlined), no `-march=native` (a cache on a shared home folder may
serve other CPUs); an AVX2 clone where the toolchain makes one (capture.c, same bits), else a build
without clones.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["capture_segment", "capture_into", "l2norm_", "l2norm_matches_torch", "available",
           "library_path", "ENV", "ENV_CACHE"]

log = logging.getLogger(__name__)

ENV = "NB_NATIVE_KERNELS"
ENV_CACHE = "NB_KERNEL_CACHE"
DEFAULT_CACHE = "~/.cache/notebank/kernels"
SOURCE = Path(__file__).with_name("capture.c")
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=c99")

_UNSET = object()
_LIB = _UNSET


def _enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def library_path(cc: str) -> Path:
    """Where the library built by `cc` from today's source lives in the cache."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), platform.machine().encode(),
                 platform.system().encode()):
        h.update(part)
        h.update(b"\0")
    root = Path(os.path.expanduser(os.environ.get(ENV_CACHE) or DEFAULT_CACHE))
    return root / f"capture-{h.hexdigest()[:20]}.so"


def _build(cc: str) -> Path:
    out = library_path(cc)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".so.tmp", dir=out.parent)
    os.close(fd)
    try:
        # with an AVX2 clone where the toolchain makes them (x86-64 Linux GCC), else without: the
        # same results either way (capture.c, NB_CLONES)
        for extra in ((), ("-DNB_NO_CLONES",)):
            proc = subprocess.run([cc, *FLAGS, *extra, "-o", tmp, str(SOURCE), "-lm"], capture_output=True,
                                  text=True, timeout=120)
            if not proc.returncode:
                break
        if proc.returncode:
            raise RuntimeError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)          # atomic: a concurrent builder's identical file is as good
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load():
    global _LIB
    if _LIB is not _UNSET:
        return _LIB
    _LIB = None
    cc = _compiler()
    if cc is None:
        log.info("no C compiler (cc / $CC): NoteBank's CPU feature capture uses its torch path")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        capture_args = [ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ptr, i64, ptr, i64, i64, ptr, i64, i64, i64, ptr]
        fns = {}
        for name, args in (("nb_capture_segment", capture_args),
                           ("nb_l2norm_rows", [ptr, i64, i64, f32, f32, i64])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
            fns[name] = fn
        _LIB = fns
    except Exception as e:   # noqa: BLE001 - any build or load failure means: use the torch path
        log.warning("NoteBank's native capture kernel is unavailable (%s); using the torch path", e)
    return _LIB


_SCRATCH: dict[int, torch.Tensor] = {}


def _scratch(n: int) -> torch.Tensor:
    """A float32 buffer of n values, reused across calls of one thread (ctypes releases the GIL,
    so each thread gets its own)."""
    key = (threading.get_ident(), n)
    buf = _SCRATCH.get(key)
    if buf is None:
        if len(_SCRATCH) > 64:
            _SCRATCH.clear()
        buf = _SCRATCH[key] = torch.empty(n, dtype=torch.float32)
    return buf


def available() -> bool:
    """Whether `capture_segment` can run here (enabled, compiler found, library built)."""
    return _enabled() and _load() is not None


def capture_segment(q: torch.Tensor, k: torch.Tensor, r: int, H: int, t: int, coords: torch.Tensor,
                    qc: torch.Tensor, d: torch.Tensor | None, chunk_size: int | None) -> bool:
    """Write one segment's compacted queries and whole-chunk distinctiveness; False (nothing
    written) when the native kernel cannot take these inputs.

    q, k: [n, BH, c, D] float32 contiguous (gdn_cpu's chunk-major copies; key head h is kernel head
    h*r of batch 0). t: valid tokens (rows past t are padding). coords: [H, d_rho] int64.
    qc: [t, H, d_rho] bfloat16 out (any token/head strides, unit stride inside). d: [t, H] float32
    out or None; only its first (t // chunk_size) * chunk_size rows are written."""
    if q.shape != k.shape or qc.dtype != torch.bfloat16:
        return False
    if qc.stride(2) != 1 or (d is not None and (d.dtype != torch.float32 or not chunk_size)):
        return False
    coords = coords.to(torch.int64).contiguous()
    return capture_into(q, k, r, H, t, coords.data_ptr(), coords.shape[1], qc.data_ptr(), qc.stride(0),
                        qc.stride(1), d.data_ptr() if d is not None else None, d.stride(0) if d is not None else 0,
                        d.stride(1) if d is not None else 0, int(chunk_size or 0))


def capture_into(q: torch.Tensor, k: torch.Tensor, r: int, H: int, t: int, coords_ptr: int, dr: int,
                 qc_ptr: int, qc_tok: int, qc_head: int, d_ptr: int | None, d_tok: int, d_head: int,
                 chunk_size: int) -> bool:
    """`capture_segment` with the outputs given as raw addresses (elements of bf16 / fp32) and their
    strides in elements, and coords as the address of a contiguous [H, dr] int64 array: for a
    caller that owns those buffers and calls per segment (`ChunkReducer` with `n_tokens`), so that
    a call makes no tensor views. The caller keeps every buffer alive and in bounds; q, k are
    checked as in `capture_segment`."""
    if not (q.dtype is torch.float32 and k.dtype is torch.float32 and q.is_contiguous() and k.is_contiguous()
            and q.device.type == "cpu" and _enabled()):
        return False
    fn = _load()
    if fn is None:
        return False
    n, BH, c, D = k.shape
    scratch = _scratch(int(chunk_size)).data_ptr() if d_ptr is not None else None
    return fn["nb_capture_segment"](q.data_ptr(), k.data_ptr(), n, BH, c, D, r, H, t, coords_ptr, dr, qc_ptr, qc_tok,
                                    qc_head, d_ptr, d_tok, d_head, int(chunk_size or 0), scratch) == 0


_L2_CHECKED: dict[tuple[int, float], bool] = {}


def l2norm_matches_torch(D: int, eps: float) -> bool:
    """Whether the C l2norm gives torch's bits for rows of D values here (it reproduces ATen's
    summation order for a contiguous row on x86-64; another build of torch or another CPU may
    sum differently). Checked once per (D, eps) on random rows of widely varied scale; a mismatch
    keeps the torch ops for that D."""
    key = (int(D), float(eps))
    ok = _L2_CHECKED.get(key)
    if ok is None:
        ok = False
        fn = _load() if _enabled() else None
        if fn is not None and 0 < D < 512:
            g = torch.Generator().manual_seed(D)
            x = torch.randn(3, 2, 32, D, generator=g) * torch.logspace(-4, 4, 32)[None, None, :, None]
            x[0, 0, 0] = 0.0                                   # a zero row (padding): eps alone
            ok = True
            from nbcore.kernels.gdn_cpu import _l2norm_      # the reference: transformers' l2norm in torch ops
            for scale in (None, D ** -0.5):
                ref, got = _l2norm_(x.clone(), eps), x.clone()
                if scale is not None:
                    ref.mul_(scale)
                rc = fn["nb_l2norm_rows"](got.data_ptr(), got.numel() // D, D, float(eps),
                                          float(scale or 1.0), int(scale is not None))
                ok = ok and rc == 0 and torch.equal(ref, got)
            if not ok:
                log.info("the C l2norm does not reproduce torch's bits for D=%d here; using torch's ops", D)
        _L2_CHECKED[key] = ok
    return ok


def l2norm_(x: torch.Tensor, eps: float, scale: float | None = None) -> bool:
    """In place over the last dim of a contiguous CPU float32 tensor: transformers' `l2norm`
    (x * rsqrt(sum(x^2) + eps)), then times `scale` if given, in one pass per row, with the bits of
    those torch ops (`l2norm_matches_torch`). False (x untouched) when it cannot run here."""
    if not (x.dtype is torch.float32 and x.is_contiguous() and x.device.type == "cpu" and x.dim() >= 1
            and _enabled()):
        return False
    D = x.shape[-1]
    if not l2norm_matches_torch(D, eps):
        return False
    if x.numel() == 0:
        return True
    return _load()["nb_l2norm_rows"](x.data_ptr(), x.numel() // D, D, float(eps),
                                     float(1.0 if scale is None else scale), int(scale is not None)) == 0
