"""Report of a LongBench v1 / v2 / MemoryAgentBench run: summary.json, report.md, PNG plots.

Input rows (one per example x question x method, from nbcore.evals.longbench / memoryagentbench
through pipeline/evaluate_longbench.py) carry at
least: backbone, benchmark (longbench | longbench_v2 | memoryagentbench), dataset (v1 subset,
"longbench_v2", or a MemoryAgentBench configuration), id, question_index, method, prediction,
score (0-100), ingest_s, ingest_amortised_s, answer_s, n_tokens, replay_len.

`summary.json` keys, all on 0-100 (paper Table 1 conventions):
  <backbone>/<method>/<v1 dataset>           mean score over the subset's examples
  <backbone>/<method>/<category>             single_doc_qa, multi_doc_qa, summarization, few_shot:
                                             unweighted mean of the category's present datasets
  <backbone>/<method>/longbench_overall      unweighted mean over the present v1 datasets
  <backbone>/<method>/longbench_v2           accuracy over the kept v2 examples
  <backbone>/<method>/<MAB configuration>    accuracy over all questions of the configuration
  <backbone>/<method>/memoryagentbench_average   macro-average over configurations
"""
from __future__ import annotations

import os

import numpy as np

from nbcore.evals.longbench import CATEGORIES, V1_DATASETS, aggregate_scores
from notebank.pipeline.reporting.common import as_frame, method_color, pyplot, save_figure, start_report, write_markdown

SUITE_LABELS = {"longbench": "LongBench v1", "longbench_v2": "LongBench v2", "memoryagentbench": "MemoryAgentBench"}


def _v1_order(datasets) -> list[str]:
    return [d for d in V1_DATASETS if d in set(datasets)]


