"""LongBench v1 / v2 and MemoryAgentBench end to end through jobs/evaluate.py (benchmark: longbench).

The end-to-end test runs configs/eval_longbench_fixtures.yaml on the shipped fixture files with the
tiny random GDN of conftest (byte tokenizer, 4 new tokens), in the session's real local Ray; the
other tests check the prompt cuts, the report's macro-averages on hand-made rows, and the errors.
"""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from nbcore.evals import longbench as lb
from nbcore.evals.methods import replay_reserve
from notebank.pipeline.config import ConfigError, load_config
from notebank.pipeline.evaluate_longbench import LongBenchJobConfig
from notebank.pipeline.reporting.longbench import summarize

from conftest import TINY_MODEL, TINY_NB

REPO = Path(__file__).resolve().parents[1]
CFG = REPO / "configs" / "eval_longbench_fixtures.yaml"
FIX = REPO / "tests" / "fixtures"


def _argv(out, *extra) -> list[str]:
    bb = f"[{{name: rand-gdn, model: {json.dumps(TINY_MODEL)}, notebank: {json.dumps(TINY_NB)}}}]"
    sets = [f"output={out}", f"backbones={bb}", "longbench.n_examples=1", "longbench.max_length=1024",
            "longbench_v2.position_budget=1000000", "methods=[plain, nb-tf-top2]", "max_new_tokens_cap=4",
            "num_cpus_per_cell=1", *extra]
    return ["-c", str(CFG)] + [x for s in sets for x in ("--set", s)]


def test_split_prompt_and_middle_truncation():
    from nbcore.backbones.loading import byte_tokenizer
    tok = byte_tokenizer()                         # 1 token per byte: every length is hand-checkable
    ex = lb.load_longbench(str(FIX / "longbench"), "hotpotqa")[0]
    head, q = lb.split_prompt("hotpotqa", ex)
    assert head + q == lb.build_prompt("hotpotqa", ex) and head.endswith(ex["context"])
    assert q.endswith(f"Question: {ex['input']}\nAnswer:")
    assert lb.truncate_middle(tok, head, q, None) == (head, q, False)
    assert lb.truncate_middle(tok, head, q, len(head + q)) == (head, q, False)
    h2, q2, cut = lb.truncate_middle(tok, head, q, 400)
    prompt = head + q
    assert cut and q2 == q and h2 + q2 == prompt[:200] + prompt[-200:]      # first and last 200 bytes
    with pytest.raises(ValueError, match="does not fit in half"):
        lb.truncate_middle(tok, head, q, 2 * len(q))
    v2 = lb.load_longbench_v2(str(FIX / "longbench_v2"))[0]
    p = lb.build_prompt_v2(v2)
    h, rest = lb.split_at_context(p, v2["context"])
    assert h + rest == p and h.endswith(v2["context"].strip()) and rest.startswith("\n</text>")
    assert lb.chat_prompt(tok, p) == p             # no chat template: the prompt is fed as is


def test_summary_macro_averages_by_hand():
    rows = []

    def add(bench, ds, scores, m="plain"):
        for i, s in enumerate(scores):
            rows.append(dict(backbone="b", method=m, benchmark=bench, dataset=ds, id=f"{ds}{i}", index=i,
                             question_index=0, score=s))
    add("longbench", "narrativeqa", [50, 0])       # 25
    add("longbench", "qasper", [75])               # 75   -> single_doc_qa 50
    add("longbench", "hotpotqa", [10, 20, 30])     # 20   -> multi_doc_qa 20
    add("longbench_v2", "longbench_v2", [100, 0, 0, 100])
    add("memoryagentbench", "factconsolidation_sh_6k", [100, 0, 0, 0])   # 25
    add("memoryagentbench", "eventqa_65536", [100])                      # 100 -> average 62.5
    s = summarize(rows)
    assert s == {"b/plain/narrativeqa": 25.0, "b/plain/qasper": 75.0, "b/plain/hotpotqa": 20.0,
                 "b/plain/single_doc_qa": 50.0, "b/plain/multi_doc_qa": 20.0,
                 "b/plain/longbench_overall": 40.0,            # (25 + 75 + 20) / 3: mean over datasets
                 "b/plain/longbench_v2": 50.0, "b/plain/factconsolidation_sh_6k": 25.0,
                 "b/plain/eventqa_65536": 100.0, "b/plain/memoryagentbench_average": 62.5}


