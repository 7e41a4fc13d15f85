"""The table a job ends with: method labels, n, bootstrap intervals, 'nothing to do'."""
import json

import pytest

from notebank.pipeline.summary_table import bootstrap_ci, method_label, method_rows, render, results_table


def test_bootstrap_ci_brackets_the_mean_and_is_seeded():
    v = [0.0, 100.0, 100.0, 0.0, 100.0]
    lo, hi = bootstrap_ci(v)
    assert lo <= 60.0 <= hi and (lo, hi) == bootstrap_ci(v)
    assert bootstrap_ci([42.0]) == (42.0, 42.0)


def test_method_rows_and_labels():
    rc = json.dumps({"method": "notebank", "top_r": 2, "router": "embmax_centered", "lam": None,
                     "reset_above_tokens": 32768, "max_new_tokens": 8, "stop": [], "stop_at_eos": True})
    old = json.dumps({"method": "notebank", "top_r": 2, "router": "native", "lam": None, "max_new_tokens": 8,
                      "stop": [], "stop_at_eos": True})
    assert method_label("notebank", rc) == "notebank (embmax_centered, top-2, reset past 32K)"
    assert method_label("notebank", old) == "notebank (native, top-2, no reset)"
    rows = [{"method": "plain", "read_config": "{}", "status": "ok", "score": s, "total_s": 0.5} for s in (100, 0)]
    rows += [{"method": "notebank", "read_config": rc, "status": "failed", "score": None, "total_s": None}]
    m = method_rows(rows)
    assert m[0]["method"] == "plain" and m[0]["n"] == 2 and m[0]["score"] == pytest.approx(50.0)
    assert m[1]["n"] == 0 and m[1]["failed"] == 1 and m[1]["score"] is None


def test_ingest_with_nothing_to_do_says_so():
    text = render({"docs_ok": 0, "docs_skipped": 3, "docs_failed": 0, "output": "out/a"})
    assert "nothing to do: all 3 documents are already archived" in text
    q = render({"questions_ok": 0, "questions_failed": 0, "rows": 0, "already_answered": 6, "output": None})
    assert "nothing to do: all 6 (question, method) pairs are already answered" in q


def test_results_table_cells_have_ci_and_n():
    t = results_table({"m/plain/4K": {"value": 50.0, "ci": [40.0, 60.0], "n-samples": 12},
                       "m/plain/16K": {"value": 20.0, "ci": [10.0, 30.0], "n-samples": 12}})
    assert t.index("4K") < t.index("16K") and "50.0 ±10.0 (12)" in t
