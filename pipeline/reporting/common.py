"""Helpers every report shares: length labels, the method palette, matplotlib on Agg, panel grids,
summary.json and report.md."""
from __future__ import annotations

import json
import os
import re

# One colour per method family in every figure of every report. A NoteBank method is coloured by its
# router (nb-tf-top1/2/4 share the tf colour); the lambda = 0 variant (-reset) keeps that colour and,
# where both appear in one figure (routers.png), is told apart by fill: hatched without the reset,
# solid with it. Line plots draw the methods without NoteBank dashed.
PALETTE: dict[str, str] = {
    # no NoteBank
    "plain": "#222222",            # near-black
    "jrt": "#8c564b",              # brown
    "clean-start": "#7f7f7f",      # grey
    "plain-lora": "#bcbd22",       # olive
    # NoteBank, by router; the headline ones first
    "tf": "#1f77b4",               # blue: the paper's native router (Eq. 5)
    "embmax_centered": "#2ca02c",  # green: the best native router measured
    "oracle": "#9467bd",           # purple: a note holding a gold value (the ceiling)
    "bm25": "#ff7f0e",             # orange
    "dense": "#d62728",            # red
    "meanemb": "#e377c2",          # pink
    "random": "#c49c94",           # tan
    "lora": "#17becf",             # cyan: NB-LoRA reader (tf router)
    "embmax": "#98df8a",           # light green
    "margin": "#ffbb78",           # light orange
    "sum": "#f7b6d2",              # light pink
    "m4": "#9edae5",               # light cyan
    "m4margin": "#dbdb8d",         # light olive
    "m4sum": "#c5b0d5",            # lavender
    "qnovel": "#ff9896",           # salmon
    "qnovelmargin": "#393b79",     # navy
    "m4qnovelmargin": "#637939",   # dark olive
}
FALLBACK_COLOR = "#aaaaaa"         # a method the palette does not know (drawn, never confused with plain)
_NB = re.compile(r"^nb-(?P<router>[a-z0-9_]+)-top(?P<r>\d+)(?P<reset>-reset)?$")


def method_family(method: str) -> str:
    """The PALETTE key of a method: the router of nb-<router>-top<R>[-reset], else the name."""
    m = _NB.match(method)
    return m["router"] if m else method


def method_color(method: str) -> str:
    return PALETTE.get(method_family(method), FALLBACK_COLOR)


def is_reset(method: str) -> bool:
    """lambda = 0 before replay (nb-...-reset)."""
    return method.endswith("-reset")


def method_label(method: str) -> str:
    """What a figure legend calls a method."""
    fixed = {"plain": "Plain (no memory)", "jrt": "JRT (context read twice)", "clean-start": "clean start",
             "plain-lora": "Plain + LoRA", "nb-tf-top2": "NoteBank, paper router (native = tf)",
             "nb-oracle-top2-reset": "oracle notes, λ=0 (ceiling)", "nb-lora-top2": "NB-LoRA (tf)"}
    if method in fixed:
        return fixed[method]
    m = _NB.match(method)
    if not m:
        return method
    return f"NoteBank, {m['router']} top-{m['r']}" + (", λ=0" if m["reset"] else "")


def n_label(counts) -> str:
    """'n=60' when every length has 60 examples, else 'n=12-60' (examples per point)."""
    lo, hi = int(min(counts)), int(max(counts))
    return f"n={lo}" if lo == hi else f"n={lo}-{hi}"


def length_label(n: int) -> str:
    n = int(n)
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}K"
    return str(n)


def as_frame(rows):
    """rows (a DataFrame or an iterable of dicts) as a DataFrame."""
    import pandas as pd
    return rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))


def pyplot():
    """matplotlib.pyplot on the Agg backend: reports are drawn to files on machines without a display."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str, rect=None) -> None:
    """Write a report plot (PNG, 110 dpi) and close it: a sweep's report draws many figures.
    rect: the (left, bottom, right, top) box tight_layout fits the axes into (room for a figure legend)."""
    import matplotlib.pyplot as plt
    fig.tight_layout(**({"rect": rect} if rect else {}))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def panel_grid(plt, n: int, width: float, height: float, max_cols: int = 3):
    """n panels of width x height inches, at most max_cols per row (a wide sweep stays readable).
    -> (fig, the first n axes in reading order); spare axes of the last row are hidden."""
    ncols = min(n, max_cols)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def legend_rect(fig, legend_in: float = 0.6, title_in: float = 0.45) -> tuple:
    """tight_layout box leaving legend_in inches below the panels and title_in above them."""
    h = fig.get_size_inches()[1]
    return (0, legend_in / h, 1, 1 - title_in / h)


def figure_legend(fig, axes, ncol: int) -> None:
    """One legend below all panels: each label once, in first-seen order (colours are shared)."""
    handles = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(ncol, len(handles)),
               fontsize=8, frameon=False)


def start_report(df, out_dir: str, summarize, title: str, meta: dict | None, **json_kw) -> tuple[dict, list[str]]:
    """Create out_dir and write summarize(df) to summary.json (json_kw: json.dump options, default indent=2).
    -> (summary, the first report.md lines: title and one bullet per `meta` item)."""
    summary = summarize(df)
    write_summary_json(out_dir, summary, **json_kw)
    return summary, [f"# {title}", ""] + [f"- **{k}**: {v}" for k, v in (meta or {}).items()]


def write_markdown(out_dir: str, lines: list[str], name: str = "report.md") -> None:
    """<out_dir>/<name> (default report.md): the lines, newline-terminated."""
    with open(os.path.join(out_dir, name), "w") as f:
        f.write("\n".join(lines) + "\n")


def write_summary_json(out_dir: str, summary: dict, **json_kw) -> None:
    """summary.json: the flat {"<key>": number} map (json_kw: json.dump options, default indent=2)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, **(json_kw or {"indent": 2}))
        f.write("\n")
