"""Evaluation results users can trust: bootstrap intervals, the results schema (rows and summary),
the short report, one colour per method, and the shipped RULER results rebuilt from results.parquet."""
from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from nbcore.evals.stats import bootstrap_mean_ci, bootstrap_ratio_ci, resample_indices, stratified_mean
from notebank.schemas import results as R
from notebank.schemas._base import SchemaError, parquet_bytes_to_table, table_to_parquet_bytes

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "bench" / "results" / "ruler"


# ---------------------------------------------------------------------------------------------
# Bootstrap intervals
# ---------------------------------------------------------------------------------------------
def _scores(n_per_task=(10, 10, 6), seed=1):
    rng = np.random.default_rng(seed)
    values, tasks = [], []
    for t, n in enumerate(n_per_task):
        values += list(rng.choice([0.0, 50.0, 100.0], size=n, p=[0.3, 0.2, 0.5]))
        tasks += [f"t{t}"] * n
    return np.array(values), np.array(tasks)


def test_bootstrap_matches_a_naive_loop_over_the_same_draws():
    x, tasks = _scores()
    iv = bootstrap_mean_ci(x, tasks, n_boot=500, seed=3)
    draws = resample_indices(len(x), tasks, 500, 3)          # per task: (n_boot, n_task) row indices
    reps = []
    for b in range(500):                                     # one replicate at a time, plain Python
        task_means = [sum(x[i] for i in d[b]) / len(d[b]) for d in draws]
        reps.append(sum(task_means) / len(task_means))
    lo, hi = np.quantile(reps, [0.025, 0.975])
    assert iv.low == pytest.approx(lo) and iv.high == pytest.approx(hi)
    assert iv.stderr == pytest.approx(np.std(reps, ddof=1))
    assert iv.estimate == pytest.approx(np.mean([x[tasks == t].mean() for t in ("t0", "t1", "t2")]))
    assert iv.n == len(x)


def test_bootstrap_agrees_with_an_independent_resampler():
    """A from-scratch stratified bootstrap (random.choices) lands on the same interval within noise."""
    x, tasks = _scores((20, 20, 20))
    iv = bootstrap_mean_ci(x, tasks, n_boot=4000, seed=0)
    rnd = random.Random(7)
    groups = [list(x[tasks == t]) for t in sorted(set(tasks))]
    reps = sorted(sum(sum(rnd.choices(g, k=len(g))) / len(g) for g in groups) / len(groups) for _ in range(4000))
    assert iv.low == pytest.approx(reps[int(0.025 * 4000)], abs=1.5)
    assert iv.high == pytest.approx(reps[int(0.975 * 4000)], abs=1.5)


def test_bootstrap_is_seeded_contains_the_mean_and_shrinks_with_n():
    x, tasks = _scores()
    a, b = bootstrap_mean_ci(x, tasks, seed=5), bootstrap_mean_ci(x, tasks, seed=5)
    assert a == b                                            # same seed, same interval, bit for bit
    assert bootstrap_mean_ci(x, tasks, seed=6) != a
    widths = []
    for n in (5, 20, 80, 320):
        xs, ts = _scores((n, n, n), seed=2)
        iv = bootstrap_mean_ci(xs, ts)
        assert iv.low <= iv.estimate <= iv.high
        widths.append(iv.high - iv.low)
    assert widths == sorted(widths, reverse=True) and widths[-1] < widths[0] / 4   # ~ 1/sqrt(n)


def test_bootstrap_edge_cases():
    iv = bootstrap_mean_ci([100.0, 0.0, 100.0], ["a", "b", "c"])   # one example per task: pooled resampling
    assert iv.estimate == pytest.approx(200 / 3) and iv.low < iv.estimate < iv.high
    assert bootstrap_mean_ci([50.0] * 4).half_width == 0.0
    assert stratified_mean([100, 0, 0, 0], ["a", "b", "b", "b"]) == 50.0
    with pytest.raises(ValueError):
        bootstrap_mean_ci([])
    with pytest.raises(ValueError):
        bootstrap_mean_ci([1.0, float("nan")])
    with pytest.raises(ValueError):
        bootstrap_mean_ci([1.0, 2.0], ["a"])


