"""NoteBank's CPU feature capture alone: the C kernel (nbcore/kernels/capture.c through
`nbcore.kernels.native`) against its reference, `ChunkReducer`'s torch path, on the same segments.

One "segment" is what the CPU delta-rule kernel hands the capture per call: q, k as
[n, B*Hv, c, D] fp32 chunk-major copies (n = segment / c). Per shape the script reports the median
microseconds per segment of each path over `--reps` interleaved runs, the speedup, and the
milliseconds it adds per layer and 64K tokens; outputs are checked first (compacted queries
bit-equal, distinctiveness within 2e-6, as tests/test_capture_native.py). Those inputs stay warm in
cache; `--pairs` then times the capture where it really runs, inside one CPU delta-rule layer call of
8K tokens (bare call vs with the C capture vs with the torch one, interleaved; median extra per pair).

    .venv/bin/python bench/capture_kernel.py --out bench/results/capture-kernel.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from bench.common import machine, median, today, write_json  # noqa: E402
from nbcore.kernels import gdn_cpu, native  # noqa: E402
from nbcore.notebank.features import ChunkReducer, projection_coords  # noqa: E402

# (name, key heads H, head dim D, d_rho, NoteBank chunk C): the shipped tiny GDN, GDN-1.3B's heads
SHAPES = [("tiny-gdn-v5", 4, 32, 16, 512), ("gdn-1.3b", 8, 256, 16, 512)]


def _one(red: ChunkReducer, q, k, t):
    red._pos.clear()
    red.qc.clear()
    red.dist.clear()
    red.on_segment(0, 0, t, q, k)


def bench_shape(H: int, D: int, dr: int, C: int, segment: int = gdn_cpu.SEGMENT, c: int = gdn_cpu.CHUNK,
                reps: int = 7, inner: int = 20, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = segment
    q = gdn_cpu._chunked_f32(torch.randn(1, t, H, D, generator=g), H, c)          # [n, H, c, D]
    k = gdn_cpu._chunked_f32(torch.randn(1, t, H, D, generator=g) * 3, H, c)
    coords = projection_coords(H, D, dr, seed=seed)
    fast = ChunkReducer(coords, H, C, n_tokens=t)
    ref = ChunkReducer(coords, H, C, n_tokens=t, native=False)
    _one(fast, q, k, t)
    _one(ref, q, k, t)
    (d_f, q_f), (d_r, q_r) = fast.result(), ref.result()
    if not torch.equal(q_f, q_r) or not torch.allclose(d_f, d_r, atol=2e-6, rtol=0):
        raise SystemExit(f"H={H} D={D}: the C kernel and its torch reference disagree")
    times = {"native": [], "torch": []}
    for _ in range(reps):
        for name, red in (("native", fast), ("torch", ref)):
            t0 = time.perf_counter()
            for _ in range(inner):
                _one(red, q, k, t)
            times[name].append((time.perf_counter() - t0) / inner)
    us = {name: 1e6 * median(v) for name, v in times.items()}
    per_64k = (64 * 1024) / t
    return {"H": H, "D": D, "d_rho": dr, "C": C, "segment_tokens": t,
            "native_us_per_segment": round(us["native"], 1), "torch_us_per_segment": round(us["torch"], 1),
            "speedup": round(us["torch"] / us["native"], 2),
            "native_ms_per_layer_64K": round(us["native"] * per_64k / 1e3, 2),
            "torch_ms_per_layer_64K": round(us["torch"] * per_64k / 1e3, 2)}


class _Sink:
    """gdn_cpu's feature_sink for layer 0 of a reducer (what nbcore.backbones.hf installs per layer)."""

    def __init__(self, red: ChunkReducer):
        self.red = red

    def __call__(self, a, t, q, k):
        self.red.on_segment(0, a, t, q, k)


def bench_in_situ(H: int, D: int, dr: int, C: int, T: int = 8192, pairs: int = 201, seed: int = 0) -> dict:
    """The capture inside one CPU delta-rule layer call of T tokens (what ingest runs per layer and
    block): the call without a sink, with the C capture and with its torch reference, interleaved
    `pairs` times. -> medians (ms) and the median extra of each sink over the same rep's bare call.
    Here the capture reads copies the kernel has just made, as in a real forward, not warm ones."""
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(1, T, 3 * H * D, generator=g)              # a fused q|k|v projection, as transformers'
    query, key = mixed[..., :H * D].view(1, T, H, D), mixed[..., H * D:2 * H * D].view(1, T, H, D)
    value = mixed[..., 2 * H * D:].view(1, T, H, D)
    gate = -torch.rand(1, T, H, generator=g) * 0.1
    beta = torch.rand(1, T, H, generator=g)
    coords = projection_coords(H, D, dr, seed=seed)

    def run(kind: str) -> float:
        sink = None if kind == "none" else _Sink(ChunkReducer(coords, H, C, n_tokens=T, native=(kind == "native")))
        t0 = time.perf_counter()
        with torch.no_grad():
            gdn_cpu.chunk_gated_delta_rule(query, key, value, gate, beta, use_qk_l2norm_in_kernel=True,
                                           feature_sink=sink)
        return time.perf_counter() - t0

    kinds = ("none", "native", "torch")
    times = {k: [] for k in kinds}
    for k in kinds:
        run(k)                                                      # warm-up
    for i in range(pairs):
        for k in (kinds if i % 2 == 0 else kinds[::-1]):
            times[k].append(run(k))
    extra = {k: 1e3 * median([a - b for a, b in zip(times[k], times["none"])]) for k in ("native", "torch")}
    return {"T": T, "pairs": pairs, "layer_call_ms": round(1e3 * median(times["none"]), 3),
            "native_extra_ms": round(extra["native"], 3), "torch_extra_ms": round(extra["torch"], 3),
            "native_extra_pct": round(100 * extra["native"] / (1e3 * median(times["none"])), 2)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--reps", type=int, default=7, help="interleaved timed runs per path (median; default %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    ap.add_argument("--pairs", type=int, default=201, help="interleaved runs of the in-situ layer timing "
                    "(tiny-gdn-v5 shape only; 0 skips it; default %(default)s)")
    ap.add_argument("--out", default="", help="JSON result file")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    if not native.available():
        ap.error("the C capture kernel is not available here (no compiler, or NB_NATIVE_KERNELS=0)")
    torch.set_num_threads(args.threads)
    doc = {"machine": machine(), "date": today(), "reps": args.reps,
           "command": "python bench/capture_kernel.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "shapes": {}}
    for name, H, D, dr, C in SHAPES:
        row = doc["shapes"][name] = bench_shape(H, D, dr, C, reps=args.reps)
        print(f"{name:>12} (H={H}, D={D}): native {row['native_us_per_segment']:.1f} us/segment, torch "
              f"{row['torch_us_per_segment']:.1f} us, {row['speedup']:.2f}x; "
              f"{row['native_ms_per_layer_64K']:.2f} ms per layer and 64K tokens", flush=True)
    if args.pairs > 0:
        _, H, D, dr, C = SHAPES[0]
        row = doc["in_situ"] = dict(bench_in_situ(H, D, dr, C, pairs=args.pairs), shape=SHAPES[0][0])
        print(f"in situ, one {row['T']}-token GDN layer call ({row['shape']}, {row['pairs']} interleaved pairs): "
              f"{row['layer_call_ms']:.2f} ms bare; capture adds {row['native_extra_ms']:.2f} ms (C, "
              f"{row['native_extra_pct']:.1f}%) / {row['torch_extra_ms']:.2f} ms (torch)", flush=True)
    if args.out:
        write_json(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
