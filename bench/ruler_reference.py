"""A Transformer reference row for the RULER grid: SmolLM2-135M-Instruct's Plain (the whole prompt) beside
the shipped tiny recurrent models' Plain, per task and as the six-task mean, at the grid lengths the
Transformer's window holds.

    python jobs/evaluate.py -c configs/eval_ruler_smollm2_plain.yaml     # the Transformer's rows
    python bench/ruler_reference.py                                      # -> bench/results/ruler-reference/

Reads the rows of both sweeps (results.parquet), so every number is recomputed the same way: per-task mean
score, the mean over the six tasks, and a 95% percentile bootstrap interval that resamples examples
within each task (nbcore.evals.stats, as the RULER report does). Writes reference.md, reference.json and
reference.png next to the Transformer's rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multiquery", "niah_multivalue"]


def rows(ruler: str, reference: str, tiny: list[str], label: str, length: int):
    """One frame: model, task, score; the tiny models' plain rows and the reference's icl rows at `length`."""
    import pandas as pd
    r = pd.read_parquet(ruler, columns=["backbone", "method", "task", "length", "score"])
    r = r[(r.method == "plain") & (r.length == length) & r.backbone.isin(tiny) & r.task.isin(TASKS)]
    t = pd.read_parquet(reference, columns=["method", "task", "length", "score"])
    t = t[(t.method == "icl") & (t.length == length) & t.task.isin(TASKS)]
    return pd.concat([r.rename(columns={"backbone": "model"})[["model", "task", "score"]],
                      t.assign(model=label)[["model", "task", "score"]]], ignore_index=True)


def table(df) -> dict:
    """model -> {"mean", "ci95", "n", "tasks": {task: {"mean", "n"}}} (six-task mean; complete models only)."""
    from nbcore.evals.stats import bootstrap_mean_ci
    out = {}
    for model, d in df.groupby("model", sort=False):
        if set(d.task) != set(TASKS):
            continue
        ci = bootstrap_mean_ci(d.score.to_numpy(dtype=float), strata=d.task.to_list())
        out[model] = {"mean": round(ci.estimate, 2), "ci95": [round(ci.low, 2), round(ci.high, 2)], "n": int(len(d)),
                      "tasks": {t: {"mean": round(float(g.score.mean()), 2), "n": int(len(g))}
                                for t, g in d.groupby("task")}}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ruler", default="bench/results/ruler/results.parquet", help="the tiny models' RULER rows")
    p.add_argument("--reference", default="bench/results/ruler-reference/results.parquet",
                   help="the Transformer's rows (configs/eval_ruler_smollm2_plain.yaml)")
    p.add_argument("--tiny", nargs="+", default=["tiny-gdn-v5", "tiny-mamba2-p5"], help="tiny backbones to show")
    p.add_argument("--label", default="smollm2-135m", help="the Transformer's name in the table")
    p.add_argument("--length", type=int, default=4096, help="grid length in tokens (each model's own tokenizer)")
    p.add_argument("--out", default="bench/results/ruler-reference", help="folder for reference.{md,json,png}")
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    for f in (a.ruler, a.reference):
        if not os.path.isfile(f):
            p.error(f"{f} does not exist")
    res = table(rows(a.ruler, a.reference, a.tiny, a.label, a.length))
    if a.label not in res:
        p.error(f"{a.reference}: no complete six-task {a.label} rows at {a.length} tokens")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "reference.json"), "w") as f:
        json.dump({"length": a.length, "metric": "mean over six NIAH tasks of the per-task mean score (0-100)",
                   "models": res}, f, indent=1)
        f.write("\n")
    models = list(res)
    short = {"niah_single_1": "S1", "niah_single_2": "S2", "niah_single_3": "S3", "niah_multikey_1": "MK1",
             "niah_multiquery": "MQ", "niah_multivalue": "MV"}
    lines = [f"# Plain at {a.length // 1024}K: a pretrained Transformer beside the tiny recurrent models", "",
             f"Command: `python bench/ruler_reference.py` (rows: `{a.ruler}`, `{a.reference}`).", "",
             "| model | six-task mean [95% CI] (n) | " + " | ".join(short[t] for t in TASKS) + " |",
             "|---|---|" + "---|" * len(TASKS)]
    for m in models:
        r = res[m]
        lines.append(f"| {m} | {r['mean']:.1f} [{r['ci95'][0]:.1f}, {r['ci95'][1]:.1f}] ({r['n']}) | "
                     + " | ".join(f"{r['tasks'][t]['mean']:.0f}" for t in TASKS) + " |")
    lines += ["", "Per-task columns: mean score (0-100); S1-S3 niah_single_1-3, MK1 niah_multikey_1, MQ niah_multiquery,"
              " MV niah_multivalue. Lengths count each model's own tokens.", "", "![reference](reference.png)", ""]
    with open(os.path.join(a.out, "reference.md"), "w") as f:
        f.write("\n".join(lines))
    from notebank.pipeline.reporting.common import pyplot, save_figure
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(models), 3.4))
    for i, m in enumerate(models):
        r = res[m]
        ax.bar(i, r["mean"], color="#888888" if m != a.label else "#1f77b4")
        ax.errorbar(i, r["mean"], yerr=[[r["mean"] - r["ci95"][0]], [r["ci95"][1] - r["mean"]]], color="k", capsize=4)
        ax.text(i, 2, f"n={r['n']}", ha="center", fontsize=8, color="white")
    ax.set_xticks(range(len(models)), models, rotation=15)
    ax.set_ylim(0, 100)
    ax.set_ylabel("six-task mean score (0-100)")
    ax.set_title(f"Plain at {a.length // 1024}K (95% CI)")
    save_figure(fig, os.path.join(a.out, "reference.png"))
    print(json.dumps({m: res[m]["mean"] for m in models}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
