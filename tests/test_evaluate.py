"""Evaluation sweep: method names, coverage, report numbers, and a resumable Ray sweep."""
import json

import pandas as pd
import pyarrow.parquet as pq
import pytest

from nbcore.evals.methods import coverage, method_config
from notebank.pipeline.config import ConfigError, load_config
from notebank.pipeline.evaluate import drop_repeated_measurements, run_sweep
from notebank.pipeline.evaluate_ruler import MEASUREMENT_KEY, RulerJobConfig
from notebank.pipeline.reporting.common import length_label
from notebank.pipeline.reporting.ruler import summarize, write_report

from conftest import TINY_MODEL


def plan_cells(cfg):
    return cfg.plan()[0]


@pytest.mark.parametrize("name,method,router,r,lam", [
    ("plain", "plain", "native", 2, None), ("jrt", "jrt", "native", 2, None),
    ("clean-start", "clean_start", "native", 2, 0.0), ("nb-tf-top1", "notebank", "native", 1, None),
    ("nb-bm25-top2", "notebank", "bm25", 2, None), ("nb-meanemb-top4", "notebank", "mean_embedding", 4, None),
    ("nb-tf-top2-reset", "notebank", "native", 2, 0.0)], ids=lambda v: str(v))
def test_method_names(name, method, router, r, lam):
    rc = method_config(name)
    assert (rc.method, rc.top_r, rc.lam) == (method, r, lam)
    if method == "notebank":
        assert rc.router == router


def test_bad_method_name():
    with pytest.raises(ValueError, match="unknown method"):
        method_config("nb-tf-topX")


def test_coverage_and_labels():
    assert coverage(["123", "456"], ["x 123 y", "none"]) == 0.5
    assert coverage(["AbC"], ["zabcz"]) == 1.0 and coverage([], ["a"]) == 0.0
    assert [length_label(n) for n in (4096, 65536, 1 << 20, 1000)] == ["4K", "64K", "1M", "1000"]


def test_summary_is_mean_of_per_task_means(tmp_path):
    rows = []
    for task, scores in (("a", [100, 0, 100, 100]), ("b", [0, 0])):   # task means 75 and 0 -> 37.5
        for i, s in enumerate(scores):
            rows.append(dict(backbone="m", method="plain", task=task, length=4096, index=i, score=s,
                             archived_cov=1.0, retrieved_cov=0.0, ingest_s=1.0, probe_s=0.0, route_s=0.0,
                             replay_generate_s=0.5))
    assert summarize(rows) == {"m/plain/4K": 37.5}
    write_report(pd.DataFrame(rows), str(tmp_path))
    assert json.loads((tmp_path / "summary.json").read_text()) == {"m/plain/4K": 37.5}
    assert (tmp_path / "accuracy_vs_length.png").stat().st_size > 1000
    assert "| Plain (no memory) `plain` | 37.5 ± " in (tmp_path / "report.md").read_text()
    assert "| plain | 37.5 ± " in (tmp_path / "report-appendix.md").read_text()
    entry = json.loads((tmp_path / "results.json").read_text())["results"]["m/plain/4K"]
    assert entry["value"] == 37.5 and entry["n-samples"] == 6 and entry["ci"][0] <= 37.5 <= entry["ci"][1]


@pytest.mark.parametrize("n,shape", [(1, (1, 1)), (3, (1, 3)), (5, (2, 3)), (7, (3, 3))], ids=lambda v: str(v))
def test_panel_grid_wraps_backbones(n, shape, tmp_path):
    from notebank.pipeline.reporting.common import legend_rect, panel_grid, pyplot, save_figure
    plt = pyplot()
    fig, axes = panel_grid(plt, n, 6.5, 4.6)
    grid = fig.axes[0].get_subplotspec().get_gridspec()
    assert (grid.nrows, grid.ncols) == shape and len(axes) == n
    assert [a.get_visible() for a in fig.axes] == [True] * n + [False] * (shape[0] * shape[1] - n)
    assert fig.get_size_inches()[1] == pytest.approx(4.6 * shape[0])
    save_figure(fig, str(tmp_path / "p.png"), rect=legend_rect(fig))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_config_errors():
    with pytest.raises(ConfigError, match="backbones"):
        RulerJobConfig().validate()
    with pytest.raises(ConfigError, match="unknown method"):
        load_config(RulerJobConfig, None, ["backbones=[{name: x, model: {path: m}}]", "methods=[bogus]"]).validate()