def scores_by_method(df) -> dict[tuple[str, str], dict[str, float]]:
    """-> {(backbone, method): {name: score 0-100}} with every summary entry of that pair (unrounded)."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for (bb, m), g in df.groupby(["backbone", "method"]):
        d: dict[str, float] = {}
        v1 = g[g.benchmark == "longbench"]
        if not v1.empty:
            per_ds = {ds: float(s) for ds, s in v1.groupby("dataset")["score"].mean().items()}
            d.update(per_ds)
            agg = aggregate_scores(per_ds, ndigits=None)
            d.update({k: v for k, v in agg.items() if k != "overall"})
            d["longbench_overall"] = agg["overall"]
        v2 = g[g.benchmark == "longbench_v2"]
        if not v2.empty:
            d["longbench_v2"] = float(v2["score"].mean())
        mb = g[g.benchmark == "memoryagentbench"]
        if not mb.empty:
            per_conf = {c: float(s) for c, s in mb.groupby("dataset")["score"].mean().items()}
            d.update(per_conf)
            d["memoryagentbench_average"] = float(np.mean(list(per_conf.values())))
        out[(bb, m)] = d
    return out


def summarize(rows) -> dict[str, float]:
    """-> {"<backbone>/<method>/<name>": score on 0-100, rounded to 2 decimals} (see module docstring)."""
    df = as_frame(rows)
    out = {f"{bb}/{m}/{k}": round(v, 2) for (bb, m), d in scores_by_method(df).items() for k, v in d.items()}
    return dict(sorted(out.items()))


def _table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, (float, np.floating)):
            return "" if np.isnan(v) else f"{v:.1f}"
        return str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def _methods(df) -> list[str]:
    """Methods in first-seen order (the config's order survives collection per cell)."""
    return list(dict.fromkeys(df["method"]))


def v1_table(df, scores: dict, bb: str) -> str:
    """method x (datasets, categories, overall) for one backbone."""
    d = df[(df.backbone == bb) & (df.benchmark == "longbench")]
    cols = _v1_order(d["dataset"].unique())
    cats = [c for c, names in CATEGORIES.items() if any(n in cols for n in names)]
    rows = [[m] + [scores[(bb, m)].get(c, float("nan")) for c in cols + cats + ["longbench_overall"]]
            for m in _methods(d)]
    return _table(["method"] + cols + cats + ["overall"], rows)


def v2_table(df, bb: str) -> str:
    d = df[(df.backbone == bb) & (df.benchmark == "longbench_v2")]
    rows = []
    for m in _methods(d):
        g = d[d.method == m]
        parsed = float(g["parsed"].notna().mean() * 100) if "parsed" in g else float("nan")
        rows.append([m, float(g["score"].mean()), parsed, int(g["id"].nunique())])
    return _table(["method", "accuracy", "% parsed", "examples"], rows)


def mab_table(df, scores: dict, bb: str) -> str:
    d = df[(df.backbone == bb) & (df.benchmark == "memoryagentbench")]
    confs = sorted(d["dataset"].unique())
    rows = [[m] + [scores[(bb, m)].get(c, float("nan")) for c in confs + ["memoryagentbench_average"]]
            for m in _methods(d)]
    return _table(["method"] + confs + ["average"], rows)


def cost_table(df, bb: str) -> str:
    """Mean wall times per suite and method: ingest per context, ingest amortised per question, answer."""
    d = df[df.backbone == bb]
    rows = []
    for suite in [s for s in SUITE_LABELS if s in set(d.benchmark)]:
        g = d[d.benchmark == suite]
        for m in _methods(g):
            x = g[g.method == m]
            per_ctx = x.drop_duplicates(["dataset", "index"])
            rows.append([SUITE_LABELS[suite], m, f"{per_ctx['ingest_s'].mean():.3f}",
                         f"{x['ingest_amortised_s'].mean():.3f}", f"{x['answer_s'].mean():.3f}",
                         f"{x['n_questions'].mean():.1f}", f"{per_ctx['n_tokens'].mean():.0f}",
                         f"{x['replay_len'].mean():.0f}"])
    return _table(["suite", "method", "ingest s / context", "ingest s / question (amortised)", "answer s / question",
                   "questions / context", "context tokens", "replay tokens"], rows)


def samples_table(df, bb: str, per_dataset: int = 1, width: int = 70) -> str:
    """First prediction of each dataset and method (what the model actually wrote)."""
    d = df[df.backbone == bb].sort_values(["benchmark", "dataset", "index", "question_index"])
    rows = []
    for (suite, ds), g in d.groupby(["benchmark", "dataset"], sort=False):
        first = g[["index", "question_index"]].drop_duplicates().head(per_dataset)
        for _, k in first.iterrows():
            for _, r in g[(g["index"] == k["index"]) & (g.question_index == k.question_index)].iterrows():
                pred = " ".join(str(r.prediction).split())
                pred = (pred[:width] + "...") if len(pred) > width else pred
                gold = " / ".join(list(r.answers)[:2])
                gold = (gold[:40] + "...") if len(gold) > 40 else gold
                rows.append([ds, r.method, "`" + pred.replace("|", "\\|").replace("`", "'") + "`",
                             gold.replace("|", "\\|"), f"{r.score:.1f}"])
    return _table(["dataset", "method", "prediction (whitespace collapsed)", "gold", "score"], rows)


def plot_scores(df, scores: dict, path: str) -> None:
    """One panel per suite present: grouped bars of method scores (v1 categories + overall, v2
    accuracy, MAB configurations + average); one figure row per backbone."""
    plt = pyplot()
    suites = [s for s in SUITE_LABELS if s in set(df.benchmark)]
    bbs = sorted(df.backbone.unique())
    fig, axes = plt.subplots(len(bbs), len(suites), figsize=(5.8 * len(suites), 4.2 * len(bbs)), squeeze=False)
    for r, bb in enumerate(bbs):
        d = df[df.backbone == bb]
        methods = _methods(d)
        for c, suite in enumerate(suites):
            ax = axes[r][c]
            if suite == "longbench":
                present = set(d[d.benchmark == suite]["dataset"])
                groups = [k for k, names in CATEGORIES.items() if present & set(names)] + ["longbench_overall"]
            elif suite == "longbench_v2":
                groups = ["longbench_v2"]
            else:
                groups = sorted(d[d.benchmark == suite]["dataset"].unique()) + ["memoryagentbench_average"]
            w = 0.8 / max(1, len(methods))
            x = np.arange(len(groups))
            shown = []
            for k, m in enumerate(methods):
                vals = [scores.get((bb, m), {}).get(g, np.nan) for g in groups]
                shown += [v for v in vals if v == v]
                bars = ax.bar(x + k * w, vals, w, label=m, color=method_color(m))
                # every bar carries its value: a score of 0 is a result, not a missing bar
                ax.bar_label(bars, labels=["" if v != v else f"{v:.0f}" for v in vals], fontsize=6, padding=1)
            ds = d[d.benchmark == suite]
            n_q = ds[ds.method == methods[0]].shape[0] if methods else 0
            ax.set_xticks(x + 0.4 - w / 2, [g.replace("longbench_", "").replace("memoryagentbench_", "")
                                            .replace("factconsolidation", "fc") for g in groups],
                          rotation=25, ha="right", fontsize=8)
            ax.set_ylim(0, 103)
            ax.set_ylabel("score (0-100)")
            ax.set_title(f"{bb}: {SUITE_LABELS[suite]} (n = {n_q} questions per method)")
            ax.grid(axis="y", alpha=0.3)
            if shown and max(shown) == 0:
                ax.text(0.5, 0.5, "every method scored 0 here", transform=ax.transAxes, ha="center",
                        va="center", fontsize=10, color="#555555")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=max(1, len(labels)), fontsize=8, frameon=False)
    save_figure(fig, path, rect=(0, 0.08, 1, 1))


