"""Report of the MoNe evaluation (pipeline/evaluate_mone.py): summary.json, cost.json, rag_by_k.json,
report.md and two plots, from the per-example rows of ``nbcore.evals.mone`` (nbcore.mone.evaluation).

Keys are "[<label>/]<method>/<task>/<length>" with task the short label (s_niah, mk_niah, fwe), length the
target context length in tokens and label the model (e.g. smollm2-135m; none for the tiny Qwen2 base).
summary.json values are {"mean": 0-100, "n": examples, "ci95": [lo, hi]} (bootstrap over examples).
Every rag method (rag, rag-bm25, rag-dense) is reported at its best K per (task, length), as the paper
does ("best of K in {1, 4, 8} per length"); every K is in rag_by_k.json and the report.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd

from notebank.pipeline.reporting.common import pyplot, save_figure, start_report, write_markdown

COST_COLS = ("write_flops", "query_flops", "write_peak_bytes", "query_peak_bytes", "write_s", "query_s",
             "context_tokens", "prompt_tokens", "memory_tokens", "state_bytes")
METHOD_ORDER = ("mone", "icl", "rag", "rag-bm25", "rag-dense")


def is_rag(method: str) -> bool:
    return method == "rag" or method.startswith("rag-")


def key(method: str, task: str, length: int, label: str = "") -> str:
    return f"{label + '/' if label else ''}{method}/{task}/{int(length)}"


def rag_by_k(df: pd.DataFrame) -> pd.DataFrame:
    """Mean score and answer recall of the retrieved chunks per (rag method, task, length, K)."""
    r = df[df.method.map(is_rag)]
    if r.empty:
        return pd.DataFrame(columns=["method", "task_label", "length", "rag_k", "score", "rag_recall", "n"])
    return (r.groupby(["method", "task_label", "length", "rag_k"])
            .agg(score=("score", "mean"), rag_recall=("rag_recall", "mean"), n=("score", "size"))
            .reset_index())


def best_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of mone/icl, plus each rag method's rows of its best K per (task, length) (ties: smallest K)."""
    other = df[~df.method.map(is_rag)]
    byk = rag_by_k(df)
    if byk.empty:
        return other
    cols = ["method", "task_label", "length"]
    best = (byk.sort_values([*cols, "score", "rag_k"], ascending=[True, True, True, False, True])
            .groupby(cols).head(1)[[*cols, "rag_k"]])
    rag = df[df.method.map(is_rag)].merge(best, on=[*cols, "rag_k"])
    return pd.concat([other, rag], ignore_index=True)


def summarize(df: pd.DataFrame, label: str = "") -> dict:
    """"[<label>/]<method>/<task>/<length>" -> {"mean": 0-100, "n", "ci95"} (rag: best K)."""
    from nbcore.evals.stats import bootstrap_mean_ci
    out = {}
    for (m, t, L), d in best_rows(df).groupby(["method", "task_label", "length"]):
        ci = bootstrap_mean_ci(d["score"].to_numpy(dtype=float))
        out[key(m, t, L, label)] = {"mean": round(float(d["score"].mean()), 2), "n": int(len(d)),
                                    "ci95": [round(float(ci.low), 2), round(float(ci.high), 2)]}
    return dict(sorted(out.items()))


def cost_table(df: pd.DataFrame, label: str = "") -> dict:
    """"[<label>/]<method>/<task>/<length>" -> mean cost per example (rag: the best K's rows)."""
    b = best_rows(df)
    out = {}
    for (m, t, L), d in b.groupby(["method", "task_label", "length"]):
        rec = {"n": int(len(d))}
        for c in COST_COLS:
            if c in d:
                v = d[c].dropna()
                rec[c] = None if v.empty else (float(v.mean()) if c.endswith("_s") else int(round(v.mean())))
        if is_rag(m):
            rec["rag_k"] = int(d.rag_k.iloc[0])
        out[key(m, t, L, label)] = rec
    return dict(sorted(out.items()))