def test_ratio_interval_is_paired():
    rng = np.random.default_rng(0)
    base = rng.uniform(1, 100, size=60)                      # wildly different examples ...
    iv = bootstrap_ratio_ci(base * 1.1, base)                # ... each 10% dearer: a tight interval
    assert iv.estimate == pytest.approx(1.1) and iv.high - iv.low < 1e-9
    noisy = bootstrap_ratio_ci(base * rng.uniform(1.0, 1.2, size=60), base)
    assert noisy.low < noisy.estimate < noisy.high and 1.0 < noisy.low


# ---------------------------------------------------------------------------------------------
# The results schema: per-example rows and results.json
# ---------------------------------------------------------------------------------------------
def _rows():
    rows = []
    for bb in ("m1", "m2"):
        for method in ("plain", "jrt", "nb-tf-top2", "nb-embmax_centered-top2-reset", "nb-oracle-top2-reset",
                       "nb-bm25-top2"):
            for length in (4096, 65536):
                if method == "jrt" and length > 4096:
                    continue
                for task in ("a", "b"):
                    for i in range(4):
                        good = method != "plain" if length > 4096 else (method == "plain" or i % 2 == 0)
                        rows.append(dict(backbone=bb, budget="default", method=method, task=task, length=length,
                                         index=i, score=100.0 if good else 0.0,
                                         archived_cov=1.0, retrieved_cov=0.5 if method.startswith("nb-") else 0.0,
                                         address_bytes_per_note=128, n_tokens=length, n_notes=4, archived_tokens=100,
                                         replay_len=50, question_tokens=20, ingest_s=length / 4096,
                                         write_s=0.01, probe_s=0.001, route_s=0.001,
                                         replay_generate_s=0.1 * (2 if method == "jrt" else 1),
                                         prediction="x", answers=["x"]))
    return rows


def test_rows_round_trip_and_carry_the_schema_version():
    table = R.rows_table(pd.DataFrame(_rows()))
    back = parquet_bytes_to_table(table_to_parquet_bytes(table), "results.parquet")
    assert R.validate_rows(back, "results.parquet") is back
    meta = R.schema_meta(back.schema)
    assert meta["notebank.schema"] == "ruler.rows" and meta["notebank.schema_version"] == str(R.ROWS_VERSION)
    assert back.to_pylist() == _rows()
    legacy = pa.Table.from_pylist(_rows())                   # written before the schema: no metadata
    R.validate_rows(legacy)
    with pytest.raises(SchemaError, match="NaN"):
        R.validate_rows(pa.Table.from_pylist([dict(_rows()[0], score=float("nan"))]))


def test_a_counter_that_older_rows_lack_keeps_its_integer_type():
    # rows of an older run have no answer_tokens; pandas concatenation makes the column float + NaN
    old, new = pd.DataFrame(_rows()[:8]), pd.DataFrame(_rows()[8:16]).assign(answer_tokens=7)
    table = R.rows_table(pd.concat([old, new], ignore_index=True))
    assert pa.types.is_integer(table.schema.field("answer_tokens").type)
    assert table.column("answer_tokens").to_pylist() == [None] * 8 + [7] * 8
    with pytest.raises(SchemaError, match="answer_tokens.*type"):     # a real fraction still fails
        R.rows_table(pd.concat([old, new.assign(answer_tokens=7.5)], ignore_index=True))


def _set(col, value, row=3):
    def change(df):
        df = df.copy()
        df[col] = df[col].astype(object) if value is None or isinstance(value, str) else df[col]
        df.loc[row, col] = value
        return df
    return change