def test_sweep_runs_resumes_and_reports(ray_session, tmp_path):
    model = json.dumps(TINY_MODEL)
    cfg = load_config(RulerJobConfig, None, [
        f"output={tmp_path}", f"backbones=[{{name: rand-gdn, model: {model}, notebank: {{chunk_size: 256}}}}]",
        "tasks=[niah_single_1, niah_multivalue]", "lengths=[1K]", "n_examples=2",
        "methods=[plain, nb-tf-top2, nb-oracle-top2]", "max_new_tokens=4", "progress=false"])
    first = run_sweep(cfg)
    assert first["cells"] == 4 and first["cells_run"] == 4 and first["cells_failed"] == 0
    table = pq.read_table(tmp_path / "results.parquet").to_pandas()
    assert len(table) == 4 * 3 and set(table.method) == {"plain", "nb-tf-top2", "nb-oracle-top2"}
    total = table.n_tokens + table.question_tokens          # context + question ~ the target length
    assert ((total - 1024).abs() <= 0.05 * 1024).all(), total.tolist()   # coarse haystack units at 1K
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == {"rand-gdn/plain/1K", "rand-gdn/nb-tf-top2/1K", "rand-gdn/nb-oracle-top2/1K"}
    report = (tmp_path / "report.md").read_text()
    assert "## Routers and native addressing variants (top-2)" in report
    assert "## Cost: measured and analytical" in report and "| 1K |" in report.split("## Cost")[1]
    assert len(report.splitlines()) <= 300 and "| 1K |" in (tmp_path / "report-appendix.md").read_text().split("## Cost")[1]
    assert set(json.loads((tmp_path / "results.json").read_text())["results"]) == set(summary)
    again = run_sweep(cfg)
    assert again["cells_skipped"] == 4 and again["cells_run"] == 0


def test_plan_per_length_counts_methods_and_report_names():
    """n_examples_by_length / methods_by_length / per-backbone lengths shape the grid; an adapter
    entry reports under its base backbone with renamed methods (the NB-LoRA summary keys)."""
    cfg = load_config(RulerJobConfig, None, [
        "backbones=[{name: a, model: {path: m}}, {name: a-lora, report_as: a, model: {path: m, adapter: x},"
        " methods: [nb-tf-top2], method_names: {nb-tf-top2: nb-lora-top2}, lengths: [4K]}]",
        "tasks=[niah_single_1]", "lengths=[4K, 1M]", "n_examples=3", "n_examples_by_length={1M: 1}",
        "methods=[plain, jrt, nb-tf-top2]", "methods_by_length={1M: [plain, nb-tf-top2]}"]).validate()
    cells = plan_cells(cfg)
    got = sorted((c["entry"], c["item"]["length"], c["item"]["index"], tuple(c["methods"])) for c in cells)
    assert got == [("a", 4096, i, ("plain", "jrt", "nb-tf-top2")) for i in range(3)] + \
                  [("a", 1 << 20, 0, ("plain", "nb-tf-top2"))] + \
                  [("a-lora", 4096, i, ("nb-tf-top2",)) for i in range(3)]
    lora = [c for c in cells if c["entry"] == "a-lora"][0]
    assert lora["labels"] == {"backbone": "a", "budget": "default"}
    assert lora["method_names"] == {"nb-tf-top2": "nb-lora-top2"}
    assert lora["path"] != [c for c in cells if c["entry"] == "a"][0]["path"]   # own cell files
    with pytest.raises(ConfigError, match="not in lengths"):
        load_config(RulerJobConfig, None, ["backbones=[{name: a, model: {path: m}}]", "lengths=[4K]",
                                          "n_examples_by_length={64K: 2}"]).validate()


def test_only_backbones_plans_just_those_entries():
    base = ["backbones=[{name: a, model: {path: m}}, {name: b, model: {path: m}}]",
            "tasks=[niah_single_1]", "lengths=[4K]", "n_examples=2", "methods=[plain]"]
    cells = plan_cells(load_config(RulerJobConfig, None, base + ["only_backbones=[b]"]).validate())
    assert {c["entry"] for c in cells} == {"b"} and len(cells) == 2
    assert len(plan_cells(load_config(RulerJobConfig, None, base).validate())) == 4
    with pytest.raises(ConfigError, match="only_backbones: no entry named"):
        load_config(RulerJobConfig, None, base + ["only_backbones=[c]"]).validate()


