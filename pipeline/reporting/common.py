"""Helpers every report shares: length labels, matplotlib on Agg, panel grids, summary.json and report.md."""
from __future__ import annotations

import json
import os


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
    os.makedirs(out_dir, exist_ok=True)
    summary = summarize(df)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, **(json_kw or {"indent": 2}))
        f.write("\n")
    return summary, [f"# {title}", ""] + [f"- **{k}**: {v}" for k, v in (meta or {}).items()]


def write_markdown(out_dir: str, lines: list[str]) -> None:
    """report.md: the lines, newline-terminated."""
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