@pytest.mark.parametrize("change,match", [
    (lambda df: df.drop(columns="score"), "missing required columns"),
    (_set("score", 101.0), "score.*outside"),
    (_set("score", float("nan")), "score.*(nulls|NaN)"),
    (_set("retrieved_cov", 1.5), "retrieved_cov.*outside"),
    (_set("ingest_s", -1.0), "ingest_s.*outside"),
    (lambda df: df.astype({"length": str}), "length.*type"),
    (_set("backbone", None), "backbone.*null"),
], ids=["no-score", "score>100", "nan", "coverage>1", "negative-time", "length-str", "null-backbone"])
def test_bad_rows_are_rejected(change, match):
    with pytest.raises(SchemaError, match=match):
        R.rows_table(change(pd.DataFrame(_rows())))


def test_rows_of_another_schema_or_version_are_rejected():
    table = R.rows_table(_rows())
    meta = dict(table.schema.metadata)
    with pytest.raises(SchemaError, match="version"):
        R.validate_rows(table.replace_schema_metadata({**meta, b"notebank.schema_version": b"99"}))
    with pytest.raises(SchemaError, match="expected 'ruler.rows'"):
        R.validate_rows(table.replace_schema_metadata({**meta, b"notebank.schema": b"answers"}))


def _entry(**kw):
    cfg = {"benchmark": "ruler", "backbone": "m", "method": "plain", "length": 4096, "parts": []}
    e = dict(metric="score", value=50.0, stderr=5.0, n=20, ci=(40.0, 60.0), model="models/m",
             config_hash=R.config_hash(cfg), n_tasks=2)
    e.update(kw)
    return R.SummaryEntry(**e), cfg


def test_results_json_round_trip_and_validation(tmp_path):
    e, cfg = _entry()
    doc = R.results_document({"m/plain/4K": e}, {e.config_hash: cfg}, benchmark="ruler",
                             bootstrap={"n_boot": 10}, versions={"numpy": "x"})
    path = str(tmp_path / "results.json")
    R.write_results(path, doc)
    back, entries = R.read_results(path)
    assert back == json.loads(json.dumps(doc)) and entries["m/plain/4K"] == e
    got = json.loads((tmp_path / "results.json").read_text())["results"]["m/plain/4K"]
    assert got["n-samples"] == 20 and got["ci"] == [40.0, 60.0] and got["model"] == "models/m"
    assert R.flat_summary(entries) == {"m/plain/4K": 50.0}
    bad = json.loads(json.dumps(doc))
    bad["configs"][e.config_hash]["length"] = 8192          # edited by hand: the hash no longer matches
    with pytest.raises(SchemaError, match="does not hash"):
        R.validate_results(bad)
    for field, value, match in (("n-samples", 0, "n must be"), ("ci", [60.0, 40.0], "ci low"),
                                ("config_hash", "xyz", "16 hex"), ("value", float("nan"), "finite")):
        bad = json.loads(json.dumps(doc))
        bad["results"]["m/plain/4K"][field] = value
        with pytest.raises(SchemaError, match=match):
            R.validate_results(bad)
    bad = json.loads(json.dumps(doc))
    del bad["results"]["m/plain/4K"]["n-samples"]
    with pytest.raises(SchemaError, match="n-samples"):
        R.validate_results(bad)
    with pytest.raises(SchemaError, match="version"):
        R.validate_results(dict(doc, schema_version=2))
    (tmp_path / "cut.json").write_bytes((tmp_path / "results.json").read_bytes()[:50])
    with pytest.raises(SchemaError, match="cut.json.*not valid JSON"):
        R.read_results(str(tmp_path / "cut.json"))