def test_only_lengths_plans_a_slice_of_the_lengths():
    base = ["backbones=[{name: a, model: {path: m}, n_examples_by_length: {1M: 1}}]",
            "tasks=[niah_single_1]", "lengths=[4K, 16K, 1M]", "n_examples=2", "methods=[plain]"]
    cells = plan_cells(load_config(RulerJobConfig, None, base + ["only_lengths=[16K, 1M]"]).validate())
    assert sorted((c["item"]["length"], c["item"]["index"]) for c in cells) == [(16384, 0), (16384, 1), (1 << 20, 0)]
    with pytest.raises(ConfigError, match="only_lengths"):
        load_config(RulerJobConfig, None, base + ["only_lengths=[64K]"]).validate()


def test_run_cell_reports_under_renamed_backbone_and_methods(tmp_path):
    from nbcore.config import NoteBankConfig
    from nbcore.evals.ruler import Ruler
    from notebank.pipeline.evaluate import make_cell, run_cell
    bench = Ruler(tasks=["niah_single_1"], lengths=[1024], max_new_tokens=2)
    cell = make_cell(bench, next(iter(bench.examples())), str(tmp_path / "c.parquet"), model=dict(TINY_MODEL),
                     methods=["plain", "nb-tf-top2"], notebank=NoteBankConfig(chunk_size=256).to_dict(),
                     block_size=4096, labels={"backbone": "rand", "budget": "default"},
                     method_names={"nb-tf-top2": "nb-lora-top2"})
    res = run_cell(cell)
    assert res["error"] is None and res["n_tokens"] > 0
    t = pq.read_table(tmp_path / "c.parquet").to_pandas()
    assert set(t.backbone) == {"rand"} and list(t.method) == ["plain", "nb-lora-top2"]
    assert set(t.budget) == {"default"} and (t.answer_tokens >= 1).all()
    bad = dict(cell, item={"task": "no-such-task", "length": 1024, "index": 0}, path=str(tmp_path / "bad.parquet"))
    res = run_cell(bad)                                      # a failure is returned, not raised; no file
    assert res["error"].startswith("KeyError") and not (tmp_path / "bad.parquet").exists()


def _row(method, task, length, score, ret, arch=1.0, nbytes=512, backbone="m"):
    return dict(backbone=backbone, method=method, task=task, length=length, index=0, score=score,
                archived_cov=arch, retrieved_cov=ret, address_bytes_per_note=nbytes, ingest_s=1.0,
                probe_s=0.0, route_s=0.0, replay_generate_s=0.5)


def test_routers_section_ranks_variants_against_bm25(tmp_path):
    from notebank.pipeline.reporting.ruler import coverage_vs_bm25, routers_section
    rows = []
    for L in (1 << 16, 1 << 20):
        for task, bm25, tf, m4 in (("a", 1.0, 0.2, 0.97), ("b", 0.5, 0.5, 0.4), ("c", 0.0, 0.0, 0.0)):
            rows += [_row("nb-bm25-top2", task, L, 50, bm25), _row("nb-tf-top2", task, L, 10, tf),
                     _row("nb-m4-top2", task, L, 40, m4, nbytes=2048), _row("nb-tf-top2-reset", task, L, 0, 0.0)]
    df = pd.DataFrame(rows)
    cmp = coverage_vs_bm25(df)
    got = {(r.router, r.task): round(r.ratio, 3) for r in cmp[cmp.length == 1 << 16].itertuples()}
    assert got == {("tf", "a"): 0.2, ("tf", "b"): 1.0, ("tf", "c"): 1.0,      # 0/0 counts as parity
                   ("m4", "a"): 0.97, ("m4", "b"): 0.8, ("m4", "c"): 1.0}
    text = "\n".join(routers_section(df))
    assert "**m4** (worst 0.80" in text and "4x the paper's 512 B" in text   # m4 beats tf on the worst task
    assert "tf-top2-reset" not in text and "| tf | 512 |" in text


def test_lora_section_is_the_2x2(tmp_path):
    from notebank.pipeline.reporting.ruler import lora_section
    rows = [_row(m, t, 4096, s, 0.0) for m, s in (("plain", 10), ("plain-lora", 20), ("nb-tf-top2", 30),
                                                   ("nb-lora-top2", 40)) for t in ("a", "b")]
    text = "\n".join(lora_section(pd.DataFrame(rows)))
    assert "| w/o NoteBank | 10.00 | 20.00 |" in text and "| w/ NoteBank (top-2) | 30.00 | 40.00 |" in text
    write_report(pd.DataFrame(rows), str(tmp_path))
    assert "Table 4" in (tmp_path / "report.md").read_text()


