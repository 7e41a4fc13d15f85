"""MoNe ablations on the small case of ../shared/notes/mone-findings.md.

One key -> value pair in random filler, written into a fresh memory; the query asks for the value
(16 possible values: ln 16 = 2.77 nats is no information). Base: a random 2-layer Qwen2 (hidden
128, 4 heads / 2 KV heads), frozen; memory: 4 heads of D = 32, LoRA rank 4. Each variant is trained
from scratch with the same seed, data and optimizer (AdamW 3e-3, the shipped rate/gate group at 10x
lr, batch 16) in two regimes:

- ``curriculum``: 250 steps at T = 16, then T = 128 (what made the paper form retrieve);
- ``t128``: T = 128 from step 0 (where the paper form barely learns: the needle is 2 of 128 tokens).

Every ``--eval-every`` steps, on 128 held-out contexts at T = 128: answer accuracy and CE with the
example's own memory and with another example's (i reads i+1).

    OMP_NUM_THREADS=1 python lab/probes/mone_ablations.py --out lab/results/mone_ablations
    python lab/probes/mone_ablations.py --out lab/results/mone_ablations --report   # table + plot

Resumable per (variant, regime, seed): each finished run is one JSON file under --out.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from nbcore.mone import memory as mem
from nbcore.mone.model import MoNeConfig, MoNeModel
from nbcore.training import mone as tm

VOCAB = 256
MARK, QMARK = 1, 2                 # the needle is [MARK, value]; the query [QMARK, MARK] -> value
VALUES = torch.arange(16, 32)      # 16 possible values
FILLER = (32, VOCAB)

VARIANTS = {
    "paper": {},
    "center_values": {"center_values": True},
    "center_keys_values": {"center_keys": True, "center_values": True},
    "key_rope_off": {"key_rope": False},
}
REGIMES = {
    "curriculum": [(250, 16), (10**9, 128)],   # (steps, T); the last stage runs to the end
    "t128": [(10**9, 128)],
}


def base(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, use_sliding_window=False)
    return Qwen2ForCausalLM(cfg).eval()


def contexts(g: torch.Generator, b: int, T: int):
    """b one-segment contexts [b, 1, T] of filler with the needle at a random place; queries [b, 3]."""
    v = VALUES[torch.randint(0, len(VALUES), (b,), generator=g)]
    ctx = torch.randint(*FILLER, (b, T), generator=g)
    at = torch.randint(0, T - 1, (b,), generator=g)
    ctx[torch.arange(b), at] = MARK
    ctx[torch.arange(b), at + 1] = v
    q = torch.stack([torch.full((b,), QMARK), torch.full((b,), MARK), v], 1)
    return ctx.view(b, 1, T), q


@torch.no_grad()
def evaluate(model: MoNeModel, n: int = 128, T: int = 128) -> dict:
    g = torch.Generator().manual_seed(10_000)
    ctx, q = contexts(g, n, T)
    fast = model.write(model.fresh(n), ctx, torch.ones_like(ctx, dtype=torch.bool))
    other_fast = [mem.FastWeights(**{k: t.roll(1, 0) for k, t in fw.tensors().items()}) for fw in fast]
    out = {}
    for name, fw in (("own", fast), ("other", other_fast)):
        lg = model.logits(q, fw)[:, -2]
        out[f"{name}_ce"] = round(float(F.cross_entropy(lg, q[:, -1])), 4)
        out[f"{name}_acc"] = round(float((lg.argmax(-1) == q[:, -1]).float().mean()), 4)
    return out


def run(variant: str, regime: str, seed: int, steps: int, eval_every: int, batch: int = 16) -> dict:
    torch.manual_seed(seed)
    cfg = MoNeConfig(segment_len=128, mem_heads=4, lora_rank=4, lora_alpha=4, gate_init=1.0,
                     **VARIANTS[variant])
    model = MoNeModel(base(), cfg)
    tc = tm.MetaTrainConfig(lr=3e-3, rate_lr_mult=10.0)
    opt = torch.optim.AdamW(tm.param_groups(model, tc), lr=tc.lr)
    g = torch.Generator().manual_seed(seed)
    curve, t0 = [], time.time()
    for step in range(1, steps + 1):
        done, T = 0, None
        for n_steps, t in REGIMES[regime]:
            T = t
            if step <= done + n_steps:
                break
            done += n_steps
        ctx, q = contexts(g, batch, T)
        fast = model.write(model.fresh(batch), ctx, torch.ones_like(ctx, dtype=torch.bool))
        loss = F.cross_entropy(model.logits(q, fast)[:, -2], q[:, -1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.trainable_parameters(), 1.0)
        opt.step()
        if step % eval_every == 0:
            curve.append({"step": step, "T": T, **evaluate(model)})
            print(json.dumps({"variant": variant, "regime": regime, "seed": seed, **curve[-1]}), flush=True)
    return {"variant": variant, "regime": regime, "seed": seed, "steps": steps, "batch": batch,
            "seconds": round(time.time() - t0, 1), "curve": curve}


def report(out: Path) -> None:
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.name != "summary.json"]
    lines = ["| regime | variant | seeds | own acc, mean over the run | own acc (last) | other acc (last) | own CE | other CE | first step own acc >= 0.9 |",
             "|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for regime in REGIMES:
        for variant in VARIANTS:
            rs = [r for r in rows if r["variant"] == variant and r["regime"] == regime]
            if not rs:
                continue
            last = [r["curve"][-1] for r in rs]
            mean = {k: sum(x[k] for x in last) / len(last) for k in ("own_acc", "other_acc", "own_ce", "other_ce")}
            auc = sum(sum(c["own_acc"] for c in r["curve"]) / len(r["curve"]) for r in rs) / len(rs)
            first = [next((c["step"] for c in r["curve"] if c["own_acc"] >= 0.9 and c["T"] == 128), None) for r in rs]
            summary[f"{regime}/{variant}"] = {**{k: round(v, 4) for k, v in mean.items()}, "n_seeds": len(rs),
                                              "own_acc_mean_over_run": round(auc, 4),
                                              "first_step_acc_0.9": first}
            lines.append(f"| {regime} | {variant} | {len(rs)} | {auc:.3f} | {mean['own_acc']:.3f} | {mean['other_acc']:.3f} | "
                         f"{mean['own_ce']:.3f} | {mean['other_ce']:.3f} | {', '.join(str(f) for f in first)} |")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(REGIMES), figsize=(11, 4), sharey=True)
    for ax, regime in zip(axes, REGIMES):
        for i, variant in enumerate(VARIANTS):
            for r in rows:
                if r["variant"] == variant and r["regime"] == regime:
                    st = [c["step"] for c in r["curve"]]
                    ax.plot(st, [c["own_acc"] for c in r["curve"]], color=f"C{i}",
                            label=f"{variant} (own)" if r["seed"] == 0 else None)
                    ax.plot(st, [c["other_acc"] for c in r["curve"]], color=f"C{i}", ls=":", alpha=0.6)
        ax.set_title({"curriculum": "curriculum: T = 16, then 128 from step 251", "t128": "T = 128 from step 0"}[regime])
        ax.set_xlabel("step")
        ax.axhline(1 / len(VALUES), color="grey", lw=0.5)
    axes[0].set_ylabel("answer accuracy at T = 128 (n = 128)")
    fig.suptitle("MoNe ablations, small random base: solid = own memory, dotted = another example's", fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ablations.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("lab/results/mone_ablations"))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--report", action="store_true", help="only write summary.md/json and ablations.png")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if not a.report:
        for seed in a.seeds:
            for regime in a.regimes:
                for variant in a.variants:
                    path = a.out / f"{regime}-{variant}-s{seed}.json"
                    if path.exists():
                        continue
                    path.write_text(json.dumps(run(variant, regime, seed, a.steps, a.eval_every), indent=1) + "\n")
    report(a.out)


if __name__ == "__main__":
    main()
