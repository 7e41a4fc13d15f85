"""What a job prints last for a person: a short table (method, score, n, 95% CI, time per answer)
read from the job's own outputs, so a rerun with nothing left to do still shows the results. The
one-line JSON summary is printed instead with `--json` (scripts)."""
from __future__ import annotations

import json

N_BOOT = 2000

# What a reader needs to know to read a row without the paper at hand.
NOTES = {
    "clean_start": "clean_start: the state is reset before the question and no notes are replayed (a floor; "
                   "near 0 is expected)",
    "plain": "plain: the model reads the document once and answers from its state (no memory)",
}


def bootstrap_ci(values: list[float], n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float]:
    """Percentile 95% interval of the mean (resampling the answers)."""
    import numpy as np
    v = np.asarray(values, dtype=float)
    if len(v) == 0:
        return float("nan"), float("nan")
    if len(v) == 1:
        return float(v[0]), float(v[0])
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(n_boot, len(v)))].mean(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def method_label(method: str, read_config: str | None) -> str:
    """`notebank (embmax_centered, top-2, reset past 32K)` for a NoteBank row, else the method."""
    if method != "notebank" or not read_config:
        return method
    try:
        from nbcore.config import ReadConfig
        d = json.loads(read_config)
        d["stop"] = tuple(d.get("stop") or ())
        d.setdefault("reset_above_tokens", None)        # answers written before the rule existed never reset
        return ReadConfig(**d).label()
    except (TypeError, ValueError):
        return method


def answer_rows(answers_url: str) -> list[dict]:
    """The answers dataset's rows (method, read_config, status, score, total_s)."""
    import fsspec
    from notebank.schemas._base import read_parquet_file
    fs, path = fsspec.core.url_to_fs(answers_url)
    files = sorted(p for p in fs.glob(path.rstrip("/") + "/part-*.parquet"))
    cols = ["method", "read_config", "status", "score", "total_s"]
    rows: list[dict] = []
    for f in files:
        with fs.open(f, "rb") as fh:
            t = read_parquet_file(fh)
        rows += t.select([c for c in cols if c in t.column_names]).to_pylist()
    return rows


def method_rows(rows: list[dict]) -> list[dict]:
    """[{method, score, n, ci, s_per_answer, failed}]: plain, jrt, notebank reads, clean_start, others."""
    order = {"plain": 0, "jrt": 1, "notebank": 2, "clean_start": 3}
    groups: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: (order.get(r["method"], 4), r["method"])):
        groups.setdefault(method_label(r["method"], r.get("read_config")), []).append(r)
    out = []
    for label, rs in groups.items():
        ok = [r for r in rs if r.get("status") == "ok"]
        scores = [float(r["score"]) for r in ok if r.get("score") is not None and r["score"] == r["score"]]
        times = [float(r["total_s"]) for r in ok if r.get("total_s") is not None]
        out.append({"method": label, "score": sum(scores) / len(scores) if scores else None, "n": len(scores),
                    "ci": bootstrap_ci(scores) if scores else None,
                    "s_per_answer": sum(times) / len(times) if times else None, "failed": len(rs) - len(ok)})
    return out


def format_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)             # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in body)])


def scores_table(rows: list[dict]) -> str:
    body = []
    for m in method_rows(rows):
        body.append([m["method"], "—" if m["score"] is None else f"{m['score']:.1f}", str(m["n"]),
                     "—" if m["ci"] is None else f"[{m['ci'][0]:.1f}, {m['ci'][1]:.1f}]",
                     "—" if m["s_per_answer"] is None else f"{m['s_per_answer']:.2f}",
                     str(m["failed"])])
    table = format_table(["method", "score", "n", "95% CI", "s/answer", "failed"], body)
    notes = [NOTES[m["method"]] for m in method_rows(rows) if m["method"] in NOTES]
    return "\n".join([table, *notes])


def ingest_lines(s: dict) -> list[str]:
    if not s.get("docs_ok") and not s.get("docs_failed") and s.get("docs_skipped"):
        return [f"ingest: nothing to do: all {s['docs_skipped']} documents are already archived in "
                f"{s.get('output', 'the output')} (unchanged text)"]
    parts = [f"{s.get('docs_ok', 0)} documents archived", f"{s.get('docs_skipped', 0)} already there",
             f"{s.get('docs_failed', 0)} failed"]
    extra = []
    if s.get("tokens") is not None:
        extra.append(f"{s['tokens']:,} tokens")
    if s.get("notes") is not None:
        extra.append(f"{s['notes']:,} notes")
    if s.get("wall_s") is not None:
        extra.append(f"{s['wall_s']:.0f} s")
    return ["ingest: " + ", ".join(parts) + (f" ({', '.join(extra)})" if extra else "")]