def test_report_only_rebuilds_from_finished_cells(ray_session, tmp_path):
    model = json.dumps(TINY_MODEL)
    args = [f"output={tmp_path}", f"backbones=[{{name: r, model: {model}, notebank: {{chunk_size: 256}}}}]",
            "tasks=[niah_single_1]", "lengths=[1K]", "n_examples=2", "methods=[plain]", "max_new_tokens=2",
            "progress=false"]
    only = run_sweep(load_config(RulerJobConfig, None, args + ["report_only=true"]))
    assert only["cells_run"] == 0 and only["cells_missing"] == 2 and not (tmp_path / "summary.json").exists()
    run_sweep(load_config(RulerJobConfig, None, args[:4] + ["n_examples=1"] + args[5:]))
    again = run_sweep(load_config(RulerJobConfig, None, args + ["report_only=true"]))
    assert again["cells_missing"] == 1 and again["cells_skipped"] == 1
    assert json.loads((tmp_path / "summary.json").read_text()) == {"r/plain/1K": pytest.approx(
        pq.read_table(tmp_path / "results.parquet").to_pandas().score.mean())}


def test_coverage_vs_bm25_is_paired_by_example():
    """A router run on a subset of examples is compared with BM25 on that subset only."""
    from notebank.pipeline.reporting.ruler import coverage_vs_bm25, routers_section
    rows = [_row("nb-bm25-top2", "a", 4096, 0, 1.0), _row("nb-bm25-top2", "a", 4096, 0, 0.0),
            _row("nb-embmax-top2", "a", 4096, 0, 1.0)]
    rows[1]["index"] = 1                                   # bm25 missed example 1; embmax ran only on 0
    cmp = coverage_vs_bm25(pd.DataFrame(rows), lengths=[4096])
    assert cmp[["router", "cov", "bm25_cov", "ratio"]].values.tolist() == [["embmax", 1.0, 1.0, 1.0]]
    text = "\n".join(routers_section(pd.DataFrame(rows), bar_lengths=(4096,)))
    assert "| embmax | - |" in text and "address storage none" in text


def test_summary_leaves_out_methods_measured_on_fewer_tasks():
    rows = [_row("plain", t, 4096, 50, 0.0) for t in ("a", "b")] + [_row("nb-dense-top2", "a", 4096, 100, 1.0)]
    assert summarize(rows) == {"m/plain/4K": 50.0}


def test_entry_that_plans_nothing_is_an_error():
    with pytest.raises(ConfigError, match="no method left"):
        load_config(RulerJobConfig, None, [
            "backbones=[{name: a, model: {path: m}, lengths: [1M]}]",
            "lengths=[4K, 1M]", "methods=[jrt]", "methods_by_length={1M: [plain]}"]).validate()


def test_entry_methods_override_methods_by_length():
    """An add-on entry runs what it names even where the job-wide table leaves it out."""
    cfg = load_config(RulerJobConfig, None, [
        "backbones=[{name: a, model: {path: m}}, {name: d, report_as: a, model: {path: m}, "
        "methods: [nb-dense-top2], lengths: [1M]}]",
        "lengths=[4K, 1M]", "methods=[plain, nb-dense-top2]", "methods_by_length={1M: [plain]}",
        "tasks=[niah_single_1]", "n_examples=1"]).validate()
    planned = sorted((c["entry"], c["item"]["length"], tuple(c["methods"])) for c in plan_cells(cfg))
    assert planned == [("a", 4096, ("plain", "nb-dense-top2")), ("a", 1 << 20, ("plain",)),
                       ("d", 1 << 20, ("nb-dense-top2",))]


def test_entry_methods_by_length_filters_its_own_methods():
    """An entry with its own methods and per-length table (JRT only where a second pass is cheap)."""
    cfg = load_config(RulerJobConfig, None, [
        "backbones=[{name: a, model: {path: m}, methods: [plain, jrt, nb-tf-top2], "
        "methods_by_length: {1M: [plain, nb-tf-top2]}}]",
        "lengths=[4K, 1M]", "methods=[plain]", "methods_by_length={4K: [plain]}",
        "tasks=[niah_single_1]", "n_examples=1"]).validate()
    planned = sorted((c["item"]["length"], tuple(c["methods"])) for c in plan_cells(cfg))
    assert planned == [(4096, ("plain", "jrt", "nb-tf-top2")), (1 << 20, ("plain", "nb-tf-top2"))]
    with pytest.raises(ConfigError, match="methods_by_length"):
        load_config(RulerJobConfig, None, [
            "backbones=[{name: a, model: {path: m}, methods_by_length: {256K: [plain]}}]",
            "lengths=[4K]"]).validate()
    with pytest.raises(ConfigError):
        load_config(RulerJobConfig, None, [
            "backbones=[{name: a, model: {path: m}, methods_by_length: {4K: [no-such-method]}}]",
            "lengths=[4K]"]).validate()


