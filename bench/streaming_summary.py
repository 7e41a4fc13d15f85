"""The head-to-head table of NoteBank on SmolLM2-135M (streaming: sinks + sliding window), issue 49.

Reads the RULER rows of configs/eval_streaming_smollm2.yaml: `<ruler>/results.parquet` (what the
repository ships) and every finished cell under `<ruler>/cells/` (a running sweep's; a cell's rows
replace results.parquet's rows of the same measurement), and writes beside it
    summary.json   {"smollm2-135m/<method>/<task>/<length>": {"mean": 0-100, "n": examples,
                    "ci": [low, high] (95% percentile bootstrap over examples), "stderr": ...}, ...}
                   lengths `4K`, `16K`, `64K`; phrased_niah_heldout reported as `phrased_heldout`
    summary.md     the table (methods x task/length cells, mean [CI] n)
    headline.png   niah_single_2 and phrased_heldout: plain vs the NoteBank methods, per length

It also reads the rows of configs/eval_streaming_smollm2_mone.yaml (`<mone>/results.parquet` and its
cells): `mone` and `rag-bm25` on the same frozen SmolLM2-135M and the same examples (same task,
length, index, seed, test split and tokenizer), so one table compares every memory. rag-bm25 is
reported at its best K per (task, length), the MoNe paper's rule (pipeline/reporting/mone.py).

    python bench/streaming_summary.py [--ruler FOLDER [FOLDER ...]] [--mone FOLDER] [--save-rows PARQUET]
    (default folders: bench/results/streaming-smollm2/ruler and `mone` beside it)
"""
from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OUT = REPO / "bench" / "results" / "streaming-smollm2"
TASK_NAMES = {"phrased_niah_heldout": "phrased_heldout"}
KEY = ["backbone", "budget", "method", "task", "length", "index"]
METHOD_ORDER = ["icl", "rag-bm25", "mone", "plain", "clean-start", "nb-tf-top2", "nb-tf-top2-reset", "nb-embmax_centered-top2",
                "nb-embmax_centered-top2-reset", "nb-bm25-top2", "nb-bm25-top2-reset", "nb-oracle-top2",
                "nb-oracle-top2-reset"]
HEADLINE_TASKS = ["niah_single_2", "phrased_heldout"]
# the plot keeps one read per router (no -reset twins: those are in summary.md) so bars stay readable
HEADLINE_METHODS = ["icl", "rag-bm25", "mone", "plain", "nb-tf-top2", "nb-embmax_centered-top2", "nb-bm25-top2",
                    "nb-oracle-top2"]
MONE_LABEL = "smollm2-135m"     # the MoNe rows' backbone: the streaming rows' reported name


def length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _frames(folder: Path) -> list:
    """A sweep output's row tables: results.parquet (what the repository ships), then every finished cell."""
    import pandas as pd
    shipped = folder / "results.parquet"
    cells = sorted(glob.glob(str(folder / "cells" / "**" / "*.parquet"), recursive=True))
    return ([pd.read_parquet(shipped)] if shipped.is_file() else []) + [pd.read_parquet(f) for f in cells]


def read_rows(ruler_dir: Path):
    """All rows: results.parquet, then the cells (a cell's rows win for the same measurement)."""
    import pandas as pd
    frames = _frames(ruler_dir)
    if not frames:
        return pd.DataFrame(columns=KEY + ["score"])
    df = pd.concat(frames, ignore_index=True)
    if "budget" not in df:
        df["budget"] = "default"
    return df.drop_duplicates(subset=KEY, keep="last")


def read_mone_rows(mone_dir: Path):
    """The MoNe harness's rows (results.parquet, then finished cells) as streaming-table rows: rag at its
    best K per (task, length); backbone ``MONE_LABEL``, budget ``default``."""
    import pandas as pd

    from notebank.pipeline.reporting.mone import best_rows
    frames = _frames(mone_dir)
    if not frames:
        return pd.DataFrame(columns=KEY + ["score"])
    df = pd.concat(frames, ignore_index=True)
    df = df.drop_duplicates(subset=["method", "task", "length", "index", "rag_k"], keep="last")
    df = best_rows(df.assign(task_label=df["task"]))
    return df.assign(backbone=MONE_LABEL, budget="default")[KEY + ["score", "rag_k"]]


def summarize(df) -> dict:
    from nbcore.evals.stats import bootstrap_mean_ci
    out = {}
    for (bb, method, task, length), g in df.groupby(["backbone", "method", "task", "length"], sort=True):
        ci = bootstrap_mean_ci(g.sort_values("index")["score"].to_numpy(dtype=float))
        key = f"{bb}/{method}/{TASK_NAMES.get(task, task)}/{length_label(int(length))}"
        out[key] = {"mean": round(ci.estimate, 2), "n": int(ci.n), "ci": [round(ci.low, 2), round(ci.high, 2)],
                    "stderr": round(ci.stderr, 2)}
    return out


def _order(m: str) -> tuple:
    return (METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER), m)


def _len_order(x: str) -> int:
    return int(x[:-1]) * 1024 if x.endswith("K") else int(x)