def _md_table(piv: pd.DataFrame, fmt: str) -> str:
    cols = list(piv.columns)
    lines = ["| " + " | ".join([str(piv.index.name or "")] + [str(c) for c in cols]) + " |",
             "|" + "---|" * (len(cols) + 1)]
    for idx, row in piv.iterrows():
        cells = ["" if (v is None or (isinstance(v, float) and np.isnan(v))) else fmt.format(v) for v in row.values]
        lines.append("| " + " | ".join([str(idx)] + cells) + " |")
    return "\n".join(lines)


def _methods(df) -> list[str]:
    present = list(df.method.unique())
    return [m for m in METHOD_ORDER if m in present] + sorted(m for m in present if m not in METHOD_ORDER)


def _length_ticks(ax, lengths) -> None:
    lengths = sorted(int(x) for x in lengths)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{x // 1024}K" if x >= 1024 and x % 1024 == 0 else str(x) for x in lengths])
    ax.minorticks_off()


def plot_accuracy(df: pd.DataFrame, path: str) -> None:
    """Score vs context length, one panel per task, one line per method (rag: best K), with 95%
    error bars (1.96 standard errors over the examples) and n in the legend below the panels."""
    plt = pyplot()
    b = best_rows(df)
    tasks = sorted(b.task_label.unique())
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.9), squeeze=False)
    handles: dict[str, object] = {}
    for ax, t in zip(axes[0], tasks):
        d = b[b.task_label == t]
        for i, m in enumerate(_methods(b)):   # distinct markers/sizes: equal scores stay visible
            dm = d[d.method == m].groupby("length")["score"]
            if not len(dm):
                continue
            g, n, sd = dm.mean(), dm.size(), dm.std(ddof=1).fillna(0.0)
            half = 1.96 * sd / np.sqrt(n)
            ns = f"n={int(n.min())}" if n.min() == n.max() else f"n={int(n.min())}-{int(n.max())}"
            h = ax.errorbar(g.index, g.values, yerr=half.values, linestyle=("-", "--", ":", "-.")[i % 4],
                            marker="os^Dv"[i % 5], markersize=9 - 2 * (i % 3), color=f"C{i}", capsize=3,
                            label=f"{m} ({ns} per point)")
            handles.setdefault(f"{m} ({ns} per point)", h)
        _length_ticks(ax, d["length"].unique())
        ax.set_ylim(-3, 103)
        ax.set_title(t)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("score (0-100)")
        ax.grid(alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(4, len(handles)),
               fontsize=8, frameon=False)
    fig.suptitle("MoNe vs ICL and RAG: score vs context length (error bars: 95% CI)")
    save_figure(fig, path, rect=(0, 0.1, 1, 1))


def plot_cost(df: pd.DataFrame, path: str) -> None:
    """FLOPs and peak tensor memory per example vs length, write (dashed) vs query (solid), mean over
    tasks (rag: best K rows). Zero/unmeasured values are left out of the log-scale plot. The legend
    says it in two parts: colour = method, line style = phase."""
    from matplotlib.lines import Line2D
    plt = pyplot()
    b = best_rows(df)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    methods = _methods(b)
    for ax, (what, label) in zip(axes, (("flops", "FLOPs per example"), ("peak_bytes", "peak tensor memory (bytes)"))):
        for i, m in enumerate(methods):
            d = b[b.method == m]
            for phase, ls in (("write", "--"), ("query", "-")):
                g = d.groupby("length")[f"{phase}_{what}"].mean()
                g = g[g > 0]
                if not g.empty:
                    ax.plot(g.index, g.values, linestyle=ls, marker="o", color=f"C{i}")
        _length_ticks(ax, b["length"].unique())
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=f"C{i}", marker="o", linestyle="none", label=m) for i, m in enumerate(methods)]
    handles += [Line2D([], [], color="#333333", linestyle="--", linewidth=1.6, label="write (ingest)"),
                Line2D([], [], color="#333333", linestyle="-", linewidth=1.6, label="query")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False,
               handlelength=3)
    save_figure(fig, path, rect=(0, 0.08, 1, 1))