# ---------------------------------------------------------------------------------------------
# Colours
# ---------------------------------------------------------------------------------------------
def test_each_method_has_one_distinct_colour():
    import matplotlib.colors as mc

    from notebank.pipeline.reporting.common import FALLBACK_COLOR, PALETTE, is_reset, method_color
    rgb = {k: np.array(mc.to_rgb(v)) for k, v in PALETTE.items()}
    assert len(set(PALETTE.values())) == len(PALETTE)
    closest = min(np.linalg.norm(rgb[a] - rgb[b]) for a, b in itertools.combinations(rgb, 2))
    assert closest > 0.15, closest                           # distinct to the eye, not only in hex
    assert FALLBACK_COLOR not in PALETTE.values()
    assert method_color("nb-tf-top2") == method_color("nb-tf-top2-reset") == method_color("nb-tf-top4") == PALETTE["tf"]
    # every method the shipped sweep measured has its own family colour; the headline five differ
    methods = set(pd.read_parquet(SHIPPED / "results.parquet", columns=["method"]).method)
    assert all(method_color(m) != FALLBACK_COLOR for m in methods), sorted(methods)
    families = {}
    for m in methods:
        families.setdefault(method_color(m), set()).add(m.replace("-reset", "").replace("-top1", "-top2")
                                                        .replace("-top4", "-top2"))
    assert all(len(v) == 1 for v in families.values()), families
    head = ["plain", "jrt", "nb-tf-top2", "nb-embmax_centered-top2-reset", "nb-oracle-top2-reset"]
    assert len({method_color(m) for m in head}) == 5 and is_reset(head[-1]) and not is_reset(head[2])


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------
def _check_report_dir(out: Path):
    report = (out / "report.md").read_text()
    assert len(report.splitlines()) <= 300
    assert "issue" not in report.lower() and "issue" not in (out / "report-appendix.md").read_text().lower()
    assert "Routers and native addressing" in report and "## Cost: measured and analytical" in report
    doc, entries = R.read_results(str(out / "results.json"))
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == set(entries) and entries
    for key, e in entries.items():
        raw = doc["results"][key]
        assert raw["n-samples"] >= 1 and len(raw["ci"]) == 2 and raw["ci"][0] <= raw["value"] <= raw["ci"][1]
        assert summary[key] == round(e.value, 2)
    return report, doc


def test_report_is_short_with_intervals_and_every_figure(tmp_path):
    from notebank.pipeline.reporting.ruler import (MAX_REPORT_LINES, best_native_reset, cell_stats,
                                                   headline_methods, write_report)
    df = pd.DataFrame(_rows())
    summary = write_report(df, str(tmp_path), title="t", config_of=lambda bb, bud, m: {"model": {"path": f"p/{bb}"}})
    report, doc = _check_report_dir(tmp_path)
    assert MAX_REPORT_LINES == 300 and summary["m1/plain/4K"] == 100.0 and summary["m1/plain/64K"] == 0.0
    st = cell_stats(df)
    assert headline_methods(st, "m1") == ["plain", "jrt", "nb-tf-top2", "nb-embmax_centered-top2-reset",
                                          "nb-oracle-top2-reset"]
    assert best_native_reset(st, "m1")[0] == "nb-embmax_centered-top2-reset"
    assert doc["results"]["m1/plain/4K"]["model"] == "p/m1" and doc["results"]["m1/plain/4K"]["n-samples"] == 8
    # plain 100 at 4K, every NoteBank method 50 there (half its examples): the report says NoteBank loses
    assert "## Where NoteBank loses" in report and "| m1 | 4K | `nb-embmax_centered-top2-reset` | 50.0 | 100.0 |" in report
    assert "**At 4K NoteBank loses to Plain** (100.0)" in report
    assert "| Plain (no memory) `plain` | 100.0 ± 0.0 (8) | 0.0 ± 0.0 (8) |" in report
    for name in ("accuracy_vs_length.png", "headline-m1.png", "headline-m2.png", "routers.png",
                 "cost_vs_length.png", "coverage.png", "router_coverage.png"):
        assert (tmp_path / name).stat().st_size > 1000, name
    with pytest.raises(SchemaError, match="score"):         # bad rows never reach a report
        write_report(df.assign(score=df.score * 2), str(tmp_path / "bad"))
    assert not (tmp_path / "bad" / "report.md").exists()


