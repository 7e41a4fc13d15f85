"""CLI: train a tiny NoteBank backbone from scratch on CPU (resumes from runs/<name>/ckpt.pt).

    python jobs/train_backbone.py --family gdn --out models/tiny-gdn --minutes 60 --seed 0
    python jobs/train_backbone.py --family gdn --out models/tiny-gdn --eval-only --length 1024 --n 50
    # grow a shipped model (deeper, wider conv; same logits at step 0) and keep training it
    # (the models/tiny-gdn-v3 recipe):
    python jobs/train_backbone.py --family gdn --out models/tiny-gdn-v3 --init-from models/tiny-gdn-v2 \
        --layers 5 --conv 8 --bigram-heads 2 --offset-heads 6:3 --prepend-layers 1 --new-layer-lr-mult 10 \
        --freeze-new-mixer --phases bind-grow --lr 5e-4 --minutes 45 --threads 1
    # continue a model of the same shapes (every tensor copied) on uuid-heavy batches, its built
    # layer 0 frozen (v3 -> v4 with --seed 0, v4 -> v5 with --seed 1 so the batches are new):
    python jobs/train_backbone.py --family gdn --out models/tiny-gdn-v5 --init-from models/tiny-gdn-v4 \
        --layers 5 --conv 8 --bigram-heads 2 --offset-heads 6:3 --freeze-mixer-layers 0 --phases uuid \
        --lr 3e-4 --minutes 42 --threads 2 --seed 1
    # Mamba-2, the same chain: from scratch with the bigram init on half the shared B/C dims, then an
    # offset layer grown first (its dt fitted to write at number starts; bench/mamba2_offset_probe.py):
    python jobs/train_backbone.py --family mamba2 --out models/tiny-mamba2-v2 --minutes 95 --bigram-heads 4 --heads 8
    python jobs/train_backbone.py --family mamba2 --out models/tiny-mamba2-v3 --init-from models/tiny-mamba2-v2 \
        --layers 5 --conv 8 --bigram-heads 4 --heads 8 --offset-heads 6:3 --prepend-layers 1 \
        --new-layer-lr-mult 10 --freeze-new-mixer --phases bind-grow --lr 5e-4 --minutes 38 --threads 2
    python jobs/train_backbone.py --family mamba2 --out models/tiny-mamba2-v4 --init-from models/tiny-mamba2-v3 \
        --layers 5 --conv 8 --bigram-heads 4 --heads 8 --offset-heads 6:3 --freeze-mixer-layers 0 \
        --phases uuid --lr 3e-4 --minutes 45 --threads 2
    # the same continuation with twice the B/C state (v4's 64 dims copied, 64 new ones at 0.3 x the
    # induction init; tiny-mamba2-v6, not shipped: bench/results/tiny-mamba2-growth.md):
    python jobs/train_backbone.py --family mamba2 --out models/tiny-mamba2-v6 --init-from models/tiny-mamba2-v4 \
        --layers 5 --conv 8 --bigram-heads 4 --heads 8 --offset-heads 6:3 --state 128 --freeze-mixer-layers 0 \
        --phases uuid --lr 3e-4 --minutes 72 --threads 2 --seed 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# glibc returns big freed tensors to the OS and page-faults them back in every step; on this 2-core
# machine that made ~40% of training time system time. Keep freed memory in the heap (2-3x faster).
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 34), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}
if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in _MALLOC.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_MALLOC})

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nbcore.tasks import ruler  # noqa: E402
from nbcore.tasks.tokenizer import build_tokenizer, load_tokenizer  # noqa: E402
from nbcore.training import backbone as bb  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--family", choices=["gdn", "mamba2"], required=True)
    ap.add_argument("--out", required=True, help="HF model dir to write")
    ap.add_argument("--minutes", type=float, default=60.0, help="total training budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--run-dir", default=None, help="checkpoint dir (default runs/<out name>)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (a GPU lease trains in minutes)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=256)
    ap.add_argument("--tokens-per-step", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lm-weight", type=float, default=0.5,
                    help="weight of the LM CE on the non-answer tokens (loss = answer CE + this x LM CE)")
    ap.add_argument("--bigram-heads", type=int, default=0,
                    help="GDN heads per layer with the bigram induction init (0: all unigram); Mamba-2: "
                         "that fraction (of --heads) of the shared B/C state dims")
    ap.add_argument("--window-heads", type=int, default=0,
                    help="GDN heads per layer whose q/k convs read a bag of the last --conv tokens")
    ap.add_argument("--offset-heads", nargs="*", default=[], metavar="QLAG:KLAG",
                    help="GDN offset-induction heads per layer, e.g. 6:3 (q reads t-6, k reads t-3); "
                         "Mamba-2: one per layer from the first (all B/C dims; dt gate fitted when grown)")
    ap.add_argument("--conv", type=int, default=4, help="short-conv kernel size")
    ap.add_argument("--state", type=int, default=64,
                    help="Mamba-2 state size per B/C group. With --init-from a smaller state, the new dims "
                         "start near 0 (see grow_from)")
    ap.add_argument("--new-state-scale", type=float, default=bb.NEW_STATE_SCALE,
                    help="with --init-from a smaller --state: the new state dims' in_proj rows, x the fresh init")
    ap.add_argument("--groups", type=int, default=1,
                    help="Mamba-2 B/C groups (n_groups; must divide the heads). With --init-from a "
                         "model with fewer groups, each new group starts as a copy of its source group")
    ap.add_argument("--init-from", default=None,
                    help="HF model dir to grow from (same family and tokenizer; see grow_from)")
    ap.add_argument("--prepend-layers", type=int, default=0,
                    help="with --init-from: how many of the new layers go before the source's layers")
    ap.add_argument("--new-layer-lr-mult", type=float, default=1.0,
                    help="with --init-from: lr multiplier of the new layers")
    ap.add_argument("--freeze-new-mixer", action="store_true",
                    help="with --init-from: train only the new layers' read-out (out_proj, gate, MLP)")
    ap.add_argument("--product-layer", choices=sorted(bb.PRODUCT_LAGS), default="",
                    help="Mamba-2, from scratch or with --init-from and --prepend-layers 1: build layer 0 as a "
                         "bigram product layer (x = token t-lag, gated by token t; see _init_mamba2_product)")
    ap.add_argument("--freeze-mixer-layers", type=int, nargs="*", default=[],
                    help="layers whose q/k/v/conv/gates stay as loaded (e.g. 0: a grown model's built layer)")
    ap.add_argument("--phases", choices=sorted(bb.PHASES), default=None,
                    help="length curriculum (default: grow with --init-from, else scratch)")
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--length", type=int, nargs="*", default=[1024])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--tasks", nargs="*", default=list(ruler.PAPER_SIX))
    ap.add_argument("--write-readme", action="store_true",
                    help="with --eval-only: record the scores in train_meta.json and README.md")
    args = ap.parse_args(argv)
    # grow-only options would otherwise be dropped without a word on a from-scratch run
    grow_only = [flag for flag, given in (
        ("--prepend-layers", args.prepend_layers != 0),
        ("--new-layer-lr-mult", args.new_layer_lr_mult != 1.0),
        ("--freeze-new-mixer", args.freeze_new_mixer),
        ("--new-state-scale", args.new_state_scale != bb.NEW_STATE_SCALE)) if given]
    if grow_only and not args.init_from and not args.eval_only:
        ap.error(f"{', '.join(grow_only)} only apply with --init-from (growing a shipped model)")

    out = Path(args.out)
    run_dir = Path(args.run_dir) if args.run_dir else ROOT / "runs" / out.name
    if args.eval_only:
        import torch
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(args.threads)
        tok = load_tokenizer(out)
        model = AutoModelForCausalLM.from_pretrained(out).to(args.device)
        evals = []
        for L in args.length:
            t = time.time()
            res = bb.evaluate(model, tok, args.tasks, L, args.n, seed=args.seed)
            evals.append({"length": L, "n": args.n, "scores": res,
                          "seconds": round(time.time() - t, 1)})
            print(json.dumps(evals[-1]), flush=True)
        if args.write_readme:
            meta_path = out / "train_meta.json"
            meta = json.loads(meta_path.read_text())
            old = [e for e in meta.get("eval", [])
                   if (e["length"], e["n"]) not in {(x["length"], x["n"]) for x in evals}]
            meta["eval"] = sorted(old + evals, key=lambda e: e["length"])
            meta_path.write_text(json.dumps(meta, indent=2))
            bb.write_readme(out, meta, meta["eval"])
        return 0

    # resume: reuse the tokenizer already written next to the model (it is the canonical one)
    # (a grown model keeps its source's tokenizer: the embeddings are indexed by it)
    tok_dir = out if (out / "tokenizer.json").is_file() else (Path(args.init_from) if args.init_from else None)
    tok = load_tokenizer(tok_dir) if tok_dir else build_tokenizer()
    mc = bb.ModelConfig(family=args.family, layers=args.layers, hidden=args.hidden, heads=args.heads, mlp=args.mlp,
                        conv=args.conv, state=args.state, groups=args.groups,
                        bigram_heads=args.bigram_heads, window_heads=args.window_heads,
                        offset_heads=tuple(tuple(int(x) for x in o.split(":")) for o in args.offset_heads))
    phases = args.phases or ("grow" if args.init_from else "scratch")
    tc = bb.TrainConfig(minutes=args.minutes, seed=args.seed, threads=args.threads, device=args.device,
                        tokens_per_step=args.tokens_per_step, lr=args.lr, lm_weight=args.lm_weight, init_from=args.init_from,
                        grow_prepend=args.prepend_layers, new_layer_lr_mult=args.new_layer_lr_mult,
                        freeze_new_mixer=args.freeze_new_mixer,
                        freeze_mixer_layers=tuple(args.freeze_mixer_layers),
                        new_state_scale=args.new_state_scale, product_layer=args.product_layer,
                        phases=list(bb.PHASES[phases]))
    bb.train(mc, tc, out, run_dir, tok, log=lambda s: print(time.strftime("%H:%M:%S"), s, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
