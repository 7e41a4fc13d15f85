"""RULER report (pipeline/evaluate_ruler.py): from per-example rows to

    report.md             the headline (mean ± 95% CI, n examples), what the numbers say, where
                          NoteBank loses, routers, cost; short (MAX_REPORT_LINES)
    report-appendix.md    every table: per method and task, coverage, the paper's claims checked,
                          routers and native addressing variants, the LoRA 2x2, analytical cost
    results.json          per "<backbone>/<method>/<length>": mean, stderr, n, 95% CI, model and config
                          hash (schemas/results.py)
    summary.json          the same keys -> mean, a flat map (the format older readers know)
    headline-<backbone>.png  accuracy_vs_length.png  routers.png  cost_vs_length.png  coverage.png
    router_coverage.png

Input rows carry at least backbone, method, task, length, index, score; the coverage, timing and
counter columns feed their sections when present. A "<backbone>/<method>/<length>" mean is the mean
over tasks of the per-task mean score (the six-task mean when all six NIAH tasks ran), on 0-100,
given only where the method ran every task the backbone ran at that length. Intervals are 95%
percentile bootstrap intervals that resample examples within each task (nbcore.evals.stats).
"""
from __future__ import annotations

import os
import re

import numpy as np
import pandas as pd

from nbcore.evals.stats import LEVEL, N_BOOT, SEED, bootstrap_mean_ci, bootstrap_ratio_ci
from notebank.pipeline.reporting.common import (PALETTE, as_frame, figure_legend, is_reset, legend_rect,
                                                length_label, method_color, method_label, n_label, panel_grid,
                                                pyplot, save_figure, write_markdown, write_summary_json)

METRIC = "mean over tasks of the per-task mean score (0-100)"
PAPER_METHOD = "nb-tf-top2"                 # the paper's NoteBank: native router (Eq. 5), top-2, no reset
ORACLE_RESET = "nb-oracle-top2-reset"       # notes holding a gold value, lambda = 0: what top-2 replay can reach
PREFERRED_NATIVE = "embmax_centered"        # the native router chosen on a development draw, not on sweep rows
APPENDIX = "report-appendix.md"
MAX_REPORT_LINES = 300

NATIVE_VARIANTS = ("tf", "margin", "sum", "m4", "m4margin", "m4sum", "qnovel", "qnovelmargin", "m4qnovelmargin",
                   "embmax", "embmax_centered")
ADDRESS_FREE = ("embmax", "embmax_centered")        # native routers that read stored token ids, not addresses
EXTERNAL_ROUTERS = ("bm25", "dense", "meanemb", "random", "oracle")


# ---------------------------------------------------------------------------------------------
# Means, intervals, summary entries
# ---------------------------------------------------------------------------------------------
STAT_COLUMNS = ["backbone", "method", "length", "mean", "low", "high", "stderr", "n", "n_tasks", "per_task_min",
                "per_task_max", "complete"]


def _interval(values, tasks):
    return bootstrap_mean_ci(np.asarray(values, dtype=float), np.asarray(tasks), n_boot=N_BOOT, level=LEVEL,
                             seed=SEED)


def cell_stats(rows) -> pd.DataFrame:
    """One row per (backbone, method, length): the mean over tasks of per-task mean scores, its 95%
    bootstrap interval (low, high) and stderr, n examples, tasks, examples per task (min / max), and
    `complete`: the method ran every task the backbone ran at that length."""
    df = as_frame(rows)
    if df.empty:
        return pd.DataFrame(columns=STAT_COLUMNS)
    full = df.groupby(["backbone", "length"])["task"].nunique()
    recs = []
    for (bb, m, n), g in df.groupby(["backbone", "method", "length"], sort=True):
        iv = _interval(g["score"], g["task"])
        per = g.groupby("task").size()
        recs.append(dict(backbone=bb, method=m, length=int(n), mean=iv.estimate, low=iv.low, high=iv.high,
                         stderr=iv.stderr, n=iv.n, n_tasks=int(len(per)), per_task_min=int(per.min()),
                         per_task_max=int(per.max()), complete=bool(len(per) == full[(bb, n)])))
    return pd.DataFrame(recs, columns=STAT_COLUMNS)


def summarize(rows) -> dict:
    """-> {"<backbone>/<method>/<len>": mean over tasks of the per-task mean score, 2 decimals}, only
    where the method ran every task of its (backbone, length): summary.json."""
    st = cell_stats(rows)
    st = st[st.complete]
    return dict(sorted((f"{r.backbone}/{r.method}/{length_label(r.length)}", round(float(r.mean), 2))
                       for r in st.itertuples()))


def _model_name(entry: dict | None, backbone: str) -> str:
    model = (entry or {}).get("model") or {}
    name = model.get("path") or model.get("hf_name") or model.get("name") or backbone
    return f"{name} + adapter {model['adapter']}" if model.get("adapter") else str(name)


def summary_entries(rows, stats: pd.DataFrame | None = None, config_of=None) -> tuple[dict, dict, dict]:
    """-> ({key: schemas.results.SummaryEntry}, {config hash: config}, {hash: config part}) for every
    complete cell. config_of(backbone, budget, method) -> the config entry that produced those rows
    (model spec, notebank config, ...) or None (rows of an entry no longer in the config); a config
    names its entries by hash in "parts"."""
    from notebank.schemas.results import SummaryEntry, config_hash
    df = as_frame(rows)
    st = cell_stats(df) if stats is None else stats
    budgets = (df.groupby(["backbone", "method", "length"])["budget"].agg(lambda s: sorted(set(s)))
               if "budget" in df else None)
    tasks = df.groupby(["backbone", "length"])["task"].agg(lambda s: sorted(set(s)))
    entries, configs, parts = {}, {}, {}
    for r in st[st.complete].itertuples():
        bud = budgets[(r.backbone, r.method, r.length)] if budgets is not None else ["default"]
        used = [c for c in ((config_of(r.backbone, b, r.method) if config_of else None) for b in bud) if c]
        for c in used:
            parts[config_hash(c)] = c
        cfg = {"benchmark": "ruler", "backbone": r.backbone, "method": r.method, "length": int(r.length),
               "tasks": tasks[(r.backbone, r.length)], "budgets": bud, "parts": [config_hash(c) for c in used]}
        h = config_hash(cfg)
        configs[h] = cfg
        key = f"{r.backbone}/{r.method}/{length_label(r.length)}"
        entries[key] = SummaryEntry(metric=METRIC, value=round(float(r.mean), 4), stderr=round(float(r.stderr), 4),
                                    n=int(r.n), ci=(round(float(r.low), 4), round(float(r.high), 4)),
                                    model=_model_name(used[0] if used else None, r.backbone), config_hash=h,
                                    n_tasks=int(r.n_tasks), ci_level=LEVEL).validate(key)
    return entries, configs, parts