def render(summary: dict) -> str:
    """The person-readable end of a job's output (ingest, query, the demo; else key: value lines)."""
    lines: list[str] = []
    if "ingest" in summary and "query" in summary:                         # the demo
        lines += ingest_lines(summary["ingest"])
        lines += _query_lines(summary["query"])
        lines.append(f"files: {summary.get('workdir')} (corpus.jsonl, questions.jsonl, archive/, answers/)")
    elif "docs_ok" in summary:
        lines += ingest_lines(summary)
        lines.append(f"archive: {summary.get('output')}")
    elif "questions_ok" in summary:
        lines += _query_lines(summary)
    elif summary.get("output") and _results_json(summary["output"]) is not None:     # jobs/evaluate.py
        lines += [f"{k}: {v}" for k, v in summary.items() if not isinstance(v, (dict, list))]
        lines += ["", results_table(_results_json(summary["output"])["results"]),
                  f"report: {summary['output'].rstrip('/')}/report.md"]
    else:
        lines += [f"{k}: {v}" for k, v in summary.items() if not isinstance(v, (dict, list))]
    lines.append("(the one-line JSON summary: rerun with --json)")
    return "\n".join(lines)


def _query_lines(s: dict) -> list[str]:
    if not s.get("rows") and s.get("already_answered") and not s.get("questions_failed"):
        out = [f"query: nothing to do: all {s['already_answered']} (question, method) pairs are already answered "
               f"in {s.get('output')}; the table below is read from there"]
    else:
        out = [f"query: {s.get('questions_ok', 0)} questions answered, {s.get('questions_failed', 0)} failed"
               + (f" ({s['wall_s']:.0f} s)" if s.get("wall_s") is not None else "")]
    if s.get("output"):
        try:
            rows = answer_rows(s["output"])
        except (OSError, ValueError) as e:
            return out + [f"(no score table: {e})"]
        if rows:
            out += ["", scores_table(rows), "", f"answers: {s['output']} (a Parquet dataset; schemas/answers.py)"]
    return out


HEADLINE_METHODS = ("plain", "nb-tf-top2", "nb-native-top2", "nb-embmax_centered-top2",
                    "nb-embmax_centered-top2-reset", "nb-oracle-top2-reset", "mone", "icl", "rag")
MAX_ROWS = 12


def results_table(results: dict) -> str:
    """An evaluation's headline: one row per <model>/<method>, one column per length (or task), each
    cell `mean ±half-CI (n)` from results.json (schemas/results.py). More than MAX_ROWS methods:
    the headline methods only (every cell is in report.md)."""
    cells: dict[str, dict[str, str]] = {}
    cols: list[str] = []
    for key, e in results.items():
        if "/" not in key or not isinstance(e, dict) or "value" not in e:
            continue
        row, col = key.rsplit("/", 1)
        lo, hi = (e.get("ci") or [None, None])[:2]
        half = f" ±{(hi - lo) / 2:.1f}" if lo is not None and hi is not None else ""
        cells.setdefault(row, {})[col] = f"{e['value']:.1f}{half} ({e.get('n-samples', e.get('n', '?'))})"
        if col not in cols:
            cols.append(col)
    rows = sorted(cells)
    if len(rows) > MAX_ROWS:
        picked = [r for r in rows if r.split("/")[-1] in HEADLINE_METHODS]
        rows = picked[:MAX_ROWS * 3] if picked else rows[:MAX_ROWS]
    cols = _length_order(cols)
    body = [[r, *(cells[r].get(c, "—") for c in cols)] for r in rows]
    return format_table(["model/method", *cols], body) + "\ncells: mean ±half the 95% CI (n examples)"


def _length_order(cols: list[str]) -> list[str]:
    def size(c):
        mult = {"K": 1024, "M": 1024 ** 2}
        try:
            return (0, float(c[:-1]) * mult[c[-1]]) if c[-1:] in mult else (0, float(c))
        except ValueError:
            return (1, c)
    return sorted(cols, key=size)


def _results_json(output: str) -> dict | None:
    import fsspec
    try:
        with fsspec.open(output.rstrip("/") + "/results.json") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    return d if isinstance(d.get("results"), dict) else None