def table_md(summary: dict) -> str:
    keys = [k.split("/") for k in summary]
    cols = sorted({(t, L) for _, _, t, L in keys}, key=lambda c: (c[0], _len_order(c[1])))
    lines = []
    for bb in sorted({k[0] for k in keys}):
        methods = sorted({m for b, m, _, _ in keys if b == bb}, key=_order)
        lines += [f"### {bb}", "", "| method | " + " | ".join(f"{t} {L}" for t, L in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for m in methods:
            cells = []
            for t, L in cols:
                r = summary.get(f"{bb}/{m}/{t}/{L}")
                cells.append(f"{r['mean']:.1f} [{r['ci'][0]:.0f}, {r['ci'][1]:.0f}] n={r['n']}" if r else "")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def headline_png(summary: dict, path: Path) -> bool:
    rows = [k.split("/") + [v] for k, v in summary.items()
            if k.split("/")[2] in HEADLINE_TASKS and k.split("/")[1] in HEADLINE_METHODS]
    if not rows:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(HEADLINE_TASKS), figsize=(6 * len(HEADLINE_TASKS), 4.4), squeeze=False)
    for ax, task in zip(axes[0], HEADLINE_TASKS):
        sub = [r for r in rows if r[2] == task]
        lengths = sorted({r[3] for r in sub}, key=_len_order)
        methods = sorted({r[1] for r in sub}, key=lambda m: HEADLINE_METHODS.index(m))
        width = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            for x, L in enumerate(lengths):
                r = next((r[4] for r in sub if r[1] == m and r[3] == L), None)
                if r is None:
                    continue
                c = f"C{HEADLINE_METHODS.index(m)}"
                ax.bar(x + i * width, r["mean"], width, color=c, label=m)
                ax.errorbar(x + i * width, r["mean"], yerr=[[r["mean"] - r["ci"][0]], [r["ci"][1] - r["mean"]]],
                            color="black", lw=0.8, capsize=2)
                ax.text(x + i * width, 1, f"n={r['n']}", rotation=90, fontsize=6, ha="center", va="bottom")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(lengths))], lengths)
        ax.set_ylim(0, 105)
        ax.set_ylabel("accuracy (%)")
        ax.set_title(f"SmolLM2-135M streaming (4 sinks + W=1024): {task}", fontsize=10)
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    order = sorted(range(len(labels)), key=lambda i: HEADLINE_METHODS.index(labels[i]))
    fig.legend([handles[i] for i in order], [labels[i] for i in order], loc="lower center",
               ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    return True


def _rel(p) -> str:
    p = Path(p).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ruler", nargs="+", default=[str(OUT / "ruler")], metavar="FOLDER",
                    help="sweep output folders (a later folder's rows win for the same measurement)")
    ap.add_argument("--mone", default=None, metavar="FOLDER",
                    help="output of configs/eval_streaming_smollm2_mone.yaml (mone and rag-bm25 on the same "
                         "examples; default: `mone` beside the first --ruler folder); a missing folder adds nothing")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--save-rows", default=None, metavar="PARQUET",
                    help="also write the merged rows here (e.g. bench/results/streaming-smollm2/ruler/results.parquet "
                         "after a sweep run with another output folder)")
    a = ap.parse_args(argv)
    a.mone = a.mone or str(Path(a.ruler[0]).parent / "mone")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import pandas as pd
    df = pd.concat([read_rows(Path(r)) for r in a.ruler], ignore_index=True).drop_duplicates(subset=KEY, keep="last")
    if a.save_rows:
        Path(a.save_rows).parent.mkdir(parents=True, exist_ok=True)
        df.sort_values(["backbone", "task", "length", "index", "method"]).reset_index(drop=True).to_parquet(
            a.save_rows, index=False)
    mone = read_mone_rows(Path(a.mone))
    both = pd.concat([df, mone], ignore_index=True) if len(mone) else df
    summary = summarize(both) if len(both) else {}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    md = ["# NoteBank on SmolLM2-135M-Instruct (streaming: 4 sinks + 1,024-token window)", "",
          "RULER accuracy (0-100): mean [95% bootstrap CI] n = examples. Rows from "
          + ", ".join(f"`{_rel(r)}`" for r in a.ruler) + " (configs/eval_streaming_smollm2.yaml)"
          + (f" and `{_rel(a.mone)}` (configs/eval_streaming_smollm2_mone.yaml: `mone` and `rag-bm25` on the "
             "full-attention base, same examples; rag-bm25 at its best K in {1, 4, 8} per task and length, "
             "128-token chunks)" if len(mone) else "")
          + "; written by bench/streaming_summary.py.", "",
          *(["rag-bm25's K per cell: " + ", ".join(
              f"{TASK_NAMES.get(t, t)} {length_label(int(L))}: {int(k)}"
              for (t, L), k in sorted(mone[mone.method == "rag-bm25"].groupby(["task", "length"])["rag_k"].first()
                                      .items())), ""] if len(mone) and (mone.method == "rag-bm25").any() else []),
          table_md(summary) if summary else "(no finished cells yet)"]
    (out / "summary.md").write_text("\n".join(md) + "\n")
    headline_png(summary, out / "headline.png")
    print(json.dumps({"cells": len(summary), "out": str(out)}))
    return summary


if __name__ == "__main__":
    main()