def versions() -> dict:
    """Versions of what computed the numbers (results.json)."""
    import platform
    from importlib import metadata
    out = {"python": platform.python_version()}
    for pkg in ("notebank", "numpy", "pandas", "pyarrow"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def write_results_files(rows, out_dir: str, stats: pd.DataFrame | None = None, config_of=None) -> dict:
    """results.json and summary.json from the same entries. -> the flat summary."""
    from notebank.schemas.results import flat_summary, results_document, write_results
    entries, configs, parts = summary_entries(rows, stats, config_of)
    from notebank.schemas.provenance import provenance
    doc = results_document(entries, configs, benchmark="ruler", versions=versions(), parts=parts,
                           provenance=provenance(),
                           bootstrap={"n_boot": N_BOOT, "level": LEVEL, "seed": SEED,
                                      "resampling": "examples, within each task (all examples together when "
                                                    "a task has a single example)",
                                      "interval": "percentile"})
    os.makedirs(out_dir, exist_ok=True)
    write_results(os.path.join(out_dir, "results.json"), doc)
    summary = flat_summary(entries)
    write_summary_json(out_dir, summary)
    return summary


# ---------------------------------------------------------------------------------------------
# Which methods the headline shows
# ---------------------------------------------------------------------------------------------
def _stat(st: pd.DataFrame, bb: str, m: str, n: int):
    """The complete cell (backbone, method, length) as a row, or None."""
    g = st[(st.backbone == bb) & (st.method == m) & (st.length == n) & st.complete]
    return None if g.empty else g.iloc[0]


def best_native_reset(st: pd.DataFrame, bb: str, r: int = 2) -> tuple[str | None, str]:
    """The native router with lambda = 0 the headline shows for a backbone -> (method, how chosen).
    PREFERRED_NATIVE when measured (chosen on a development draw, not on these rows); else the native
    -reset variant measured at the most lengths, then with the best mean over them (chosen on these
    rows, so optimistic)."""
    d = st[(st.backbone == bb) & st.complete]
    cands = [f"nb-{v}-top{r}-reset" for v in NATIVE_VARIANTS if f"nb-{v}-top{r}-reset" in set(d.method)]
    if not cands:
        return None, ""
    pref = f"nb-{PREFERRED_NATIVE}-top{r}-reset"
    if pref in cands:
        return pref, "fixed in advance: chosen on a separate development draw, not on these examples"
    g = d[d.method.isin(cands)].groupby("method")["mean"].agg(["size", "mean"])
    best = g.sort_values(["size", "mean"], ascending=False).index[0]
    return best, "the best native λ=0 variant on these same examples (chosen after the fact, so optimistic)"


def headline_methods(st: pd.DataFrame, bb: str) -> list[str]:
    """Plain, JRT, the paper's NoteBank, the best native router with lambda = 0, oracle notes with
    lambda = 0: those measured on this backbone, in that order (at most five)."""
    have = set(st[(st.backbone == bb) & st.complete].method)
    out = [m for m in ("plain", "jrt", PAPER_METHOD) if m in have]
    native = best_native_reset(st, bb)[0]
    if native:
        out.append(native)
    if ORACLE_RESET in have:
        out.append(ORACLE_RESET)
    return out


def backbone_order(st: pd.DataFrame) -> list[str]:
    """Backbones with the most Plain examples first (the best-measured ones lead), then by name."""
    p = st[st.method == "plain"].groupby("backbone")["n"].sum()
    return sorted(st.backbone.unique(), key=lambda b: (-int(p.get(b, 0)), b))


def _lengths(st: pd.DataFrame, bb: str) -> list[int]:
    return sorted(int(x) for x in st[(st.backbone == bb) & st.complete].length.unique())


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _pm(s, digits: int = 1) -> str:
    """'82.9 ± 7.3 (60)': mean ± half the 95% interval (n examples)."""
    return f"{s['mean']:.{digits}f} ± {(s['high'] - s['low']) / 2:.{digits}f} ({int(s['n'])})"


# ---------------------------------------------------------------------------------------------
# Paired comparisons: NoteBank vs Plain on the same examples
# ---------------------------------------------------------------------------------------------
def _pair_cols(df) -> list[str]:
    return [c for c in ("budget", "task", "length", "index") if c in df.columns]


def paired_difference(df, bb: str, method: str, length: int, ref: str = "plain"):
    """method minus ref on the examples both ran (same backbone, task, length, example): the mean
    over tasks of per-task mean differences with its bootstrap interval. None without pairs."""
    d = df[(df.backbone == bb) & (df.length == length)]
    k = _pair_cols(d)
    j = d[d.method == method][k + ["score"]].merge(d[d.method == ref][k + ["score"]], on=k, suffixes=("", "_ref"))
    if j.empty:
        return None
    return _interval(j["score"] - j["score_ref"], j["task"])


def _answer_s(d) -> pd.Series:
    """Seconds from the question to the answer: probe + route + replay/generate."""
    cols = [c for c in ("probe_s", "route_s", "replay_generate_s") if c in d]
    return d[cols].fillna(0.0).sum(axis=1)


def _write_s(d) -> pd.Series:
    return d["write_s"].fillna(0.0) if "write_s" in d else pd.Series(0.0, index=d.index)


def cost_ratios(df, bb: str, methods) -> pd.DataFrame:
    """Per (method, length): wall time per example / Plain's on the same examples, with its bootstrap
    interval (pairs resampled within each task). Empty without timing columns.

    One example's wall time = reading the context + (NoteBank only) writing the notes + answering
    (probe + route + replay/generate). Reading the context is the same computation for every method:
    it is taken from the Plain row of the same example (its ingest minus the writer), so a method
    measured in another run (an add-on config entry, other load on the machine) is not charged that
    run's slower or faster read."""
    cols = ["method", "length", "ratio", "low", "high", "n"]
    if "ingest_s" not in df.columns:
        return pd.DataFrame(columns=cols)
    d = df[df.backbone == bb].copy()
    d["answer_s_"], d["write_s_"] = _answer_s(d), _write_s(d)
    k = _pair_cols(d)
    plain = d[d.method == "plain"].copy()
    plain["read_s"] = plain["ingest_s"].fillna(0.0) - plain["write_s_"]
    plain["plain_s"] = plain["read_s"] + plain["answer_s_"]
    plain = plain[k + ["read_s", "plain_s"]]
    recs = []
    for m in methods:
        j = d[d.method == m][k + ["answer_s_", "write_s_"]].merge(plain, on=k)
        j["wall_s"] = j["read_s"] + j["answer_s_"] + (j["write_s_"] if m.startswith("nb-") else 0.0)
        for n, g in j.groupby("length"):
            if g["plain_s"].mean() <= 0:
                continue
            iv = bootstrap_ratio_ci(g["wall_s"].to_numpy(float), g["plain_s"].to_numpy(float),
                                    g["task"].to_numpy(), n_boot=N_BOOT, level=LEVEL, seed=SEED)
            recs.append(dict(method=m, length=int(n), ratio=iv.estimate, low=iv.low, high=iv.high, n=iv.n))
    return pd.DataFrame(recs, columns=cols)


def _mean_over_tasks(df, bb: str, method: str, length: int, col: str) -> float:
    d = df[(df.backbone == bb) & (df.method == method) & (df.length == length)]
    if d.empty or col not in d or d[col].isna().all():
        return float("nan")
    return float(d.groupby("task")[col].mean().mean())


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------
def _line_style(method: str) -> str:
    """Solid for NoteBank, dashed for the methods without it."""
    return "-" if method.startswith("nb-") else "--"


def _draw_headline(ax, st: pd.DataFrame, bb: str, methods, legend_size: int = 8) -> None:
    lengths = _lengths(st, bb)
    for m in methods:
        g = st[(st.backbone == bb) & (st.method == m) & st.complete].sort_values("length")
        if g.empty:
            continue
        c = method_color(m)
        ax.fill_between(g["length"], g["low"], g["high"], color=c, alpha=0.15, linewidth=0)
        ax.plot(g["length"], g["mean"], _line_style(m), marker="o", color=c,
                linewidth=2.2 if m.startswith("nb-") else 1.6,
                label=f"{method_label(m)} ({n_label(g['n'])})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [length_label(x) for x in lengths])
    ax.minorticks_off()
    ax.set_ylim(-3, 103)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("RULER score, mean over tasks (0-100)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)


def plot_headline(st: pd.DataFrame, bb: str, path: str) -> None:
    """One backbone: Plain, JRT, the paper's NoteBank, the best native router with lambda = 0 and
    oracle notes with lambda = 0; bands are 95% bootstrap intervals, n examples per point."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.6, 5.4))
    _draw_headline(ax, st, bb, headline_methods(st, bb))
    ax.set_title(f"{bb}: accuracy vs context length (bands: 95% CI; n: examples per point)", fontsize=10)
    save_figure(fig, path)


def plot_accuracy_vs_length(st: pd.DataFrame, path: str, order=None) -> None:
    """Every backbone's headline panel side by side (same methods and colours as headline-*.png)."""
    plt = pyplot()
    bbs = list(order or backbone_order(st))
    if not bbs:
        return
    fig, axes = panel_grid(plt, len(bbs), 6.6, 5.4)
    for ax, bb in zip(axes, bbs):
        _draw_headline(ax, st, bb, headline_methods(st, bb), legend_size=7)
        ax.set_title(bb)
    fig.suptitle("Accuracy vs context length (bands: 95% bootstrap CI; n: examples per point)")
    save_figure(fig, path)


def plot_routers(df, st: pd.DataFrame, path: str, r: int = 2, order=None) -> None:
    """Per backbone, at 64K (or its middle length) and at its longest length: each router's accuracy
    without (hatched) and with lambda = 0 (solid), 95% CI whiskers, and its retrieved gold coverage
    (black diamond, x 100). A measured 0 is labelled "0"; no bar means not measured there."""
    plt = pyplot()
    rx = re.compile(rf"^nb-([a-z0-9_]+)-top{r}(-reset)?$")
    routers_of = {m: rx.match(m).group(1) for m in st.method.unique() if rx.match(m)}
    routers_of = {m: x for m, x in routers_of.items() if x != "lora"}
    if not routers_of:
        return
    bbs = [b for b in (order or backbone_order(st)) if set(st[st.backbone == b].method) & set(routers_of)]
    fig, axes = plt.subplots(len(bbs), 2, figsize=(14, 3.9 * len(bbs)), squeeze=False)
    for row, bb in zip(axes, bbs):
        lengths = _lengths(st, bb)
        mid = (1 << 16) if (1 << 16) in lengths[:-1] else lengths[(len(lengths) - 1) // 2]
        shown = sorted({mid, lengths[-1]})
        for ax in row[len(shown):]:
            ax.set_visible(False)
        for ax, n in zip(row, shown):
            have = {routers_of[m] for m in routers_of if _stat(st, bb, m, n) is not None}
            routers = [x for x in (*NATIVE_VARIANTS, *EXTERNAL_ROUTERS) if x in have] + sorted(
                have - set(NATIVE_VARIANTS) - set(EXTERNAL_ROUTERS))
            w = 0.38
            ns = []
            for i, router in enumerate(routers):
                c = PALETTE.get(router, "#aaaaaa")
                for off, m, kw in ((-w / 2, f"nb-{router}-top{r}", dict(alpha=0.45, hatch="///", edgecolor=c)),
                                   (w / 2, f"nb-{router}-top{r}-reset", dict(edgecolor="black", linewidth=0.6))):
                    s = _stat(st, bb, m, n)
                    if s is None:
                        continue
                    ns.append(int(s["n"]))
                    ax.bar(i + off, s["mean"], w, color=c, yerr=[[s["mean"] - s["low"]], [s["high"] - s["mean"]]],
                           ecolor="#333333", capsize=2, error_kw={"linewidth": 0.8}, **kw)
                    if s["mean"] < 0.5:                  # a measured 0 is not a missing bar
                        ax.text(i + off, 1, "0", ha="center", va="bottom", fontsize=6, color=c)
                cov = _mean_over_tasks(df, bb, f"nb-{router}-top{r}", n, "retrieved_cov")
                if np.isnan(cov):
                    cov = _mean_over_tasks(df, bb, f"nb-{router}-top{r}-reset", n, "retrieved_cov")
                if not np.isnan(cov):
                    ax.plot(i, 100 * cov, "D", color="black", markersize=5, zorder=5)
            ax.set_xticks(np.arange(len(routers)), routers, rotation=35, ha="right", fontsize=8)
            ax.set_ylim(0, 105)
            ax.set_ylabel("score / coverage x 100")
            ax.set_title(f"{bb} at {length_label(n)} ({n_label(ns) if ns else 'n=0'} per bar)", fontsize=10)
            ax.grid(alpha=0.3, axis="y")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    handles = [Patch(facecolor="#bbbbbb", alpha=0.6, hatch="///", edgecolor="#777777", label="accuracy, no reset"),
               Patch(facecolor="#777777", edgecolor="black", label="accuracy, λ=0 before replay"),
               Line2D([], [], marker="D", color="black", linestyle="", label="retrieved gold coverage x 100")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle(f"Routers, top-{r}: accuracy with and without λ=0, and how much gold evidence each retrieves "
                 "(colour = router; whiskers: 95% CI)")
    save_figure(fig, path, rect=legend_rect(fig, legend_in=0.45, title_in=0.45))


def plot_cost(df, st: pd.DataFrame, path: str, order=None) -> None:
    """Per backbone: wall time per example relative to Plain on the same examples, vs length
    (95% CI bands); 1 = Plain's cost."""
    if "ingest_s" not in df.columns:
        return
    plt = pyplot()
    bbs = [b for b in (order or backbone_order(st)) if "plain" in set(df[df.backbone == b].method)]
    panels = []
    for bb in bbs:
        methods = [m for m in headline_methods(st, bb) if m != "plain"]
        t = cost_ratios(df, bb, methods)
        if not t.empty:
            panels.append((bb, methods, t))
    if not panels:
        return
    fig, axes = panel_grid(plt, len(panels), 6.2, 4.2)
    top = max(float(t["high"].max()) for _, _, t in panels)
    for ax, (bb, methods, t) in zip(axes, panels):
        for m in methods:
            g = t[t.method == m].sort_values("length")
            if g.empty:
                continue
            c = method_color(m)
            ax.fill_between(g["length"], g["low"], g["high"], color=c, alpha=0.15, linewidth=0)
            ax.plot(g["length"], g["ratio"], _line_style(m), marker="o", color=c, label=method_label(m))
        ax.axhline(1.0, color=method_color("plain"), linewidth=1, linestyle=":", label="Plain (= 1)")
        lengths = sorted(t.length.unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [length_label(x) for x in lengths])
        ax.minorticks_off()
        ax.set_ylim(0.8, max(1.5, top * 1.05))
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("wall time per example / Plain's")
        ax.set_title(bb)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle("Cost relative to Plain on the same examples (read + write notes + answer; bands: 95% CI)")
    save_figure(fig, path)


def plot_coverage(df, path: str, method: str = PAPER_METHOD) -> None:
    """Archived vs retrieved gold coverage per length for one method (paper Fig. 5a), with 95% error
    bars (1.96 standard errors over the examples) and n under each length."""
    plt = pyplot()
    d = df[df.method == method]
    if d.empty or "archived_cov" not in d:
        return
    bbs = sorted(d["backbone"].unique())
    fig, axes = panel_grid(plt, len(bbs), 6.5, 4.4)
    for ax, bb in zip(axes, bbs):
        dd = d[d.backbone == bb]
        g = dd.groupby(["length", "task"])[["archived_cov", "retrieved_cov"]].mean()
        g = g.groupby("length").mean().sort_index()
        err = dd.groupby("length")[["archived_cov", "retrieved_cov"]].agg(_half_ci).reindex(g.index)
        n = dd.groupby("length").size().reindex(g.index)
        x = np.arange(len(g))
        ax.bar(x - 0.2, g["archived_cov"], 0.4, yerr=err["archived_cov"], capsize=3, label="archived",
               color="#bbbbbb")
        ax.bar(x + 0.2, g["retrieved_cov"], 0.4, yerr=err["retrieved_cov"], capsize=3,
               label=f"retrieved ({method})", color=method_color(method))
        ax.set_xticks(x, [f"{length_label(v)}\nn={int(n[v])}" for v in g.index])
        ax.set_ylim(0, 1.25)
        ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
        ax.set_ylabel("gold-value coverage")
        ax.set_title(bb)
        ax.legend(fontsize=8, loc="upper center", ncol=2, frameon=False)
    fig.suptitle(f"Evidence preserved (archived) vs accessed (retrieved), {method} (paper Fig. 5a; "
                 f"bars: 95% CI, n examples)")
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------
# Routers, the paper's claims, the LoRA 2x2 (appendix tables)
# ---------------------------------------------------------------------------------------------
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


def _router_of(method: str, r: int = 2) -> str | None:
    """nb-<router>-top<r> -> router (None for other methods, other R, -reset)."""
    import re
    m = re.match(rf"^nb-([a-z0-9_]+)-top{r}$", method)
    return m.group(1) if m and m.group(1) != "lora" else None


def routers_table(df, r: int = 2):
    """-> DataFrame [backbone, router, native, length, score, archived_cov, retrieved_cov,
    address_bytes_per_note], means over tasks of per-task means (top-r, no reset)."""
    d = df.copy()
    d["router"] = d["method"].map(lambda m: _router_of(m, r))
    d = d[d.router.notna()]
    if d.empty:
        return d
    cols = ["score", "archived_cov", "retrieved_cov", "address_bytes_per_note"]
    per_task = d.groupby(["backbone", "router", "length", "task"])[cols].mean().reset_index()
    out = per_task.groupby(["backbone", "router", "length"])[cols].mean().reset_index()
    n_tasks = per_task.groupby(["backbone", "router", "length"])["task"].nunique().reset_index(name="n_tasks")
    out = out.merge(n_tasks, on=["backbone", "router", "length"])
    out["all_tasks"] = out.n_tasks == out.groupby(["backbone", "length"])["n_tasks"].transform("max")
    out["native"] = out.router.isin(NATIVE_VARIANTS)
    return out


def coverage_vs_bm25(df, lengths=None, r: int = 2):
    """The native-routing bar: per (backbone, native variant, task, length) retrieved coverage / BM25's.
    -> DataFrame [backbone, router, task, length, cov, bm25_cov, ratio] (ratio 1 when both are 0)."""
    import pandas as pd
    d = df.copy()
    d["router"] = d["method"].map(lambda m: _router_of(m, r))
    d = d[d.router.notna()]
    if lengths is not None:
        d = d[d.length.isin(list(lengths))]
    # paired: a variant is compared with BM25 on the examples both were run on
    key = ["backbone", "task", "length", "index"]
    bm = d[d.router == "bm25"][key + ["retrieved_cov"]].rename(columns={"retrieved_cov": "bm25_cov"})
    nat = d[d.router.isin(NATIVE_VARIANTS)][key + ["router", "retrieved_cov"]].rename(columns={"retrieved_cov": "cov"})
    if bm.empty or nat.empty:
        return pd.DataFrame(columns=["backbone", "router", "task", "length", "cov", "bm25_cov", "ratio"])
    m = nat.merge(bm.drop_duplicates(key), on=key)
    m = m.groupby(["backbone", "router", "task", "length"])[["cov", "bm25_cov"]].mean().reset_index()
    m["ratio"] = np.where(m.bm25_cov > 0, m["cov"] / m.bm25_cov.where(m.bm25_cov > 0, 1), 1.0)
    return m


HEADLINE_ROUTERS = ("tf", "embmax_centered", "oracle", "bm25", "dense", "meanemb", "random")


def _half_ci(x) -> float:
    """Half the normal-approximation 95% interval of a mean (1.96 standard errors); 0 for n < 2."""
    x = np.asarray(x, dtype=float)
    return float(1.96 * x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else 0.0


def plot_router_coverage(df, path: str, r: int = 2) -> None:
    """Retrieved gold coverage vs length per router, with 95% bands (1.96 standard errors over the
    examples) and n in the legend. The headline routers have their PALETTE colours (native solid,
    external dashed); the other native addressing variants are thin grey lines under one legend
    entry, so the figure shows seven distinguishable lines, not sixteen similar ones."""
    plt = pyplot()
    t = routers_table(df, r)
    if t.empty:
        return
    d_ex = df.copy()
    d_ex["router"] = d_ex["method"].map(lambda m: _router_of(m, r))
    d_ex = d_ex[d_ex.router.notna()]
    spread = d_ex.groupby(["backbone", "router", "length"])["retrieved_cov"].agg([_half_ci, "size"])
    bbs = sorted(t.backbone.unique())
    fig, axes = panel_grid(plt, len(bbs), 7, 4.8)
    others_labelled = False
    for ax, bb in zip(axes, bbs):
        d = t[t.backbone == bb]
        present = set(d.router)
        for router in sorted(present - set(HEADLINE_ROUTERS)):       # the other variants: context, not focus
            g = d[d.router == router].sort_values("length")
            ax.plot(g["length"], g["retrieved_cov"], "-", color="#c8c8c8", linewidth=0.9, zorder=1,
                    label=None if others_labelled else "other native variants (margin, m4, qnovel, ...)")
            others_labelled = True
        n_lo, n_hi = 10 ** 9, 0
        for router in [x for x in HEADLINE_ROUTERS if x in present]:
            g = d[d.router == router].sort_values("length")
            sp = spread.loc[[(bb, router, L) for L in g["length"]]]
            half, n = sp["_half_ci"].to_numpy(), sp["size"].to_numpy()
            native = router in NATIVE_VARIANTS
            color = PALETTE.get(router, "#aaaaaa")
            n_lo, n_hi = min(n_lo, int(n.min())), max(n_hi, int(n.max()))
            ax.plot(g["length"], g["retrieved_cov"], "-" if native else "--", marker="o" if native else "s",
                    color=color, linewidth=2.4 if router in ("tf", "embmax_centered") else 1.4, zorder=3,
                    label=('native = tf (the paper' + "'s)" if router == 'tf' else router) + ('' if native else ' (external)'))
            ax.fill_between(g["length"], g["retrieved_cov"] - half, g["retrieved_cov"] + half, color=color,
                            alpha=0.15, linewidth=0, zorder=2)
        lengths = sorted(d["length"].unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [length_label(x) for x in lengths])
        ax.minorticks_off()
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(f"retrieved gold coverage (top-{r})")
        ax.set_title(f"{bb} (n = {n_lo}-{n_hi} examples per point)" if n_hi and n_lo != n_hi
                     else f"{bb} (n = {n_hi} per point)")
        ax.grid(alpha=0.3)
    figure_legend(fig, axes, ncol=4)
    fig.suptitle("Is the archived evidence retrieved? Routers, top-2 (bands: 95% CI; n: examples per point)")
    save_figure(fig, path, rect=legend_rect(fig, legend_in=0.8))


def rank_native(df, lengths, r: int = 2):
    """Native variants ranked by retrieved coverage relative to BM25 (coverage_vs_bm25) at `lengths`:
    variants measured at every (task, length) BM25 was come first (one run on a subset must not win
    by missing its hard cells), then by worst-task ratio, then mean ratio.
    -> (the comparison, the ranking [min, mean, n, complete] by router, task-lengths in all); the
    comparison is empty when there is nothing to rank."""
    cmp = coverage_vs_bm25(df, lengths=lengths, r=r)
    if cmp.empty:
        return cmp, None, 0
    n_all = cmp.groupby(["task", "length"]).ngroups
    rank = cmp.groupby("router").agg(min=("ratio", "min"), mean=("ratio", "mean"),
                                     n=("ratio", lambda x: cmp.loc[x.index].groupby(["task", "length"]).ngroups))
    rank["complete"] = rank["n"] == n_all
    return cmp, rank.sort_values(["complete", "min", "mean"], ascending=False), n_all


def routers_section(df, r: int = 2, bar_lengths=(1 << 16, 1 << 20), figure: str = "router_coverage.png") -> list[str]:
    """Markdown lines: per backbone, router x length tables of accuracy and coverage with address
    bytes per note, then the best native variant's retrieved coverage relative to BM25 per task."""
    t = routers_table(df, r)
    if t.empty:
        return []
    lines = [f"## Routers and native addressing variants (top-{r})", "",
             "`tf` is the paper's rule (Eq. 5, one address per channel); the other native variants are "
             "training-free and use only the backbone's features; bm25/dense/meanemb/random/oracle "
             "choose among the same archived notes. Coverage = fraction of gold values found in the "
             "archive (archived) or in the replayed notes (retrieved).", "",
             f"![router coverage]({figure})", ""]
    for bb in sorted(t.backbone.unique()):
        d = t[t.backbone == bb]
        lines += [f"### {bb}: accuracy | archived coverage | retrieved coverage", ""]
        lengths = sorted(d.length.unique())
        lines.append("| router | addr bytes/note | " + " | ".join(length_label(x) for x in lengths) + " |")
        lines.append("|" + "---|" * (len(lengths) + 2))
        order = [x for x in (*NATIVE_VARIANTS, *EXTERNAL_ROUTERS) if x in set(d.router)]
        order += sorted(set(d.router) - set(order))
        for router in order:
            g = d[d.router == router].set_index("length")
            cells = []
            for x in lengths:
                if x in g.index:
                    row = g.loc[x]
                    mark = "" if row.all_tasks else f" ({int(row.n_tasks)} tasks)"
                    cells.append(f"{row.score:.1f} \| {row.archived_cov:.2f} \| {row.retrieved_cov:.2f}{mark}")
                else:
                    cells.append("")
            nbytes = int(g["address_bytes_per_note"].max()) if router in NATIVE_VARIANTS and router not in ADDRESS_FREE else 0
            lines.append(f"| {router} | {nbytes if nbytes else '-'} | " + " | ".join(cells) + " |")
        lines.append("")
        cmp, rank, n_all = rank_native(df[df.backbone == bb], [x for x in bar_lengths if x in lengths], r)
        if cmp.empty:
            continue
        paper_bytes = d[d.router == "tf"]["address_bytes_per_note"].max() if (d.router == "tf").any() else None
        best = rank.index[0]
        partial = "" if rank.loc[best, "complete"] else f", measured at {rank.loc[best, 'n']} of {n_all} task-lengths"
        best_bytes = 0 if best in ADDRESS_FREE else d[d.router == best]["address_bytes_per_note"].max()
        storage = ("none: it reads the note token ids stored for replay" if best in ADDRESS_FREE else
                   f"{best_bytes / paper_bytes:.0f}x the paper's {int(paper_bytes)} B" if paper_bytes else f"{int(best_bytes)} B")
        lines += [f"Retrieved coverage relative to BM25 at {', '.join(length_label(x) for x in sorted(cmp.length.unique()))} "
                  f"(target: >= 0.95 on every task, storage <= 4x). Best native variant by worst-task ratio: "
                  f"**{best}** (worst {rank.loc[best, 'min']:.2f}, mean {rank.loc[best, 'mean']:.2f}{partial}; address storage {storage}).", ""]
        piv = cmp.pivot_table(index="router", columns=["length", "task"], values="ratio")
        lines.append("| router | " + " | ".join(f"{length_label(L)} {t_}" for L, t_ in piv.columns) + " |")
        lines.append("|" + "---|" * (len(piv.columns) + 1))
        for router in [x for x in NATIVE_VARIANTS if x in piv.index]:
            lines.append(f"| {router} | " + " | ".join("" if np.isnan(v) else f"{v:.2f}" for v in piv.loc[router].values) + " |")
        bm = cmp.drop_duplicates(["task", "length"]).set_index(["length", "task"])["bm25_cov"]
        lines.append("| (bm25 coverage) | " + " | ".join(f"{bm.get((L, t_), float('nan')):.2f}" for L, t_ in piv.columns) + " |")
        lines.append("")
    return lines


BAR_METHODS = ("nb-tf-top2", "nb-tf-top2-reset", "nb-embmax_centered-top2", "nb-embmax_centered-top2-reset")


def bars_section(df, mid: int = 1 << 16, long: int = 1 << 20, methods=BAR_METHODS) -> list[str]:
    """The paper's claims checked per backbone, computed from the rows (not written by hand): Plain
    collapses (six-task mean at 1M <= 20), NoteBank recovers (>= 60 at 1M, >= 40 above Plain at 64K and
    1M), retrieved coverage >= 0.9 x archived; with the examples per (task, length) they rest on. The
    paper's rule is nb-tf-top2; the other rows are the resets and the best training-free native variant."""
    lines = []
    for bb in sorted(df.backbone.unique()):
        d = df[df.backbone == bb]
        if "plain" not in set(d.method) or not set(methods) & set(d.method):
            continue
        per_task = d.groupby(["method", "length", "task"])[["score", "archived_cov", "retrieved_cov"]].mean()
        mean = per_task.groupby(["method", "length"]).mean()
        n_tasks = per_task.groupby(["method", "length"]).size()
        n_ex = d[d.method == "plain"].groupby(["length", "task"])["index"].nunique().groupby("length")

        def get(m, n, col="score"):
            return float(mean.loc[(m, n), col]) if (m, n) in mean.index else float("nan")

        def row(check, value, bar, ok, tasks, fmt="{:.1f}"):
            shown = "—" if np.isnan(value) else fmt.format(value)
            verdict = "—" if np.isnan(value) or ok is None else ("yes" if ok(value) else "**no**")
            return f"| {check} | {shown} | {bar} | {verdict} | {tasks} |"

        lines += [f"## The paper's claims checked: {bb}", "",
                  "Examples per task (plain rows): " + ", ".join(
                      f"{length_label(n)} {int(g.min())}" + ("" if g.min() == g.max() else f"-{int(g.max())}")
                      for n, g in n_ex) + " (10 or more wanted).", "",
                  "| check | measured | target | holds | tasks |", "|---|---|---|---|---|"]
        p_long = get("plain", long)
        lines.append(row("plain, six-task mean at 1M", p_long, "<= 20", lambda v: v <= 20,
                         n_tasks.get(("plain", long), 0)))
        for m in [x for x in methods if x in set(d.method)]:
            lines.append(row(f"{m} at 1M", get(m, long), ">= 60", lambda v: v >= 60, n_tasks.get((m, long), 0)))
            for n in (mid, long):
                lines.append(row(f"{m} minus plain at {length_label(n)}", get(m, n) - get("plain", n), ">= 40",
                                 lambda v: v >= 40, n_tasks.get((m, n), 0)))
                arch = get(m, n, "archived_cov")
                ratio = get(m, n, "retrieved_cov") / arch if arch > 0 else float("nan")
                lines.append(row(f"{m} retrieved / archived coverage at {length_label(n)}", ratio, ">= 0.9",
                                 lambda v: v >= 0.9, n_tasks.get((m, n), 0), "{:.2f}"))
        if "nb-oracle-top2" in set(d.method):  # what any top-2 router can reach (4 values in 4 notes: 0.5)
            for n in (mid, long):
                arch = get("nb-oracle-top2", n, "archived_cov")
                ratio = get("nb-oracle-top2", n, "retrieved_cov") / arch if arch > 0 else float("nan")
                lines.append(row(f"ceiling: nb-oracle-top2 retrieved / archived coverage at {length_label(n)}",
                                 ratio, "(reference)", None, n_tasks.get(("nb-oracle-top2", n), 0),
                                 "{:.2f}"))
        lines.append("")
    return lines


def lora_section(df) -> list[str]:
    """The paper's Table 4 2x2 from sweep rows: plain / plain-lora / nb-tf-top2 / nb-lora-top2."""
    need = {"plain", "plain-lora", "nb-tf-top2", "nb-lora-top2"}
    lines = []
    for bb in sorted(df.backbone.unique()):
        d = df[(df.backbone == bb) & df.method.isin(need)]
        if set(d.method) != need:
            continue
        per_task = d.groupby(["method", "length", "task"])["score"].mean().reset_index()
        common = set.intersection(*(set(per_task[per_task.method == m].length) for m in need))
        per_task = per_task[per_task.length.isin(common)]
        mean = per_task.groupby("method")["score"].mean()
        lines += [f"## {bb}: frozen vs LoRA reader x with/without NoteBank (paper Table 4)", "",
                  f"Six-task means over {', '.join(length_label(x) for x in sorted(common))} "
                  "(adapters: models/tiny-gdn-lora, trained by bench/lora_2x2.py).", "",
                  "| memory access \\ reader | frozen | LoRA |", "|---|---|---|",
                  f"| w/o NoteBank | {mean['plain']:.2f} | {mean['plain-lora']:.2f} |",
                  f"| w/ NoteBank (top-2) | {mean['nb-tf-top2']:.2f} | {mean['nb-lora-top2']:.2f} |", "",
                  _md_table(per_task, "method", "length", "score"), ""]
    return lines




# ---------------------------------------------------------------------------------------------
# report.md (short) and report-appendix.md (every table)
# ---------------------------------------------------------------------------------------------
class _Diffs:
    """Paired differences against Plain, computed once per (backbone, method, length)."""

    def __init__(self, df):
        self.df, self.cache = df, {}

    def __call__(self, bb, m, n):
        k = (bb, m, n)
        if k not in self.cache:
            self.cache[k] = paired_difference(self.df, bb, m, n)
        return self.cache[k]


def _ci(iv, digits: int = 1) -> str:
    return f"{iv.estimate:+.{digits}f} [{iv.low:+.{digits}f}, {iv.high:+.{digits}f}]"


def headline_table(st: pd.DataFrame, bb: str) -> list[str]:
    """Markdown: headline methods x lengths, 'mean ± half the 95% CI (n)'."""
    lengths = _lengths(st, bb)
    lines = ["| method | " + " | ".join(length_label(x) for x in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for m in headline_methods(st, bb):
        cells = [(lambda s: "—" if s is None else _pm(s))(_stat(st, bb, m, n)) for n in lengths]
        lines.append(f"| {method_label(m)} `{m}` | " + " | ".join(cells) + " |")
    return lines


def diagnosis(df, st: pd.DataFrame, bb: str, diffs=None) -> list[str]:
    """Markdown bullets, in words, computed from the rows: how Plain fares with length, what the best
    native router with lambda = 0 recovers, why the paper's router falls short, and where NoteBank
    loses to Plain (a 95% interval of the paired difference entirely below 0)."""
    diffs = diffs or _Diffs(df)
    lengths = _lengths(st, bb)
    if not lengths or _stat(st, bb, "plain", lengths[0]) is None:
        return []
    L0, L1 = lengths[0], lengths[-1]
    s0, s1 = length_label(L0), length_label(L1)
    p0, p1 = _stat(st, bb, "plain", L0), _stat(st, bb, "plain", L1)
    out = []
    if p1 is not None and L1 != L0:
        out.append(f"- **Plain** goes from {p0['mean']:.1f} at {s0} to {p1['mean']:.1f} at {s1}.")
    nat, how = best_native_reset(st, bb)
    n1 = _stat(st, bb, nat, L1) if nat else None
    if n1 is not None:
        d1 = diffs(bb, nat, L1)
        text = f"- **{method_label(nat)}** reads {n1['mean']:.1f} at {s1}"
        if d1 is not None:
            text += (f", {d1.estimate:+.1f} points vs Plain (95% CI {d1.low:+.1f} to {d1.high:+.1f}, "
                     f"{d1.n} paired examples)")
        ahead = [n for n in lengths if (d := diffs(bb, nat, n)) is not None and d.low > 0]
        if ahead:
            text += f"; it is ahead of Plain at {', '.join(length_label(n) for n in ahead)}"
        o = _stat(st, bb, ORACLE_RESET, L1)
        if o is not None:
            text += f". Oracle notes with λ=0 (the most top-2 replay can give) read {o['mean']:.1f} there"
        out.append(text + f". Router {how}.")
    t1 = _stat(st, bb, PAPER_METHOD, L1)
    if t1 is not None:
        text = f"- **The paper's router** (`{PAPER_METHOD}`, no reset) reads {t1['mean']:.1f} at {s1}"
        c_tf = _mean_over_tasks(df, bb, PAPER_METHOD, L1, "retrieved_cov")
        c_nat = _mean_over_tasks(df, bb, nat, L1, "retrieved_cov") if nat else float("nan")
        if not np.isnan(c_tf):
            text += f". Its two replayed notes hold {c_tf:.0%} of the gold values"
            if not np.isnan(c_nat):
                text += f" (the native router above: {c_nat:.0%})"
        o_nr, o_r = _stat(st, bb, "nb-oracle-top2", L1), _stat(st, bb, ORACLE_RESET, L1)
        if o_nr is not None and o_r is not None and o_r["mean"] - o_nr["mean"] > 20:
            text += (f", and even oracle notes read only {o_nr['mean']:.1f} without λ=0 ({o_r['mean']:.1f} with it): "
                     "at this length the state left by the context spoils the replay unless it is reset")
        out.append(text + ".")
    nb = [m for m in headline_methods(st, bb) if m.startswith("nb-")]
    losses = [(m, d) for m in nb if (d := diffs(bb, m, L0)) is not None and d.high < 0]
    if losses:
        parts = "; ".join(f"{method_label(m)} {d.estimate:+.1f} (95% CI {d.low:+.1f} to {d.high:+.1f})"
                          for m, d in losses)
        text = f"- **At {s0} NoteBank loses to Plain** ({p0['mean']:.1f}): {parts}."
        reset = next((m for m, _ in losses if is_reset(m)), None)
        if reset:
            arch = _mean_over_tasks(df, bb, reset, L0, "archived_cov")
            ret = _mean_over_tasks(df, bb, reset, L0, "retrieved_cov")
            text += " λ=0 throws away a state that at this length still holds the answer"
            text += (f"; the two replayed notes then hold {ret:.0%} of the gold values ({arch:.0%} were archived)."
                     if not (np.isnan(arch) or np.isnan(ret)) else ".")
        out.append(text)
    elif nb:
        below = [(m, d) for m in nb if (d := diffs(bb, m, L0)) is not None and d.estimate < 0]
        if below:
            out.append(f"- At {s0} " + "; ".join(f"{method_label(m)} is {-d.estimate:.1f} below Plain"
                                                 for m, d in below)
                       + " (the 95% interval includes 0: not a clear loss).")
    return out


def in_short(df, st: pd.DataFrame, order, diffs) -> list[str]:
    """One line per backbone: Plain at its shortest and longest length, the best native router with
    lambda = 0 at the longest, and that router minus Plain at both ends (95% CI)."""
    lines = ["| backbone | Plain, shortest | Plain, longest | NoteBank (native, λ=0), longest | "
             "minus Plain, longest | minus Plain, shortest |", "|---|---|---|---|---|---|"]
    for bb in order:
        lengths = _lengths(st, bb)
        nat = best_native_reset(st, bb)[0]
        if not lengths or not nat:
            continue
        L0, L1 = lengths[0], lengths[-1]
        cells = []
        for m, n in (("plain", L0), ("plain", L1), (nat, L1)):
            s = _stat(st, bb, m, n)
            cells.append("—" if s is None else f"{_pm(s)} at {length_label(n)}")
        for n in (L1, L0):
            d = diffs(bb, nat, n)
            cells.append("—" if d is None else f"**{_ci(d)}**" if d.low > 0 or d.high < 0 else _ci(d))
        lines.append(f"| {bb} | " + " | ".join(cells) + " |")
    return lines if len(lines) > 2 else []


def losses_section(df, st: pd.DataFrame, order, diffs) -> list[str]:
    """Every (backbone, length, headline NoteBank method) whose paired difference to Plain has its
    whole 95% interval below 0, and how many are below but inconclusive."""
    rows, unclear = [], 0
    for bb in order:
        for n in _lengths(st, bb):
            for m in [x for x in headline_methods(st, bb) if x.startswith("nb-")]:
                d = diffs(bb, m, n)
                if d is None:
                    continue
                if d.high < 0:
                    rows.append(f"| {bb} | {length_label(n)} | `{m}` | {_stat(st, bb, m, n)['mean']:.1f} | "
                                f"{_stat(st, bb, 'plain', n)['mean']:.1f} | {_ci(d)} | {d.n} |")
                elif d.estimate < 0:
                    unclear += 1
    lines = ["## Where NoteBank loses", ""]
    if not rows:
        lines += ["No headline NoteBank method is below Plain with a 95% interval that excludes 0.", ""]
    else:
        lines += ["Headline NoteBank methods below Plain on the same examples, the whole 95% interval of the "
                  "paired difference below 0:", "",
                  "| backbone | length | method | NoteBank | Plain | difference [95% CI] | pairs |",
                  "|---|---|---|---|---|---|---|", *rows, ""]
    if unclear:
        lines += [f"{unclear} more (backbone, length, method) cells are below Plain with an interval that "
                  "includes 0 (see the appendix tables).", ""]
    return lines


def routers_summary(df, st: pd.DataFrame, order, r: int = 2, lengths=(1 << 16, 1 << 20)) -> list[str]:
    if "retrieved_cov" not in df or routers_table(df, r).empty:
        return []
    lines = [f"## Routers and native addressing variants (top-{r})", "",
             "Per router (colour), at 64K (else a middle length) and at the longest length: accuracy without "
             "(hatched) and with λ=0 "
             "(solid), 95% CI whiskers, and the share of gold values its two notes hold (black diamond, x 100); "
             "a measured 0 is labelled, no bar means not measured. "
             "`tf` is the paper's rule (Eq. 5); the other native variants are training-free and use only the "
             "backbone's own features; bm25 / dense / meanemb / random / oracle choose among the same notes.", "",
             "![routers](routers.png)", ""]
    for bb in order:
        d = df[df.backbone == bb]
        at = [x for x in lengths if x in set(d.length)] or [int(d.length.max())]
        cmp, rank, n_all = rank_native(d, at, r)
        if cmp.empty:
            continue
        best = rank.index[0]
        part = "" if rank.loc[best, "complete"] else f", measured at {rank.loc[best, 'n']} of {n_all} task-lengths"
        tf = (f"; the paper's `tf`: worst {rank.loc['tf', 'min']:.2f}, mean {rank.loc['tf', 'mean']:.2f}"
              if "tf" in rank.index else "")
        lines.append(f"- **{bb}**: retrieved gold coverage relative to BM25 at "
                     f"{', '.join(length_label(x) for x in sorted(cmp.length.unique()))}: best native router "
                     f"`{best}` (worst task {rank.loc[best, 'min']:.2f}, mean {rank.loc[best, 'mean']:.2f}{part}){tf}.")
    return lines + ["", f"Every router's accuracy and coverage by length: [{APPENDIX}]({APPENDIX}).", ""]


def cost_summary(df, st: pd.DataFrame, order, analytical: bool) -> list[str]:
    tables = []
    for bb in order:
        methods = [m for m in headline_methods(st, bb) if m != "plain"]
        t = cost_ratios(df, bb, methods)
        if not t.empty:
            tables.append((bb, methods, t))
    if not tables and not analytical:
        return []
    lines = ["## Cost: measured and analytical", ""]
    if tables:
        lengths = sorted(set().union(*(set(t.length) for _, _, t in tables)))
        lines += ["Wall time per example relative to Plain on the same examples (1.00 = Plain), with 95% "
                  "intervals: reading the context (the same for every method, taken from the Plain row), writing "
                  "the notes (NoteBank only) and answering (probe, route, replay and generation). The cells ran "
                  "side by side on shared CPUs, so absolute seconds are noisy; the ratios compare methods on the "
                  "same example.", "",
                  "![cost relative to Plain](cost_vs_length.png)", "",
                  "| backbone | method | " + " | ".join(length_label(x) for x in lengths) + " |",
                  "|---|---|" + "---|" * len(lengths)]
        for bb, methods, t in tables:
            for m in methods:
                g = t[t.method == m].set_index("length")
                if g.empty:
                    continue
                cells = [f"{g.loc[n, 'ratio']:.2f} [{g.loc[n, 'low']:.2f}, {g.loc[n, 'high']:.2f}]" if n in g.index
                         else "—" for n in lengths]
                lines.append(f"| {bb} | `{m}` | " + " | ".join(cells) + " |")
        lines.append("")
    if analytical:
        lines += [f"Analytical FLOPs and bytes (paper App. C.6-C.7) beside the measured time and archive size: "
                  f"[{APPENDIX}]({APPENDIX}).", ""]
    return lines


def ci_table(st: pd.DataFrame, bb: str) -> list[str]:
    """Markdown: every method x length, 'mean ± half the 95% CI'; a cell measured on fewer tasks than
    the backbone ran there says how many (not comparable, not in summary.json)."""
    d = st[st.backbone == bb]
    lengths = sorted(int(x) for x in d.length.unique())
    lines = ["| method | " + " | ".join(length_label(x) for x in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for m in sorted(d.method.unique()):
        cells = []
        for n in lengths:
            g = d[(d.method == m) & (d.length == n)]
            if g.empty:
                cells.append("")
                continue
            s = g.iloc[0]
            cell = f"{s['mean']:.1f} ± {(s['high'] - s['low']) / 2:.1f}"
            cells.append(cell if s["complete"] else f"{cell} ({int(s['n_tasks'])} tasks)")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def _examples_line(st: pd.DataFrame, bb: str) -> str:
    d = st[(st.backbone == bb) & (st.method == "plain")].sort_values("length")
    if d.empty:
        d = st[st.backbone == bb].groupby("length").agg(per_task_min=("per_task_min", "min"),
                                                        per_task_max=("per_task_max", "max")).reset_index()
    return "Examples per task (Plain): " + ", ".join(
        f"{length_label(r.length)} {r.per_task_min}"
        + ("" if r.per_task_min == r.per_task_max else f"-{r.per_task_max}")
        for r in d.itertuples()) + "."


HOW_TO_READ = ("Every score is on 0-100: the mean over tasks of the per-task mean (RULER's six NIAH tasks), "
               "**± half its 95% bootstrap interval** ({n_boot} resamples of the examples within each task, "
               "seed {seed}), **(n examples)**. λ=0: the recurrent state is reset before the notes are replayed "
               "(paper App. C.3). Files: `results.json` (per key: mean, stderr, n, 95% CI, model, config hash), "
               "`summary.json` (means only), `results.parquet` (one row per example and method).")


def report_lines(df, st: pd.DataFrame, title: str, meta: dict | None, analytical: bool) -> list[str]:
    order = backbone_order(st)
    diffs = _Diffs(df)
    lines = [f"# {title}", ""] + [f"- **{k}**: {v}" for k, v in (meta or {}).items()]
    lines += [f"- **rows**: {len(df)} (backbones {', '.join(order)}; tasks {', '.join(sorted(df.task.unique()))})", "",
              HOW_TO_READ.format(n_boot=N_BOOT, seed=SEED), f"Every table: [{APPENDIX}]({APPENDIX}).", ""]
    short = in_short(df, st, order, diffs)
    if short:
        lines += ["## In short", "",
                  "The best native router with λ=0 against Plain, per backbone (difference in points, 95% CI; "
                  "bold: the interval excludes 0).", "", *short, ""]
    lines += ["## Headline", "",
              "Per backbone, best-measured first: Plain (no memory), JRT (the context read twice), NoteBank with "
              "the paper's router, NoteBank with the best native router and λ=0, and oracle notes with λ=0 "
              "(what any top-2 router could reach). Cells: mean ± half the 95% CI (n examples).", ""]
    for bb in order:
        if not headline_methods(st, bb):
            continue
        lines += [f"### {bb}", "", f"![{bb}](headline-{_safe(bb)}.png)", "", *headline_table(st, bb), "",
                  _examples_line(st, bb), "", *diagnosis(df, st, bb, diffs), ""]
    lines += losses_section(df, st, order, diffs)
    lines += routers_summary(df, st, order)
    lines += cost_summary(df, st, order, analytical)
    lines += lora_section(df)
    return lines


def appendix_lines(df, st: pd.DataFrame, title: str, cost_lines=()) -> list[str]:
    lines = [f"# {title}: all tables", "", f"The short report: [report.md](report.md). "
             + HOW_TO_READ.format(n_boot=N_BOOT, seed=SEED), "",
             "![coverage](coverage.png)", ""]
    for bb in backbone_order(st):
        d = df[df.backbone == bb]
        lines += [f"## {bb}", "", "### Mean over tasks (0-100, ± half the 95% CI)", "", _examples_line(st, bb), "",
                  *ci_table(st, bb), ""]
        for task in sorted(d.task.unique()):
            lines += [f"### {task}", "", _md_table(d[d.task == task], "method", "length", "score"), ""]
        nb = d[d.method.str.startswith("nb-")]
        if not nb.empty and "archived_cov" in nb:
            lines += ["### Coverage (archived | retrieved), mean over tasks", "",
                      _md_table(nb, "method", "length", "archived_cov", "{:.2f}"), "",
                      _md_table(nb, "method", "length", "retrieved_cov", "{:.2f}"), ""]
    lines += bars_section(df)
    if "retrieved_cov" in df:
        lines += routers_section(df)
    return lines + list(cost_lines)


def write_report(rows, out_dir: str, title: str = "RULER evaluation", meta: dict | None = None,
                 costs: dict | None = None, answer_budget: int | None = None, config_of=None) -> dict:
    """Write report.md, report-appendix.md, results.json, summary.json and the plots under out_dir.
    -> the flat summary (summary.json).
    costs: {(backbone, budget): pipeline.reporting.cost.CostModel} for the analytical cost tables;
    answer_budget: |Y| where rows do not record answer lengths; config_of(backbone, budget, method):
    the config entry behind those rows, hashed into results.json (None: rows only)."""
    from notebank.schemas.results import rows_table
    df = as_frame(rows)
    rows_table(df)                                   # the rows schema: refuse bad rows before writing anything
    st = cell_stats(df)
    summary = write_results_files(df, out_dir, st, config_of)
    order = backbone_order(st)
    for bb in order:
        if headline_methods(st, bb):
            plot_headline(st, bb, os.path.join(out_dir, f"headline-{_safe(bb)}.png"))
    plot_accuracy_vs_length(st, os.path.join(out_dir, "accuracy_vs_length.png"), order)
    if "retrieved_cov" in df:
        plot_routers(df, st, os.path.join(out_dir, "routers.png"), order=order)
        plot_router_coverage(df, os.path.join(out_dir, "router_coverage.png"))
        plot_coverage(df, os.path.join(out_dir, "coverage.png"))
    plot_cost(df, st, os.path.join(out_dir, "cost_vs_length.png"), order=order)
    analytical = []
    if costs:
        from notebank.pipeline.reporting.cost import cost_section
        analytical = cost_section(df, costs, answer_budget)
    write_markdown(out_dir, report_lines(df, st, title, meta, bool(analytical)))
    write_markdown(out_dir, appendix_lines(df, st, title, analytical), APPENDIX)
    return summary