def test_an_example_measured_twice_counts_once():
    rows = [dict(_row("plain", "a", 4096, s, 1.0), budget="default") for s in (100.0, 100.0, 0.0)]
    rows[2]["index"] = 1
    kept = drop_repeated_measurements(pd.DataFrame(rows), MEASUREMENT_KEY)
    assert len(kept) == 2 and kept.score.mean() == 50.0      # not 66.7: example 0 weighs once


def test_best_variant_must_be_measured_everywhere():
    """A variant measured at fewer task-lengths than BM25 does not win by missing its hard cells."""
    from notebank.pipeline.reporting.ruler import routers_section
    rows = [_row("nb-bm25-top2", t, 4096, 0, 1.0) for t in ("a", "b")]
    rows += [_row("nb-embmax-top2", "a", 4096, 0, 1.0), _row("nb-embmax-top2", "b", 4096, 0, 0.5)]
    rows += [_row("nb-embmax_centered-top2", "a", 4096, 0, 1.0)]
    text = "\n".join(routers_section(pd.DataFrame(rows), bar_lengths=(4096,)))
    assert "**embmax** (worst 0.50, mean 0.75;" in text
    rows += [_row("nb-embmax_centered-top2", "b", 4096, 0, 1.0)]
    text = "\n".join(routers_section(pd.DataFrame(rows), bar_lengths=(4096,)))
    assert "**embmax_centered** (worst 1.00, mean 1.00;" in text


@pytest.mark.parametrize("name", ["eval_ruler", "eval_smoke", "eval_phrasings", "eval_phrasings_controls"])
def test_shipped_eval_configs_load(name):
    """The full sweep and the CI smoke: launch command in the header, every entry plans cells, and
    every model / adapter path is in the repository (a clean clone can run them)."""
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    path = repo / "configs" / f"{name}.yaml"
    assert f"python jobs/evaluate.py -c configs/{name}.yaml" in path.read_text().split("\nbenchmark:")[0]
    cfg = load_config(RulerJobConfig, path).validate()
    cells = plan_cells(cfg)
    assert {c["entry"] for c in cells} == {b.name for b in cfg.backbones}
    for b in cfg.backbones:
        for p in (b.model.path, getattr(b.model, "adapter", None)):
            if p:
                assert (repo / p / "config.json").is_file() or (repo / p / "adapter_config.json").is_file(), p


def test_bars_section_checks_headline_claims_from_rows():
    """The bar table is computed from rows: plain 10 / NB 70 at 1M holds, a 0.5 coverage ratio does not."""
    from notebank.pipeline.reporting.ruler import bars_section
    rows = []
    for i in range(2):
        for t in ("a", "b"):
            for n in (1 << 16, 1 << 20):
                rows.append(dict(_row("plain", t, n, 10.0, float("nan")), index=i))
                rows.append(dict(_row("nb-tf-top2", t, n, 70.0, 0.5, arch=1.0), index=i))
                rows.append(dict(_row("nb-oracle-top2", t, n, 80.0, 0.5 if t == "a" else 1.0, arch=1.0), index=i))
    text = "\n".join(bars_section(pd.DataFrame(rows)))
    assert "Examples per task (plain rows): 64K 2, 1M 2" in text
    assert "| plain, six-task mean at 1M | 10.0 | <= 20 | yes | 2 |" in text
    assert "| nb-tf-top2 at 1M | 70.0 | >= 60 | yes | 2 |" in text
    assert "| nb-tf-top2 minus plain at 64K | 60.0 | >= 40 | yes | 2 |" in text
    assert "| nb-tf-top2 retrieved / archived coverage at 1M | 0.50 | >= 0.9 | **no** | 2 |" in text
    assert "| ceiling: nb-oracle-top2 retrieved / archived coverage at 1M | 0.75 | (reference) | — | 2 |" in text
    assert bars_section(pd.DataFrame([r for r in rows if r["method"] == "plain"])) == []


