"""Evaluation report: summary.json, Markdown tables and PNG plots from per-example rows.

Input rows carry at least: backbone, method, task, length, score, archived_cov, retrieved_cov,
ingest_s, probe_s, route_s, replay_generate_s. `summary.json` maps
"<backbone>/<method>/<length label>" to the mean over tasks (six-task mean when all of the
paper's six are present) on 0-100.
"""
from __future__ import annotations

import json
import os

import numpy as np


def length_label(n: int) -> str:
    n = int(n)
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}K"
    return str(n)


def _df(rows):
    import pandas as pd
    return rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))


def summarize(rows) -> dict:
    """-> {"<backbone>/<method>/<len>": mean over tasks of the per-task mean score}."""
    df = _df(rows)
    out = {}
    per_task = df.groupby(["backbone", "method", "length", "task"])["score"].mean().reset_index()
    for (bb, m, n), g in per_task.groupby(["backbone", "method", "length"]):
        out[f"{bb}/{m}/{length_label(n)}"] = round(float(g["score"].mean()), 2)
    return dict(sorted(out.items()))


def _md_table(df, index, columns, values, fmt="{:.1f}") -> str:
    piv = df.pivot_table(index=index, columns=columns, values=values, aggfunc="mean")
    cols = list(piv.columns)
    head = "| " + " | ".join([str(index)] + [length_label(c) if isinstance(c, (int, np.integer)) else str(c) for c in cols]) + " |"
    sep = "|" + "---|" * (len(cols) + 1)
    lines = [head, sep]
    for idx, row in piv.iterrows():
        cells = ["" if np.isnan(v) else fmt.format(v) for v in row.values]
        lines.append("| " + " | ".join([str(idx)] + cells) + " |")
    return "\n".join(lines)


def plot_accuracy_vs_length(df, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bbs = sorted(df["backbone"].unique())
    fig, axes = plt.subplots(1, len(bbs), figsize=(6.5 * len(bbs), 4.6), squeeze=False)
    for ax, bb in zip(axes[0], bbs):
        d = df[df.backbone == bb].groupby(["method", "length", "task"])["score"].mean().reset_index()
        d = d.groupby(["method", "length"])["score"].mean().reset_index()
        for m, g in d.groupby("method"):
            g = g.sort_values("length")
            style = "--" if not m.startswith("nb-") else "-"
            ax.plot(g["length"], g["score"], style, marker="o", label=m, linewidth=2 if m == "nb-tf-top2" else 1.2)
        ax.set_xscale("log", base=2)
        lengths = sorted(d["length"].unique())
        ax.set_xticks(lengths, [length_label(x) for x in lengths])
        ax.set_ylim(-3, 103)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("mean RULER score (0-100)")
        ax.set_title(bb)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle("Accuracy vs context length (dashed: no NoteBank)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_coverage(df, path: str, method: str = "nb-tf-top2") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    d = df[df.method == method]
    if d.empty:
        return
    bbs = sorted(d["backbone"].unique())
    fig, axes = plt.subplots(1, len(bbs), figsize=(6.5 * len(bbs), 4.2), squeeze=False)
    for ax, bb in zip(axes[0], bbs):
        g = d[d.backbone == bb].groupby("length")[["archived_cov", "retrieved_cov"]].mean().sort_index()
        x = np.arange(len(g))
        ax.bar(x - 0.2, g["archived_cov"], 0.4, label="archived")
        ax.bar(x + 0.2, g["retrieved_cov"], 0.4, label=f"retrieved ({method})")
        ax.set_xticks(x, [length_label(v) for v in g.index])
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("gold-value coverage")
        ax.set_title(bb)
        ax.legend()
    fig.suptitle("Evidence preserved vs accessed (paper Fig. 5a)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_routers(df, path: str, r: int = 2) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    d = df[df.method.str.match(rf"^nb-[a-z_0-9]+-top{r}$")]
    if d.empty:
        return
    bbs = sorted(d["backbone"].unique())
    fig, axes = plt.subplots(1, len(bbs), figsize=(6.5 * len(bbs), 4.2), squeeze=False)
    for ax, bb in zip(axes[0], bbs):
        g = d[d.backbone == bb].groupby(["method", "length"])["score"].mean().unstack("length")
        lengths = list(g.columns)
        w = 0.8 / max(1, len(g))
        for k, (m, row) in enumerate(g.iterrows()):
            ax.bar(np.arange(len(lengths)) + k * w, row.values, w, label=m)
        ax.set_xticks(np.arange(len(lengths)) + 0.4 - w / 2, [length_label(v) for v in lengths])
        ax.set_ylim(0, 103)
        ax.set_ylabel("mean score")
        ax.set_title(bb)
        ax.legend(fontsize=7)
    fig.suptitle(f"Routers side by side, top-{r} (paper Table 3)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cost(df, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    d = df[df.method.isin(["plain", "nb-tf-top2"])].copy()
    if d.empty:
        return
    d["total_s"] = d["ingest_s"] + d["probe_s"] + d["route_s"] + d["replay_generate_s"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for (bb, m), g in d.groupby(["backbone", "method"]):
        g = g.groupby("length")["total_s"].mean().sort_index()
        ax.plot(g.index, g.values, marker="o", label=f"{bb} {m}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("wall time per example (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Cost vs length (ingest + probe + route + replay/generate)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(rows, out_dir: str, title: str = "RULER evaluation", meta: dict | None = None) -> dict:
    """Write summary.json, report.md and plots under out_dir. -> summary dict."""
    df = _df(rows)
    os.makedirs(out_dir, exist_ok=True)
    summary = summarize(df)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    plot_accuracy_vs_length(df, os.path.join(out_dir, "accuracy_vs_length.png"))
    plot_coverage(df, os.path.join(out_dir, "coverage.png"))
    plot_routers(df, os.path.join(out_dir, "routers.png"))
    plot_cost(df, os.path.join(out_dir, "cost_vs_length.png"))
    lines = [f"# {title}", ""]
    for k, v in (meta or {}).items():
        lines.append(f"- **{k}**: {v}")
    n_ex = df.groupby(["backbone", "task", "length"])["index"].nunique()
    lines += [f"- examples per (backbone, task, length): {int(n_ex.min())}-{int(n_ex.max())}",
              f"- tasks: {', '.join(sorted(df.task.unique()))}", "",
              "![accuracy vs length](accuracy_vs_length.png)", "",
              "![coverage](coverage.png) ![routers](routers.png)", "", "![cost](cost_vs_length.png)", ""]
    for bb in sorted(df.backbone.unique()):
        d = df[df.backbone == bb]
        mean_over_tasks = d.groupby(["method", "length", "task"])["score"].mean().reset_index()
        lines += [f"## {bb}", "", "### Mean over tasks (0-100)", "",
                  _md_table(mean_over_tasks, "method", "length", "score"), ""]
        for task in sorted(d.task.unique()):
            lines += [f"### {task}", "", _md_table(d[d.task == task], "method", "length", "score"), ""]
        nb = d[d.method.str.startswith("nb-")]
        if not nb.empty:
            lines += ["### Coverage (archived | retrieved), mean over tasks", "",
                      _md_table(nb, "method", "length", "archived_cov", "{:.2f}"), "",
                      _md_table(nb, "method", "length", "retrieved_cov", "{:.2f}"), ""]
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return summary