def test_fixture_config_plans_the_paper_rules():
    """The shipped fixture config: seeded v1 subsets, v2 domain subset + fit filter, MAB contexts."""
    cfg = load_config(LongBenchJobConfig, CFG)
    assert "python jobs/evaluate.py -c configs/eval_longbench_fixtures.yaml" in CFG.read_text()
    cells, notes = cfg.plan()
    by = {}
    for c in cells:
        by.setdefault(c["benchmark"], []).append(c["item"])
    assert {c["dataset"] for c in by["longbench"]} == set(cfg.longbench.datasets)
    assert [c["index"] for c in by["longbench"] if c["dataset"] == "hotpotqa"] == \
        lb.select_subset(list(range(3)), 2, cfg.seed)
    assert {cfg.v1().max_new_tokens(c) for c in by["longbench"] if c["dataset"] == "gov_report"} == {512}
    v2 = notes["tiny-gdn/longbench_v2"]
    assert (v2["candidates"], v2["kept"], v2["dropped"]) == (3, 2, 1)   # code-repo example off; 1 too long
    assert v2["replay_reserve"] == replay_reserve(cfg.methods, cfg.backbones[0].notebank) == 2 * 32
    assert len(by["longbench_v2"]) == 2
    assert all(c["question"].startswith("\n</text>") and "(A)" in c["question"] for c in by["longbench_v2"])
    assert sorted(c["dataset"] for c in by["memoryagentbench"]) == sorted(cfg.memoryagentbench.configs)
    for c in cells:                                                         # the cell layout of resumed runs
        it = c["item"]
        assert c["path"].endswith(f"/cells/tiny-gdn/{c['benchmark']}/{it.get('dataset', c['benchmark'])}/"
                                  f"{it['index']:04d}.parquet")


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="backbones"):
        load_config(LongBenchJobConfig, None, ["longbench.source=x"])
    base = [f"backbones=[{{name: m, model: {{path: m}}}}]"]
    with pytest.raises(ConfigError, match="at least one of longbench.source"):
        load_config(LongBenchJobConfig, None, base)
    with pytest.raises(ConfigError, match="unknown method"):
        load_config(LongBenchJobConfig, None, base + ["longbench.source=x", "methods=[bogus]"])
    with pytest.raises(ConfigError, match=r"longbench.datasets: unknown \['lcc'\]"):
        load_config(LongBenchJobConfig, None, base + ["longbench.source=x", "longbench.datasets=[lcc]"])
    with pytest.raises(ConfigError, match="memoryagentbench.configs: unsupported"):
        load_config(LongBenchJobConfig, None, base + ["memoryagentbench.source=x", "memoryagentbench.configs=[nope]"])
    missing = tmp_path / "no-such-dir"
    with pytest.raises(ConfigError, match=rf"longbench.source: .*{missing}/multifieldqa_en.jsonl.*expected LongBench v1"):
        load_config(LongBenchJobConfig, CFG, [f"longbench.source={missing}"]).plan()
    with pytest.raises(ConfigError, match=rf"memoryagentbench.source: {missing} not found"):
        load_config(LongBenchJobConfig, CFG, [f"memoryagentbench.source={missing}"]).plan()
    with pytest.raises(ConfigError, match="longbench_v2.source: LongBench v2 data not found"):
        load_config(LongBenchJobConfig, CFG, [f"longbench_v2.source={missing}"]).plan()


def test_end_to_end_through_jobs_evaluate(ray_session, tmp_path):
    from notebank.jobs.evaluate import main
    out = tmp_path / "lb"
    first = main(_argv(out))
    assert first["cells_failed"] == 0 and first["cells_run"] == first["cells"] == 5 + 3 + 4
    for name in ("report.md", "summary.json", "scores.png", "cost.png", "results.parquet"):
        assert (out / name).stat().st_size > 500, name
    table = pq.read_table(out / "results.parquet").to_pandas()
    assert set(table.benchmark) == {"longbench", "longbench_v2", "memoryagentbench"}
    assert set(table.method) == {"plain", "nb-tf-top2"}
    assert table.score.between(0, 100).all() and (table.max_new_tokens <= 4).all()
    mab = table[table.benchmark == "memoryagentbench"]
    # One ingest per context, every question from its own copy: same ingest time, amortised over the questions.
    for _, g in mab.groupby(["dataset", "index", "method"]):
        assert g.ingest_s.nunique() == 1 and len(g) == g.n_questions.iloc[0]
        assert (g.ingest_amortised_s * g.n_questions - g.ingest_s).abs().max() < 1e-9
    summary = json.loads((out / "summary.json").read_text())
    for m in ("plain", "nb-tf-top2"):
        for k in ("hotpotqa", "single_doc_qa", "multi_doc_qa", "summarization", "few_shot", "longbench_overall",
                  "longbench_v2", "factconsolidation_sh_6k", "ruler_qa1_197K", "memoryagentbench_average"):
            assert 0 <= summary[f"rand-gdn/{m}/{k}"] <= 100, k
    report = (out / "report.md").read_text()
    assert "### LongBench v1" in report and "| single_doc_qa | multi_doc_qa | summarization | few_shot | overall |" \
        in report
    assert "### MemoryAgentBench" in report and "capped at 4 new tokens" in report
    again = main(_argv(out))
    assert again["cells_skipped"] == again["cells"] and again["cells_run"] == 0
    assert json.loads((out / "summary.json").read_text()) == summary


def test_shipped_v1_config_parses():
    """configs/eval_longbench_v1.yaml: the paper's 12 subsets x 30 examples, seed 0, launch command in the header."""
    path = REPO / "configs" / "eval_longbench_v1.yaml"
    cfg = load_config(LongBenchJobConfig, path)
    assert cfg.longbench.datasets == list(lb.V1_DATASETS) and cfg.longbench.n_examples == 30 and cfg.seed == 0
    assert "ray job submit" in path.read_text() and "jobs/evaluate.py -c configs/eval_longbench_v1.yaml" in \
        path.read_text()