def test_ruler_config_generates_enough_tokens_for_every_answer():
    """The sweep's generation budget must fit the longest gold answer with room to spare: at 32
    tokens a uuid (~33 of the project's BPE tokens) and four 7-digit values (~32) were cut short,
    which zeroed niah_single_3 and clipped multiquery/multivalue (found in session 6)."""
    from pathlib import Path
    import yaml
    from nbcore.tasks import ruler
    from nbcore.tasks.tokenizer import build_tokenizer
    root = Path(__file__).resolve().parents[1]
    budget = yaml.safe_load((root / "configs" / "eval_ruler.yaml").read_text())["max_new_tokens"]
    tok = build_tokenizer()
    longest = max(len(tok(ruler.answer_text(ruler.generate(t, 4096, i, tok, seed=0)["answers"]),
                          add_special_tokens=False)["input_ids"])
                  for t in ruler.PAPER_SIX for i in range(5))
    assert longest >= 30                       # the check is not vacuous: uuids are that long
    assert longest + 8 <= budget, (longest, budget)
    assert RulerJobConfig().max_new_tokens >= longest + 8


def test_finish_sweep_keeps_shipped_rows_a_fresh_clone_lacks_cells_for(tmp_path):
    """results.parquet is shipped, cells/ is not: a sweep slice run on a fresh clone adds its rows to
    the shipped ones (a re-measured key takes the new row) instead of replacing the file."""
    import pyarrow as pa
    from notebank.pipeline.fanout import commit_parquet, finish_sweep
    out = str(tmp_path)
    row = lambda i, score: dict(backbone="b", budget="default", method="plain", task="t", length=4096,  # noqa: E731
                                index=i, score=score)
    for i in (0, 1):
        commit_parquet(pa.Table.from_pylist([row(i, 10.0 * i)]), f"{out}/cells/b/default/t/4096/{i:04d}.parquet")
    assert finish_sweep(out, lambda df: {"n": len(df)}, key=MEASUREMENT_KEY) == {"n": 2}
    import shutil
    shutil.rmtree(tmp_path / "cells")                          # a fresh clone: only results.parquet
    commit_parquet(pa.Table.from_pylist([row(1, 99.0)]), f"{out}/cells/b/default/t/4096/0001.parquet")
    commit_parquet(pa.Table.from_pylist([row(2, 5.0)]), f"{out}/cells/b/default/t/4096/0002.parquet")
    assert finish_sweep(out, lambda df: {"n": len(df)}, key=MEASUREMENT_KEY) == {"n": 3}
    got = pq.read_table(tmp_path / "results.parquet").to_pandas().set_index("index")["score"].to_dict()
    assert got == {0: 0.0, 1: 99.0, 2: 5.0}
    bad = pa.Table.from_pylist([{"index": 0, "score": 1.0}])   # no key columns: refuse, keep the file
    commit_parquet(bad, f"{out}/results.parquet")
    with pytest.raises(ValueError, match="key columns"):
        finish_sweep(out, lambda df: {}, key=MEASUREMENT_KEY)
    assert pq.read_table(tmp_path / "results.parquet").num_rows == 1


def test_restore_cells_from_shipped_results(tmp_path):
    """A fresh clone (results.parquet, no cells/) restores the cells whose every planned method has a
    row, under the reported backbone and renamed methods; a cell missing a method is left to run."""
    import pyarrow as pa
    from notebank.pipeline.evaluate import restore_cells
    from notebank.pipeline.fanout import collect, commit_parquet, unfinished
    out = str(tmp_path)
    cell = lambda i, methods, names=None: dict(  # noqa: E731
        key=dict(backbone="tiny", budget="default", task="t", length=4096, index=i), methods=methods,
        method_names=names or {}, path=f"{out}/cells/entry/default/t/4096/{i:04d}.parquet")
    row = lambda i, m: dict(backbone="tiny", budget="default", method=m, task="t", length=4096, index=i,  # noqa: E731
                            score=1.0)
    commit_parquet(pa.Table.from_pylist([row(0, "plain"), row(0, "nb-lora"), row(1, "plain")]),
                   f"{out}/results.parquet")
    cells = [cell(0, ["plain", "nb"], {"nb": "nb-lora"}), cell(1, ["plain", "nb"], {"nb": "nb-lora"})]
    assert [c["key"]["index"] for c in restore_cells(out, unfinished(out, cells), MEASUREMENT_KEY)] == [1]
    assert [c["key"]["index"] for c in unfinished(out, cells)] == [1]
    got = pq.read_table(cells[0]["path"]).to_pandas()
    assert sorted(got["method"]) == ["nb-lora", "plain"]
    assert [c["key"]["index"] for c in restore_cells(out, unfinished(out, cells), MEASUREMENT_KEY)] == [1]   # nothing more to restore
    # the rerun then measures cell 1 (written as run_cell writes it) and gathers restored + fresh cells
    commit_parquet(pa.Table.from_pylist([row(1, "plain"), row(1, "nb-lora")]), cells[1]["path"])
    assert pq.read_table(cells[0]["path"]).schema.field("method").type == pa.string()
    assert sorted(collect(out, cells).column("index").to_pylist()) == [0, 0, 1, 1]


