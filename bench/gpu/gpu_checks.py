"""GPU correctness checks that CPU CI cannot run (one short script for a scarce lease, ~1 minute).

1. fla GatedDeltaNet (Triton kernels, bf16): chunked prefill with carried state vs one full pass
   (logits + recurrent state), a copied state is independent of the original (bit-identical
   original after the copy advances), archives do not depend on block_size, two ingests give
   bit-identical archives (determinism).
2. The shipped tiny-gdn (transformers qwen3_5; the chunk kernel it resolved to is reported):
   CUDA fp32 vs CPU fp32 on a generated RULER document: same note spans, address max-abs diff,
   same greedy Plain and NB-TF answers.

Each check is isolated (an exception is recorded, the others still run). Prints one JSON document.

    python bench/gpu/gpu_checks.py --out $OUT/gpu-checks.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import machine, today, write_json  # noqa: E402
from nbcore import NoteBankConfig, ReadConfig, load_backbone  # noqa: E402
from nbcore.reader import answer, ingest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max())


def same_archive(a, b) -> dict:
    spans_equal = len(a) == len(b) and bool(np.array_equal(a.starts, b.starts) and np.array_equal(a.ends, b.ends))
    out = {"notes": [len(a), len(b)], "spans_equal": spans_equal}
    if spans_equal and len(a):
        out["addr_max_abs_diff"] = max_diff(a.addresses, b.addresses)
        out["addr_bit_identical"] = bool(torch.equal(a.addresses.cpu(), b.addresses.cpu()))
    return out


def check_fla_gdn() -> dict:
    import fla.models  # noqa: F401  (registers gated_deltanet with transformers)
    from transformers import AutoConfig
    cfg = AutoConfig.for_model("gated_deltanet", hidden_size=512, num_hidden_layers=4, num_heads=4,
                               head_dim=128, vocab_size=4096, intermediate_size=1024)
    return check_replay_invariants(load_backbone(cfg, device="cuda", dtype=torch.bfloat16), 4096)


def check_tiny_cpu_invariants() -> dict:
    """The same invariants on a tiny qwen3_5 GDN on CPU (the script's CI smoke form)."""
    from nbcore.testing import tiny_gdn_config
    cfg = tiny_gdn_config()
    return check_replay_invariants(load_backbone(cfg, device="cpu"), cfg.vocab_size)


def check_replay_invariants(bb, vocab: int) -> dict:
    """chunked prefill == one pass, a copied state is independent, archives independent of the
    block size and bit-deterministic."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3000,), generator=g)
    out = {"backbone": type(bb).__name__, "channels": bb.n_channels, "key_dim": bb.key_dim}
    s_full, s_chunk = bb.new_state(), bb.new_state()
    l_full = bb.forward(s_full, ids)
    bb.forward(s_chunk, ids[:1000])
    bb.forward(s_chunk, ids[1000:2047])
    l_chunk = bb.forward(s_chunk, ids[2047:])
    out["chunked_vs_full_last_logits_max_abs"] = max_diff(l_full, l_chunk)
    tf, tc = bb.state_to_tensors(s_full), bb.state_to_tensors(s_chunk)
    out["chunked_vs_full_state_max_abs"] = max(max_diff(tf[k], tc[k]) for k in tf)
    out["state_max_abs"] = max(float(tf[k].float().abs().max()) for k in tf)
    before = {k: v.clone() for k, v in tf.items()}
    c = bb.copy_state(s_full)
    bb.forward(c, ids[:200])
    after = bb.state_to_tensors(s_full)
    out["copy_leaves_original_bit_identical"] = all(torch.equal(before[k], after[k]) for k in before)
    tcopy = bb.state_to_tensors(c)
    out["copy_advanced"] = any(not torch.equal(before[k], tcopy[k]) for k in before)
    nb = NoteBankConfig(chunk_size=256, note_budget=32, window=16, tail=8)
    a1 = ingest(bb, token_ids=ids.numpy(), cfg=nb, block_size=2048).archive
    a2 = ingest(bb, token_ids=ids.numpy(), cfg=nb, block_size=256).archive
    a3 = ingest(bb, token_ids=ids.numpy(), cfg=nb, block_size=2048).archive
    out["archive_block2048_vs_block256"] = same_archive(a1, a2)
    out["archive_rerun_determinism"] = same_archive(a1, a3)
    return out


def check_tiny_gdn_cuda_vs_cpu(device: str = "cuda", n: int = 3, length: int = 8192) -> dict:
    """The shipped tiny GDN on `device` vs CPU: the same archives and answers (same weights)."""
    from nbcore.tasks import ruler
    path = os.path.join(REPO, "models", "tiny-gdn")
    cpu = load_backbone(path, device="cpu")
    gpu = load_backbone(path, device=device)
    out = {"qwen3_5_chunk_kernel": _qwen35_uses_fla(gpu)}
    nb = NoteBankConfig()
    agree = {"spans_equal": 0, "plain_same": 0, "nb_same": 0, "n": 0, "addr_max_abs_diff": 0.0}
    for i in range(n):
        ex = ruler.generate("niah_single_1", length, i, cpu.tokenizer, seed=0)
        rc_p = ReadConfig(method="plain", max_new_tokens=16)
        rc_n = ReadConfig(method="notebank", top_r=2, max_new_tokens=16)
        rs = {}
        for name, bb in (("cpu", cpu), ("cuda", gpu)):        # "cuda" = the device under test
            res = ingest(bb, ex["context"], nb)
            rs[name] = (res, answer(bb, res.state, res.archive, ex["question"], rc_p).text,
                        answer(bb, res.state, res.archive, ex["question"], rc_n).text)
        s = same_archive(rs["cpu"][0].archive, rs["cuda"][0].archive)
        agree["n"] += 1
        agree["spans_equal"] += int(s["spans_equal"])
        agree["addr_max_abs_diff"] = max(agree["addr_max_abs_diff"], s.get("addr_max_abs_diff", 0.0))
        agree["plain_same"] += int(rs["cpu"][1] == rs["cuda"][1])
        agree["nb_same"] += int(rs["cpu"][2] == rs["cuda"][2])
    out.update(agree)
    return out


def _qwen35_uses_fla(bb) -> str:
    """Which chunk kernel transformers' qwen3_5 module resolved to (hub kernel or torch fallback)."""
    import importlib
    mod = importlib.import_module(type(bb.model).__module__)
    f = getattr(mod, "torch_chunk_gated_delta_rule", None)
    return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', f)}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke form (CI): tiny models, CPU vs CPU")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        ap.error("no CUDA device (use --smoke for the CPU form)")
    doc = {"machine": machine(), "date": today(), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "checks": {}}
    try:
        import fla
        doc["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        doc["fla"] = None
    checks = (("tiny_invariants_cpu", check_tiny_cpu_invariants),
              ("tiny_gdn_cpu_vs_cpu", lambda: check_tiny_gdn_cuda_vs_cpu("cpu", 1, 2048))) if args.smoke else \
        (("fla_gdn", check_fla_gdn), ("tiny_gdn_cuda_vs_cpu", check_tiny_gdn_cuda_vs_cpu))
    for name, fn in checks:
        try:
            doc["checks"][name] = fn()
        except Exception as e:  # noqa: BLE001 - record and go on: one lease, many checks
            doc["checks"][name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        print(json.dumps({name: doc["checks"][name]}, default=str), flush=True)
        if args.out:
            write_json(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