def test_cost_ratio_takes_the_context_read_from_plain():
    """A method measured in another run (slower machine) is charged Plain's read of the same example."""
    from notebank.pipeline.reporting.ruler import cost_ratios
    df = pd.DataFrame(_rows())
    slow = df.method == "nb-oracle-top2-reset"
    df.loc[slow, "ingest_s"] *= 10
    t = cost_ratios(df, "m1", ["jrt", "nb-oracle-top2-reset"]).set_index(["method", "length"])
    plain = 1 - 0.01 + 0.102                                 # read (ingest - writer) + answer, at 4K
    assert t.loc[("nb-oracle-top2-reset", 4096), "ratio"] == pytest.approx((1 + 0.102) / plain)
    assert t.loc[("jrt", 4096), "ratio"] == pytest.approx((1 - 0.01 + 0.202) / plain)


def test_report_only_rebuilds_from_results_parquet_alone(tmp_path):
    """jobs/evaluate.py --report-only: no Ray, no cells; results.parquet is read, validated, not written."""
    import pyarrow.parquet as pq

    from notebank.jobs.evaluate import main
    pq.write_table(pa.Table.from_pylist(_rows()), tmp_path / "results.parquet")
    before = (tmp_path / "results.parquet").read_bytes()
    args = ["--set", f"output={tmp_path}", "--set", f"backbones=[{{name: m1, model: {{path: {REPO / 'models/tiny-gdn'}}}}}]",
            "--report-only"]
    out = main(args)
    assert out["rows"] == len(_rows()) and (tmp_path / "results.parquet").read_bytes() == before
    assert not (tmp_path / "cells").exists()
    report, doc = _check_report_dir(tmp_path)
    assert "report rebuilt from its rows" in report
    m1 = doc["configs"][doc["results"]["m1/plain/4K"]["config_hash"]]
    assert [doc["config_parts"][p]["entry"] for p in m1["parts"]] == ["m1"]
    assert doc["configs"][doc["results"]["m2/plain/4K"]["config_hash"]]["parts"] == []   # not in the config
    bad = _rows()
    bad[0]["score"] = 250.0
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "results.parquet")
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2


def test_shipped_ruler_results_are_the_report_of_their_rows():
    """bench/results/ruler: results.json validates, matches summary.json key for key, and the report is short."""
    report, doc = _check_report_dir(SHIPPED)
    assert "tiny-gdn/nb-lora-top2/4K" in doc["results"]
    e = doc["results"]["tiny-gdn-v5/plain/4K"]
    assert e["model"] == "models/tiny-gdn-v5"
    # the evidence the headline rests on: 6 tasks x 20 examples at 4K-256K, 6 x 10 at 1M
    for bb in ("tiny-gdn-v5", "tiny-mamba2-p5"):
        for m in ("plain", "nb-tf-top2", "nb-tf-top2-reset", "nb-embmax_centered-top2-reset",
                  "nb-bm25-top2-reset", "nb-oracle-top2-reset"):
            for length in ("4K", "16K", "64K", "256K"):
                r = doc["results"][f"{bb}/{m}/{length}"]
                assert r["n-samples"] >= 120 and r["ci"][0] <= r["value"] <= r["ci"][1], (bb, m, length)
    for bb in ("tiny-gdn-v5", "tiny-mamba2-p5"):
        assert doc["results"][f"{bb}/nb-embmax_centered-top2-reset/1M"]["n-samples"] >= 60
    assert "(no memory)" in report and "Where NoteBank loses" in report


def test_headline_script_reads_results_json_with_intervals():
    from bench.ruler_headline import headline, load
    flat, full = load(str(SHIPPED / "summary.json")), load(str(SHIPPED / "results.json"))
    assert set(flat) == set(full)
    rows = headline(full, "tiny-gdn-v5", methods=["plain"], lengths=["4K"]).splitlines()
    e = full["tiny-gdn-v5/plain/4K"]
    assert rows[2] == f"| plain | {e['value']:.1f} ± {(e['ci'][1] - e['ci'][0]) / 2:.1f} ({e['n-samples']}) |"
    assert headline(flat, "tiny-gdn-v5", methods=["plain"], lengths=["4K"]).splitlines()[2] == \
        f"| plain | {flat['tiny-gdn-v5/plain/4K']:.1f} |"