def test_every_benchmark_is_one_interface_found_by_name():
    """nbcore.evals: each benchmark is a Benchmark, found by name, rebuilt from (name, options)."""
    from nbcore.evals import Benchmark, benchmark_names, build_benchmark, get_benchmark
    assert benchmark_names() == ["longbench", "longbench_v2", "memoryagentbench", "mone", "ruler"]
    for name in benchmark_names():
        cls = get_benchmark(name)
        assert issubclass(cls, Benchmark) and cls.name == name
        b = cls()
        assert build_benchmark(name, b.options()) == b and json.dumps(b.options())   # JSON-able options
    ruler = build_benchmark("ruler", {"tasks": ["niah_single_1", "fwe"], "lengths": [1024], "n_examples": 2})
    assert list(ruler.examples()) == [{"task": t, "length": 1024, "index": i} for t in ("niah_single_1", "fwe")
                                      for i in range(2)]
    assert ruler.score({"task": "niah_single_1"}, "it is 123 and 456", ["123", "456"]) == 100.0
    with pytest.raises(KeyError, match="unknown benchmark"):
        get_benchmark("nope")


def test_nbcore_never_imports_ray_or_pipeline():
    """nbcore is the pure-PyTorch library: no module of it imports ray or the pipeline layer."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "nbcore"
    bad = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] in ("ray", "pipeline", "jobs")]
    assert bad == []


def _cost_rows():
    """Two examples at 4K, plain and nb-tf-top2, with the counters run_cell records."""
    rows = []
    for i in range(2):
        common = dict(backbone="m", budget="default", task="a", length=4096, index=i, n_tokens=4000 + i,
                      question_tokens=20, archived_cov=1.0, retrieved_cov=1.0, ingest_s=1.0, probe_s=0.1,
                      route_s=0.01, replay_generate_s=0.5, n_notes=14, archived_tokens=800, answer_tokens=8)
        rows.append(dict(common, method="plain", score=0.0, replay_len=0, address_bytes_per_note=2 * 4 * 16))
        rows.append(dict(common, method="nb-tf-top2", score=100.0, replay_len=120, address_bytes_per_note=2 * 4 * 16))
    return rows


def test_cost_section_puts_the_analytical_cost_beside_the_measured(tmp_path):
    from nbcore import cost
    from notebank.pipeline.reporting.cost import CostModel, cost_section
    shapes = cost.ModelShapes(name="t", hidden_size=8, vocab_size=10, num_layers=1,
                              linears=(cost.Linear("w", 8, 8),), recurrence="gdn", num_recurrent_layers=1,
                              state_heads=4, address_heads=4, d_k=2, d_v=2, conv_channels=12)
    costs = {("m", "default"): CostModel(shapes, chunk_size=512, tail=32, addr_dim=16)}
    df = pd.DataFrame(_cost_rows())
    text = "\n".join(cost_section(df, costs))
    f = cost.backbone_flops_per_token(shapes)
    plain = [cost.plain_flops(shapes, context_len=4000 + i, question_len=20, answer_len=8) for i in range(2)]
    added = [cost.added_flops(shapes, context_len=4000 + i, question_len=20, replay_len=120, answer_len=8,
                              num_notes=14).total for i in range(2)]
    kib = cost.archive_bytes(14, 800, channels=4, addr_dim=16) / 1024
    assert f"f_phi = {f:,} FLOPs/token" in text and "J = 4 channels" in text
    line = next(x for x in text.splitlines() if x.startswith("| 4K |"))
    assert line == (f"| 4K | 4000 | 1.610 | {sum(plain) / 2e9:.3f} | 1.610 | {sum(added) / 2e9:.4f} | "
                    f"{100 * sum(added) / sum(plain):.2f}% | 14.0 | 800 | {kib:.1f} | {kib:.1f} | "
                    f"{(kib * 1024 + 4 * 4 * 2 * 2 + 2 * 4 * 12) / 2**20:.3f} | "
                    f"{cost.mha_kv_cache_bytes(1, 8, 4020.5) / 2**20:.3f} |")
    assert cost_section(df[df.method == "plain"], costs) == []             # nothing to compare
    no_y = df.drop(columns="answer_tokens")                                 # rows of an older run
    assert "|Y| = the generation budget" in "\n".join(cost_section(no_y, costs, answer_budget=128))
    write_report(df, str(tmp_path), costs=costs)
    assert "## Cost: measured and analytical" in (tmp_path / "report.md").read_text()


def test_collect_merges_string_and_large_string_cells(tmp_path):
    """A cell restored from a shipped results.parquet (large_string columns) and a fresh one (string)
    are gathered together."""
    import pyarrow as pa
    from notebank.pipeline.fanout import collect, commit_parquet
    out = str(tmp_path)
    commit_parquet(pa.table({"method": pa.array(["a"], pa.large_string()), "score": [1.0]}), f"{out}/cells/a/0000.parquet")
    commit_parquet(pa.table({"method": pa.array(["b"], pa.string()), "score": [0.0]}), f"{out}/cells/b/0000.parquet")
    rows = collect(out, None)
    assert sorted(rows.column("method").to_pylist()) == ["a", "b"]


def test_previous_rows_merge_across_string_types_and_refuse_other_mismatches(tmp_path):
    """Rows kept from a shipped results.parquet (large_string) join fresh cells (string); a column
    whose type cannot be promoted (int vs string) still stops the write."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest
    from notebank.pipeline.fanout import _with_previous_rows
    url = str(tmp_path / "results.parquet")
    pq.write_table(pa.table({"method": pa.array(["old", "new"], pa.large_string()), "score": [1.0, 5.0]}), url)
    rows = pa.table({"method": pa.array(["new"], pa.string()), "score": [2.0]})
    got = _with_previous_rows(rows, url, ["method"])
    assert sorted(zip(got.column("method").to_pylist(), got.column("score").to_pylist())) == [("new", 2.0), ("old", 1.0)]
    bad = pa.table({"method": pa.array(["x"], pa.string()), "score": pa.array(["2"], pa.string())})
    with pytest.raises(ValueError, match="do not match"):
        _with_previous_rows(bad, url, ["method"])


