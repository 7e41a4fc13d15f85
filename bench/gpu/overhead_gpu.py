"""GPU latency + peak memory: Plain vs NB-TF top-2 on random-init 1.3B-scale shapes.

--shape gdn13b (default): GDN-1.3B with flash-linear-attention kernels; --shape mamba2: Mamba-2-1.3B
shapes through transformers (mamba-ssm kernels when installed); --shape hybrid: a Qwen3.5-style
3:1 GDN/attention hybrid through transformers (fla kernels when installed); --shape tiny: CPU smoke.

One prepared script for a scarce GPU lease (< 8 minutes on one H200): builds GDN-1.3B from its
config (hidden 2048, 24 layers, 8 heads, d_k=d_v=256, MLP 5632, vocab 32000; speed needs no
pretrained weights) in BF16 with flash-linear-attention, then for each length runs Plain and
NB-TF (C=512, W=2, B=64, R=2) with 32 generated tokens, batch 1, alternating order, medians,
and torch.cuda.max_memory_allocated per method. Prints one JSON document (also to --out).

    python bench/gpu/overhead_gpu.py --lengths 64K,256K,1M --reps 3 --out $OUT/overhead-gpu.json
    python bench/gpu/overhead_gpu.py --tiny --device cpu --lengths 2K --reps 1   # CPU smoke (tests)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

from bench.common import machine, median, timed, today, write_json  # noqa: E402
from bench.overhead import parse_len, run_once  # noqa: E402
from nbcore import NoteBankConfig, load_backbone  # noqa: E402

GDN_1_3B = dict(hidden_size=2048, num_hidden_layers=24, num_heads=8, head_dim=256, expand_v=1,
                intermediate_size=5632, vocab_size=32000, conv_size=4, use_short_conv=True)
# Mamba-2 1.3B shapes (state-spaces/mamba2-1.3b) as a transformers Mamba2Config.
MAMBA2_1_3B = dict(hidden_size=2048, num_hidden_layers=48, num_heads=64, head_dim=64, expand=2,
                   state_size=128, n_groups=1, vocab_size=50288, conv_kernel=4, chunk_size=256)
# A Qwen3.5-style 3:1 GDN/attention hybrid at ~1.5B scale (transformers qwen3_5 text).
QWEN35_HYBRID = dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=6144, vocab_size=32000,
                     linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                     linear_value_head_dim=128, linear_conv_kernel_dim=4, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=256,
                     layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6)
SHAPES = ("gdn13b", "mamba2", "hybrid", "tiny")


def build(args):
    """-> (backbone, description) for --shape (random init: speed needs no pretrained weights)."""
    from transformers import AutoConfig
    shape = "tiny" if args.tiny else args.shape
    dtype = torch.float32 if str(args.device) == "cpu" else torch.bfloat16
    if shape == "tiny":
        from nbcore.testing import tiny_gdn_config
        return load_backbone(tiny_gdn_config(), device=args.device), "tiny random-init qwen3_5 GDN"
    if shape == "gdn13b":
        import fla.models  # noqa: F401  (registers gated_deltanet with transformers)
        cfg = AutoConfig.for_model("gated_deltanet", **GDN_1_3B)
        return load_backbone(cfg, device=args.device, dtype=dtype), "random-init GDN-1.3B (fla, bf16)"
    if shape == "mamba2":
        cfg = AutoConfig.for_model("mamba2", **MAMBA2_1_3B)
        return load_backbone(cfg, device=args.device, dtype=dtype), "random-init Mamba-2-1.3B shapes (transformers)"
    cfg = AutoConfig.for_model("qwen3_5_text", **QWEN35_HYBRID)
    return load_backbone(cfg, device=args.device, dtype=dtype), "random-init Qwen3.5-style 3:1 hybrid (transformers)"


def peak_reset(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        return round(torch.cuda.max_memory_allocated() / 2 ** 30, 3)
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="64K,256K,1M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--block", type=int, default=65536)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="gdn13b", choices=SHAPES, help="model shapes (default: %(default)s)")
    ap.add_argument("--tiny", action="store_true", help="= --shape tiny: CPU-friendly model (smoke test of the script)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    lengths = [x for x in args.lengths.split(",") if x]
    for x in lengths:
        parse_len(x)                                   # fail early on a bad length
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device: use --device cpu --tiny for a smoke run")
    bb, model_name = build(args)
    vocab = bb.model.config.vocab_size
    cfg = NoteBankConfig()
    g = torch.Generator().manual_seed(0)
    res = {}
    warmed = False
    for name in lengths:
        T = parse_len(name)
        ids = torch.randint(3, vocab, (T,), generator=g).numpy()
        question = torch.randint(3, vocab, (48,), generator=g).tolist()
        if not warmed:
            # warm every kernel shape the timed runs use: a full block plus a short tail block
            # (2026-11-29: warming on 8K only left Triton autotuning inside the first timed 64K run)
            w = ids[: min(T, args.block + 1000)]
            run_once(bb, w, question, "plain", cfg, args.gen, args.block)
            run_once(bb, w, question, "notebank", cfg, args.gen, args.block)
            warmed = True
        times, peaks = {"plain": [], "notebank": []}, {}
        for r in range(args.reps):
            for m in (("plain", "notebank") if r % 2 == 0 else ("notebank", "plain")):
                peak_reset(args.device)
                dt, _ = timed(run_once, bb, ids, question, m, cfg, args.gen, args.block)
                times[m].append(dt)
                peaks[m] = peak_gib(args.device)
        p, n = median(times["plain"]), median(times["notebank"])
        res[name] = {"plain_s": round(p, 3), "nb_s": round(n, 3), "ratio": round(n / p, 4),
                     "plain_peak_gib": peaks["plain"], "nb_peak_gib": peaks["notebank"]}
        print(json.dumps({name: res[name]}), flush=True)
        if args.out:                                  # partial results survive a lease that ends early
            write_json(args.out, {"machine": machine(), "date": today(), "model": model_name,
                                  "lengths": res, "partial": True})
    doc = {"machine": machine(), "date": today(), "model": model_name, "shape": "tiny" if args.tiny else args.shape,
           "lengths": res,
           "command": "python bench/gpu/overhead_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(json.dumps(doc))
    if args.out:
        write_json(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