def plot_cost(df, path: str) -> None:
    """Seconds per question, stacked: ingest amortised over the context's questions + answer."""
    plt = pyplot()
    g = df.groupby(["backbone", "benchmark", "method"], sort=False)[["ingest_amortised_s", "answer_s"]].mean()
    labels = [f"{bb}\n{SUITE_LABELS.get(s, s)}\n{m}" for bb, s, m in g.index]
    x = np.arange(len(g))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(g) + 2), 4.4))
    ax.bar(x, g["ingest_amortised_s"], 0.7, label="ingest (amortised per question)")
    ax.bar(x, g["answer_s"], 0.7, bottom=g["ingest_amortised_s"], label="answer (replay + generate)")
    ax.set_xticks(x, labels, rotation=90, fontsize=6)
    ax.set_ylabel("seconds per question")
    ax.set_title("Cost per question (one ingest per context, every answer from a state copy)")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def write_report(rows, out_dir: str, title: str = "LongBench evaluation", meta: dict | None = None) -> dict:
    """Write summary.json, report.md, scores.png and cost.png under out_dir. -> summary dict."""
    df = as_frame(rows)
    summary, lines = start_report(df, out_dir, summarize, title, meta)
    scores = scores_by_method(df)
    plot_scores(df, scores, os.path.join(out_dir, "scores.png"))
    plot_cost(df, os.path.join(out_dir, "cost.png"))
    lines += ["- scores on 0-100: LongBench v1 official metrics (qa_f1, Rouge-L F, classification) and "
              "unweighted category/overall macro-averages (paper Table 1); LongBench v2 accuracy of the parsed "
              "choice; MemoryAgentBench substring_exact_match accuracy per configuration and its macro-average",
              "", "![scores](scores.png)", "", "![cost per question](cost.png)", ""]
    for bb in sorted(df.backbone.unique()):
        d = df[df.backbone == bb]
        lines += [f"## {bb}", ""]
        if (d.benchmark == "longbench").any():
            n = d[d.benchmark == "longbench"].groupby("dataset")["id"].nunique()
            lines += ["### LongBench v1", "", f"Examples per subset: {int(n.min())}-{int(n.max())}.", "",
                      v1_table(df, scores, bb), ""]
        if (d.benchmark == "longbench_v2").any():
            lines += ["### LongBench v2", "", v2_table(df, bb), ""]
        if (d.benchmark == "memoryagentbench").any():
            x = d[d.benchmark == "memoryagentbench"]
            nq = x.drop_duplicates(["dataset", "index", "question_index"]).groupby("dataset").size()
            lines += ["### MemoryAgentBench", "",
                      "Questions per configuration: " + ", ".join(f"{k} {v}" for k, v in nq.items()) + ".", "",
                      mab_table(df, scores, bb), ""]
        lines += ["### Cost (mean wall seconds)", "", cost_table(df, bb), "",
                  "### Sample predictions", "", samples_table(df, bb), ""]
    write_markdown(out_dir, lines)
    return summary