def test_cell_runner_loads_each_model_once_and_writes_each_cell(tmp_path, monkeypatch):
    """The sweep actor (plain class, no Ray): one load per model for cells ordered by model, one
    Parquet file per cell; a model that cannot load fails each of its cells with that error, writes
    nothing and raises nothing."""
    from nbcore.backbones import loading
    from nbcore.evals.ruler import Ruler
    from notebank.pipeline.evaluate import CellRunner, make_cell, model_groups
    loads = []
    real = loading.build_backbone
    monkeypatch.setattr(loading, "build_backbone", lambda spec: loads.append(spec) or real(spec))
    bench = Ruler(tasks=["niah_single_1"], lengths=[1024], max_new_tokens=2)
    item = next(iter(bench.examples()))
    cells = [make_cell(bench, item, str(tmp_path / f"c{i}.parquet"), model=dict(TINY_MODEL), methods=["plain"],
                       labels={"backbone": "rand"}) for i in range(3)]
    other = dict(cells[0], model={**TINY_MODEL, "seed": 1}, path=str(tmp_path / "other.parquet"))
    groups = model_groups([cells[0], other, cells[1], cells[2]])
    assert [[c["path"] for c in g] for g in groups] == [[c["path"] for c in cells], [other["path"]]]
    runner = CellRunner(threads=1)
    out = runner({"cell": [json.dumps(c) for g in groups for c in g]})
    assert len(loads) == 2 and runner.loads == 2 and out["error"] == [None] * 4 and all(n > 0 for n in out["n_tokens"])
    assert all((tmp_path / f"c{i}.parquet").exists() for i in range(3)) and (tmp_path / "other.parquet").exists()
    bad = dict(cells[0], model={**TINY_MODEL, "hf_config": {"model_type": "nope"}}, path=str(tmp_path / "bad.parquet"))
    unknown = dict(cells[0], benchmark="no-such-benchmark", path=str(tmp_path / "unknown.parquet"))
    res = runner({"cell": [json.dumps(bad), json.dumps(bad), json.dumps(unknown)]})
    assert [e.split(":")[0] for e in res["error"]] == ["RuntimeError", "RuntimeError", "KeyError"], res["error"]
    assert "the model could not be loaded" in res["error"][0] and runner.loads == 3
    assert not (tmp_path / "bad.parquet").exists() and not (tmp_path / "unknown.parquet").exists()
