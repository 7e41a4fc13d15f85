"""bench/streaming_summary.py (the issue-49 table) on hand-made rows, and the sweep's config."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]


def _rows(method, task, length, scores, budget="default"):
    return [dict(backbone="smollm2-135m", budget=budget, method=method, task=task, length=length, index=i,
                 score=float(s)) for i, s in enumerate(scores)]


def test_summary_keys_means_cis_and_cells_override(tmp_path):
    from bench.streaming_summary import main
    ruler = tmp_path / "ruler"
    (ruler / "cells" / "a").mkdir(parents=True)
    shipped = _rows("plain", "niah_single_2", 16384, [0, 0, 100, 0]) + \
        _rows("nb-tf-top2", "phrased_niah_heldout", 4096, [100, 100, 0, 100])
    pd.DataFrame(shipped).to_parquet(ruler / "results.parquet")
    # a finished cell re-measured example 2 of plain/niah_single_2/16K: its row wins
    pd.DataFrame(_rows("plain", "niah_single_2", 16384, [0, 0, 0])[2:]).to_parquet(ruler / "cells" / "a" / "0002.parquet")
    pd.DataFrame(_rows("nb-oracle-top2-reset", "niah_single_2", 65536, [100, 50])).to_parquet(
        ruler / "cells" / "a" / "0000.parquet")
    s = main(["--ruler", str(ruler), "--out", str(tmp_path)])
    assert set(s) == {"smollm2-135m/plain/niah_single_2/16K", "smollm2-135m/nb-tf-top2/phrased_heldout/4K",
                      "smollm2-135m/nb-oracle-top2-reset/niah_single_2/64K"}
    assert s["smollm2-135m/plain/niah_single_2/16K"] == {"mean": 0.0, "n": 4, "ci": [0.0, 0.0], "stderr": 0.0}
    r = s["smollm2-135m/nb-tf-top2/phrased_heldout/4K"]
    assert r["mean"] == 75.0 and r["n"] == 4 and r["ci"][0] < 75.0 <= r["ci"][1] <= 100.0
    assert s["smollm2-135m/nb-oracle-top2-reset/niah_single_2/64K"]["mean"] == 75.0
    assert json.loads((tmp_path / "summary.json").read_text()) == s
    md = (tmp_path / "summary.md").read_text()
    assert "| nb-tf-top2 |" in md and "phrased_heldout 4K" in md
    assert (tmp_path / "headline.png").stat().st_size > 1000


def test_two_sweep_folders_merge_and_saved_rows_hold_both(tmp_path):
    from bench.streaming_summary import main
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "cells").mkdir(parents=True)
    (b / "cells").mkdir(parents=True)
    pd.DataFrame(_rows("plain", "niah_single_2", 65536, [0, 100])).to_parquet(a / "cells" / "0.parquet")
    pd.DataFrame(_rows("plain", "phrased_niah_heldout", 65536, [100, 100, 0])).to_parquet(b / "cells" / "0.parquet")
    # the same measurement in both folders: the later folder's row wins
    pd.DataFrame(_rows("plain", "niah_single_2", 65536, [100])).to_parquet(b / "cells" / "1.parquet")
    rows = tmp_path / "rows.parquet"
    s = main(["--ruler", str(a), str(b), "--out", str(tmp_path), "--save-rows", str(rows)])
    assert s["smollm2-135m/plain/niah_single_2/64K"]["mean"] == 100.0
    assert s["smollm2-135m/plain/phrased_heldout/64K"]["n"] == 3
    assert len(pd.read_parquet(rows)) == 5
    assert f"`{a}`, `{b}`" in (tmp_path / "summary.md").read_text()


def test_streaming_sweep_config_is_valid():
    from notebank.pipeline.config import load_config
    from notebank.pipeline.evaluate_ruler import RulerJobConfig
    cfg = load_config(RulerJobConfig, REPO / "configs" / "eval_streaming_smollm2.yaml").validate()
    main, icl = cfg.backbones
    assert main.model.streaming == {"sinks": 4, "window": 1024} and icl.model.streaming["window"] == 8188
    assert (icl.label, icl.method_names, cfg.lengths_for(icl)) == ("smollm2-135m", {"plain": "icl"}, ["4K"])
    assert cfg.examples_at("64K", main) == 10 and cfg.examples_at("16K", main) == 20
    assert {"plain", "nb-tf-top2-reset", "nb-embmax_centered-top2", "nb-bm25-top2-reset",
            "nb-oracle-top2-reset"} <= set(cfg.methods_at(main, "16K"))


def _mone_rows(method, task, length, scores, rag_k=None):
    return [dict(method=method, task=task, task_label=task, length=length, index=i, score=float(s), rag_k=rag_k,
                 rag_recall=None if rag_k is None else 100.0, pred="", answers=["1"]) for i, s in enumerate(scores)]


def test_mone_harness_rows_join_the_table_with_rag_at_its_best_k(tmp_path):
    from bench.streaming_summary import main
    ruler, mone = tmp_path / "ruler", tmp_path / "mone"
    ruler.mkdir()
    (mone / "cells" / "mone").mkdir(parents=True)
    pd.DataFrame(_rows("plain", "niah_single_2", 4096, [0, 100])).to_parquet(ruler / "results.parquet")
    rag = (_mone_rows("rag-bm25", "niah_single_2", 4096, [0, 0], rag_k=1)
           + _mone_rows("rag-bm25", "niah_single_2", 4096, [100, 0], rag_k=4)
           + _mone_rows("rag-bm25", "niah_single_2", 4096, [100, 100], rag_k=8)
           + _mone_rows("rag-bm25", "phrased_niah_heldout", 4096, [100, 0], rag_k=1)
           + _mone_rows("rag-bm25", "phrased_niah_heldout", 4096, [100, 0], rag_k=4))
    pd.DataFrame(rag).to_parquet(mone / "results.parquet")
    # a finished cell: mone on two examples, plus a re-measured shipped row (the cell wins)
    pd.DataFrame(_mone_rows("mone", "niah_single_2", 4096, [100, 0]) + _mone_rows("rag-bm25", "niah_single_2", 4096,
                 [0], rag_k=8)).to_parquet(mone / "cells" / "mone" / "0.parquet")
    s = main(["--ruler", str(ruler), "--out", str(tmp_path)])       # --mone defaults to `mone` beside --ruler
    assert s["smollm2-135m/mone/niah_single_2/4K"]["mean"] == 50.0
    # K 8 scored 0 + 100 after the cell's row replaced example 0: a tie with K 4 -> the smaller K, 50
    assert s["smollm2-135m/rag-bm25/niah_single_2/4K"] == {**s["smollm2-135m/rag-bm25/niah_single_2/4K"],
                                                           "mean": 50.0, "n": 2}
    assert s["smollm2-135m/rag-bm25/phrased_heldout/4K"]["n"] == 2      # one K's rows, not both
    assert s["smollm2-135m/plain/niah_single_2/4K"]["mean"] == 50.0
    md = (tmp_path / "summary.md").read_text()
    assert "| rag-bm25 |" in md and "| mone |" in md and "eval_streaming_smollm2_mone.yaml" in md
    assert "K per cell: niah_single_2 4K: 4, phrased_heldout 4K: 1" in md
    # without the folder the table is the streaming rows alone
    s2 = main(["--ruler", str(ruler), "--mone", str(tmp_path / "absent"), "--out", str(tmp_path / "o")])
    assert set(s2) == {"smollm2-135m/plain/niah_single_2/4K"}


def test_streaming_mone_config_uses_the_streaming_examples():
    from notebank.pipeline.config import load_config
    from notebank.pipeline.evaluate_mone import MoneEvalJobConfig
    from notebank.pipeline.evaluate_ruler import RulerJobConfig
    m = load_config(MoneEvalJobConfig, REPO / "configs" / "eval_streaming_smollm2_mone.yaml").validate()
    r = load_config(RulerJobConfig, REPO / "configs" / "eval_streaming_smollm2.yaml").validate()
    assert m.model == r.backbones[0].model.path and (m.seed, m.split) == (r.seed, "test")
    assert set(m.tasks) <= set(r.tasks) and "phrased_niah_heldout" in m.tasks
    assert m.label == "smollm2-135m" and set(m.methods) == {"mone", "rag-bm25"}