def _fmt_num(x) -> str:
    if x is None:
        return ""
    x = float(x)
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def write_report(rows, out_dir: str, title: str = "MoNe evaluation", meta: dict | None = None,
                 label: str = "") -> dict:
    """Write summary.json, cost.json, rag_by_k.json, report.md and the plots. -> summary dict."""
    df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
    summary, lines = start_report(df, out_dir, lambda d: summarize(d, label), title, meta, indent=1, sort_keys=True)
    costs = cost_table(df, label)
    byk = rag_by_k(df)
    byk_json = {key(f"{r.method}@{int(r.rag_k)}", r.task_label, r.length, label):
                {"score": round(float(r.score), 2), "answer_recall": round(float(r.rag_recall), 2), "n": int(r.n)}
                for r in byk.itertuples()}
    for name, obj in (("cost.json", costs), ("rag_by_k.json", byk_json)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.write("\n")
    plot_accuracy(df, os.path.join(out_dir, "accuracy_vs_length.png"))
    plot_cost(df, os.path.join(out_dir, "cost_vs_length.png"))

    n_ex = df.groupby(["task_label", "length"])["index"].nunique()
    lines += [f"- examples per (task, length): {int(n_ex.min())}-{int(n_ex.max())}", "",
              "Scores: RULER string_match_all (0-100), greedy. rag: best K per (task, length).", "",
              "![accuracy vs length](accuracy_vs_length.png)", "", "![cost vs length](cost_vs_length.png)", ""]
    b = best_rows(df)
    for t in sorted(b.task_label.unique()):
        d = b[b.task_label == t]
        piv = d.pivot_table(index="method", columns="length", values="score", aggfunc="mean")
        cnt = d.pivot_table(index="method", columns="length", values="score", aggfunc="size")
        cells = piv.astype(object)
        for i in piv.index:
            for c in piv.columns:
                x = piv.at[i, c]
                cells.at[i, c] = f"{x:.1f} (n={int(cnt.at[i, c])})" if pd.notna(x) else None
        cells.index.name = "method"
        lines += [f"## {t}", "", "Mean score (n = examples):", "",
                  _md_table(cells.reindex([m for m in _methods(b) if m in cells.index]), "{}"), ""]
    if not byk.empty:
        byk = byk.assign(cell=byk.method + " " + byk.task_label + "/" + byk.length.astype(str))
        piv = byk.pivot_table(index="cell", columns="rag_k", values="score", aggfunc="mean")
        rec = byk.pivot_table(index="cell", columns="rag_k", values="rag_recall", aggfunc="mean")
        piv.index.name = rec.index.name = "method task/length"
        piv.columns = [f"K={int(c)}" for c in piv.columns]
        rec.columns = [f"K={int(c)}" for c in rec.columns]
        lines += ["## RAG by K", "", "Score:", "", _md_table(piv, "{:.1f}"), "",
                  "Answer recall of the retrieved chunks (% of reference answers inside them):", "",
                  _md_table(rec, "{:.0f}"), ""]
    lines += ["## Cost per example (mean; rag: best K)", "",
              "FLOPs: torch FlopCounterMode (matmuls/attention; element-wise ops not counted). Peak memory: "
              "torch CPU memory accounting (live tensor storages created inside the phase, above what existed "
              "before it: weights and a loaded state are excluded; nbcore/mone/cost.py). rag write = building "
              "the chunk index (encoder FLOPs; BM25 runs outside torch and shows 0); icl has no write phase.", "",
              "| method/task/length | context tok | write FLOPs | query FLOPs | write peak | query peak | "
              "memory tokens | state bytes |", "|---|---|---|---|---|---|---|---|"]
    for k, c in costs.items():
        lines.append(f"| {k} | {c.get('context_tokens')} | {_fmt_num(c.get('write_flops'))} | "
                     f"{_fmt_num(c.get('query_flops'))} | {_fmt_num(c.get('write_peak_bytes'))}B | "
                     f"{_fmt_num(c.get('query_peak_bytes'))}B | {c.get('memory_tokens')} | "
                     f"{_fmt_num(c.get('state_bytes'))}B |")
    write_markdown(out_dir, lines)
    return summary
