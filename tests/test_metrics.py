"""LongBench v1/v2 and MemoryAgentBench metrics, prompts and loaders (nbcore.evals)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nbcore.evals import longbench as lb
from nbcore.evals import memoryagentbench as mab
from nbcore.evals.metrics import (
    choice_accuracy,
    classification_score,
    extract_choice,
    first_line,
    flatten_ground_truths,
    max_over_ground_truths,
    max_over_references,
    normalize_answer,
    parse_output,
    qa_f1_score,
    rouge_l_f,
    rouge_sentences,
    substring_exact_match,
    token_f1,
)

FIX = Path(__file__).parent / "fixtures"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


LB_CASES = _jsonl(FIX / "longbench" / "score_cases.jsonl")
V2_CASES = _jsonl(FIX / "longbench_v2" / "parse_cases.jsonl")
MAB_CASES = _jsonl(FIX / "memoryagentbench" / "score_cases.jsonl")


# ------------------------------------------------------------------ official-implementation fixtures


@pytest.mark.parametrize("case", LB_CASES, ids=[c["id"] for c in LB_CASES])
def test_longbench_scores_match_official(case):
    """Expected scores come from running the official code on each case, in a scratch directory
    outside the repo: THUDM/LongBench ``LongBench/metrics.py`` (commit 2e00731, with jieba/fuzzywuzzy
    stubbed, they are unused by these metrics) and ``rouge`` 1.0.1 from pltrdy/rouge, called through
    ``eval.py``'s per-example scorer logic (first line for trec/triviaqa/samsum, max over answers,
    ``all_classes`` passed through). The simpler ones can be checked by hand, e.g.
    ``partial-precision``: {paris} vs {paris, france} -> P = 1/2, R = 1, F1 = 2/3;
    ``class-removal-skips-next``: matches [Other, number, Other number], "Other" is removed and the
    loop then skips "number" -> [number, Other number] -> 1/2;
    ``rouge-multi-sentence-union``: m = 7 distinct reference words, n = 10 prediction words, union
    of sentence-pair LCS words = {reviewed, the, program, found, gaps|oversight} = 5 ->
    R = 5/7, P = 1/2, F = 2PR/(P+R+1e-8) = 10/17.
    """
    got = lb.score_prediction(case["dataset"], case["prediction"], case["answers"], case["all_classes"])
    assert got == pytest.approx(case["expected"], abs=1e-12)


@pytest.mark.parametrize("case", V2_CASES, ids=[c["id"] for c in V2_CASES])
def test_longbench_v2_parser_matches_official(case):
    """Expected letters from the official ``extract_answer`` of THUDM/LongBench ``pred.py`` applied to
    ``response.strip()`` (as ``get_pred`` does); each was also written down by hand before the run."""
    assert lb.parse_choice(case["response"]) == case["expected"]


@pytest.mark.parametrize("case", MAB_CASES, ids=[c["id"] for c in MAB_CASES])
def test_memoryagentbench_scores_match_official(case):
    """Expected booleans from the official MemoryAgentBench ``utils/eval_other_utils.py`` functions
    (``normalize_answer``, ``substring_exact_match_score``, ``drqa_metric_max_over_ground_truths``,
    ``parse_output``) combined as ``default_post_process`` (max of raw and parsed output) and, for
    EventQA, ``_process_eventqa_dataset`` (parsed output only)."""
    assert mab.score_answer(case["source"], case["output"], case["answers"]) is case["expected"]


# ------------------------------------------------------------------ hand-checkable metric cases


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Cat!", "cat"),
        ("An apple, a pear and THE plum.", "apple pear and plum"),
        ("  many\n\tspaces  ", "many spaces"),
        ("theater anthem", "theater anthem"),
        ("U.S.-based", "usbased"),
    ],
    ids=["article-and-punct", "all-articles", "whitespace", "article-inside-word-kept", "punct-removed-before-split"],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    "pred, ref, expected",
    [
        (["a", "b"], ["a", "b"], 1.0),
        (["a", "b", "c", "d"], ["a"], 2 * 0.25 * 1 / 1.25),
        (["a", "a", "b"], ["a", "b", "b"], 2 / 3),
        (["x"], ["y"], 0.0),
        ([], ["y"], 0.0),
    ],
    ids=["identical", "precision-quarter", "multiset-overlap", "disjoint", "empty-prediction"],
)
def test_token_f1(pred, ref, expected):
    assert token_f1(pred, ref) == pytest.approx(expected)


def test_qa_f1_max_over_references():
    assert qa_f1_score("the Harlow Prize", "Harlow Prize") == 1.0
    assert max_over_references(qa_f1_score, "Lisbon Portugal", ["Madrid", "Lisbon"]) == pytest.approx(2 / 3)
    assert max_over_references(qa_f1_score, "anything", []) == 0.0


@pytest.mark.parametrize(
    "pred, ref, expected",
    [
        ("a b c d", "a b c d", 1.0),
        ("a b c d", "a x c y", 0.5),
        ("a b", "b a", 0.5),
        ("a b. c d", "c d. a b", 1.0),
        ("A b", "a b", 0.5),
    ],
    ids=["identical", "half-lcs", "order-matters", "sentence-union", "case-sensitive"],
)
def test_rouge_l_hand_cases(pred, ref, expected):
    assert rouge_l_f(pred, ref) == pytest.approx(expected, abs=1e-7)


def test_rouge_sentence_split_quirks():
    assert rouge_sentences("One. Two.") == ["One", "Two"]
    assert rouge_sentences("a.  .b") == ["a", "", "b"]
    assert rouge_sentences("") == [] and rouge_sentences("..") == []
    assert rouge_l_f("", "x") == 0.0


def test_rouge_long_sentences_are_scored():
    """The rouge package recurses once per LCS step and LongBench turns the RecursionError into 0.0
    for sentence pairs longer than ~1000 words; the iterative version scores them (documented)."""
    words = " ".join(f"w{i}" for i in range(1200))
    assert rouge_l_f(words, words) == pytest.approx(1.0, abs=1e-7)


@pytest.mark.parametrize(
    "pred, gt, classes, expected",
    [
        ("Date", "Date", ["Date", "City"], 1.0),
        ("Date or City", "City", ["Date", "City"], 0.5),
        ("Other number", "Other number", ["Other", "Other number"], 1.0),
        ("Other number", "Other number", ["Other", "number", "Other number"], 0.5),
        ("date", "Date", ["Date"], 0.0),
        ("nothing", "Date", ["Date"], 0.0),
    ],
    ids=["single-match", "two-matches", "gt-substring-removed", "removal-skips-next", "case-sensitive", "no-match"],
)
def test_classification_score(pred, gt, classes, expected):
    assert classification_score(pred, gt, all_classes=classes) == expected


def test_first_line():
    assert first_line("\n\nfoo\nbar") == "foo"
    assert first_line(" foo\nbar") == " foo"
    assert first_line("") == ""


def test_choice_accuracy():
    assert choice_accuracy(["A", "B", None, "D"], ["A", "C", "C", "D"]) == 50.0
    assert choice_accuracy(["A", None], ["A", "B"], compensated=True) == pytest.approx(62.5)
    assert lb.v2_accuracy(["The correct answer is (A)", "no idea"], ["A", "B"]) == 50.0
    assert extract_choice("The correct answer is (B)") == "B"
    with pytest.raises(ValueError):
        choice_accuracy(["A"], ["A", "B"])


def test_substring_exact_match_and_flattening():
    assert substring_exact_match("The answer is the Mark.", "mark")
    assert not substring_exact_match("Mar", "mark")
    assert flatten_ground_truths("x") == ["x"]
    assert flatten_ground_truths([["a", "b"], ["c"]]) == ["a", "b", "c"]
    assert flatten_ground_truths(["a", "b"]) == ["a", "b"]
    assert max_over_ground_truths(substring_exact_match, "it is b", [["a"], ["b"]]) == 1.0
    with pytest.raises(ValueError):
        max_over_ground_truths(substring_exact_match, "x", [])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Answer: Paris\nMore text", "Paris"),
        ("reasoning first\nanswer: answer: Rome", "Rome"),
        ("Just this line\nand another", "Just this line"),
        ("", ""),
    ],
    ids=["prefix", "repeated-prefix-case-insensitive", "first-line-fallback", "empty"],
)
def test_parse_output(text, expected):
    assert parse_output(text) == expected


# ------------------------------------------------------------------ LongBench v1 protocol


def test_v1_configuration_covers_the_12_subsets():
    assert len(lb.V1_DATASETS) == 12
    assert set(lb.DATASET2PROMPT) == set(lb.DATASET2MAXLEN) == set(lb.DATASET2METRIC) == set(lb.V1_DATASETS)
    assert sorted(n for names in lb.CATEGORIES.values() for n in names) == sorted(lb.V1_DATASETS)
    names = ("narrativeqa", "multifieldqa_en", "hotpotqa", "gov_report", "trec", "samsum")
    assert [lb.max_new_tokens(d) for d in names] == [128, 64, 32, 512, 64, 128]
    assert lb.DATASET2METRIC["triviaqa"] == "qa_f1" and lb.DATASET2METRIC["samsum"] == "rouge"


def test_v1_prompts():
    rows = lb.load_longbench(str(FIX / "longbench"), "hotpotqa")
    p = lb.build_prompt("hotpotqa", rows[0])
    assert p.startswith("Answer the question based on the given passages. Only give me the answer")
    assert "The following are given passages.\n" + rows[0]["context"] + "\n\n" in p
    assert p.endswith("Question: " + rows[0]["input"] + "\nAnswer:")
    trec = lb.load_longbench(str(FIX / "longbench"), "trec")
    assert lb.build_prompt("trec", trec[0]) == (
        "Please determine the type of the question below. Here are some examples of questions.\n\n"
        + trec[0]["context"] + "\n" + trec[0]["input"])
    # the official narrativeqa prompt keeps its "asconcisely" typo
    assert "asconcisely" in lb.DATASET2PROMPT["narrativeqa"]
    with pytest.raises(KeyError, match="unknown LongBench"):
        lb.build_prompt("lcc", rows[0])


def test_v1_dataset_score_and_aggregates():
    rows = lb.load_longbench(str(FIX / "longbench"), "trec")
    preds = ["Individual\nQuestion: ...", "Date or Other number"]
    # example 1: 1.0 (first line); example 2: matches [Date, Other number] -> 0.5
    assert lb.dataset_score("trec", preds, [r["answers"] for r in rows], rows[0]["all_classes"]) == 75.0
    hot = lb.load_longbench(str(FIX / "longbench"), "hotpotqa")
    got = lb.dataset_score("hotpotqa", ["Lisbon", "Harlow Prize", "in 1979"], [r["answers"] for r in hot])
    assert got == pytest.approx(round(100 * (1 + 1 + 2 / 3) / 3, 2))  # "in 1979" vs "1979": P = 1/2, R = 1
    scores = {"narrativeqa": 10.0, "qasper": 20.0, "multifieldqa_en": 30.0, "hotpotqa": 5.0, "2wikimqa": 7.0,
              "musique": 9.0, "gov_report": 12.0, "qmsum": 14.0, "multi_news": 16.0, "trec": 30.0,
              "triviaqa": 40.0, "samsum": 5.0}
    agg = lb.aggregate_scores(scores)
    assert agg == {"single_doc_qa": 20.0, "multi_doc_qa": 7.0, "summarization": 14.0, "few_shot": 25.0,
                   "overall": 16.5}
    assert lb.aggregate_scores({"trec": 10.0, "hotpotqa": 21.0}) == {"multi_doc_qa": 21.0, "few_shot": 10.0,
                                                                    "overall": 15.5}
    with pytest.raises(KeyError):
        lb.aggregate_scores({"lcc": 1.0})


def test_paper_table5_overall_is_mean_of_categories():
    """Table 5, GDN Plain: categories 6.88/7.02/13.99/34.08 -> overall 15.49."""
    assert round((6.88 + 7.02 + 13.99 + 34.08) / 4, 2) == 15.49


def test_select_subset_is_fixed_by_seed():
    items = list(range(100))
    a = lb.select_subset(items, 30, seed=0)
    assert a == lb.select_subset(items, 30, seed=0)
    assert a != lb.select_subset(items, 30, seed=1)
    assert len(a) == 30 and a == sorted(a) and len(set(a)) == 30
    assert lb.select_subset(items[:5], 30) == items[:5]


def test_v1_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"qasper.*expected LongBench v1 JSONL"):
        lb.load_longbench(str(tmp_path), "qasper")
    bad = tmp_path / "hotpotqa.jsonl"
    bad.write_text(json.dumps({"input": "q", "context": "c"}) + "\n")
    with pytest.raises(ValueError, match=r"lacks fields \['answers'\]"):
        lb.load_longbench(str(tmp_path), "hotpotqa")
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        lb.load_longbench(str(bad), "hotpotqa")


def test_v1_loader_reads_data_subdir_and_fsspec(tmp_path):
    (tmp_path / "data").mkdir()
    shutil.copy(FIX / "longbench" / "samsum.jsonl", tmp_path / "data" / "samsum.jsonl")
    assert len(lb.load_longbench(str(tmp_path), "samsum")) == 2
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/nbtest_lb/gov_report.jsonl", (FIX / "longbench" / "gov_report.jsonl").read_bytes())
    rows = lb.load_longbench("memory://nbtest_lb", "gov_report")
    assert rows[0]["dataset"] == "gov_report"
    fs.rm("/nbtest_lb", recursive=True)


# ------------------------------------------------------------------ LongBench v2 protocol


def test_v2_loader_prompt_and_selection():
    rows = lb.load_longbench_v2(str(FIX / "longbench_v2"))
    assert len(rows) == 4
    p = lb.build_prompt_v2(rows[0])
    assert p.startswith("Please read the following text and answer the question below.\n\n<text>\n")
    assert rows[0]["context"].strip() + "\n</text>" in p
    assert "(B) " + rows[0]["choice_B"] + "\n" in p
    assert p.endswith('Format your response as follows: "The correct answer is (insert answer here)".')
    kept = lb.select_v2(rows)
    assert [r["_id"] for r in kept] == ["nbfix-v2-0", "nbfix-v2-1", "nbfix-v2-2"]  # code-repo QA dropped


@pytest.mark.parametrize(
    "prompt, replay, gen, budget, keep",
    [(100, 128, 32, 260, True), (100, 128, 32, 259, False), (0, 0, 0, 0, True)],
    ids=["exactly-fits", "one-over", "all-zero"],
)
def test_fits_in_budget(prompt, replay, gen, budget, keep):
    assert lb.fits_in_budget(prompt, position_budget=budget, replay_reserve=replay, max_new_tokens=gen) is keep


def test_filter_fits_never_truncates():
    rows = lb.load_longbench_v2(str(FIX / "longbench_v2"))
    lengths = {r["_id"]: len(lb.build_prompt_v2(r)) for r in rows}
    budget = sorted(lengths.values())[1] + 10 + 5  # the two shortest prompts fit
    seen = []

    def count(prompt: str) -> int:
        seen.append(prompt)
        return len(prompt)

    kept, dropped = lb.filter_fits(rows, count, position_budget=budget, replay_reserve=10, max_new_tokens=5)
    assert len(kept) == 2 and len(dropped) == 2
    assert all(lengths[r["_id"]] + 15 <= budget for r in kept)
    assert seen == [lb.build_prompt_v2(r) for r in rows]  # full prompts were counted


def test_v2_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data\.json.*expected LongBench v2"):
        lb.load_longbench_v2(str(tmp_path))
    rows = json.loads((FIX / "longbench_v2" / "data.json").read_text())
    del rows[1]["choice_C"]
    (tmp_path / "data.json").write_text(json.dumps(rows))
    with pytest.raises(ValueError, match=r"record 1 lacks fields \['choice_C'\]"):
        lb.load_longbench_v2(str(tmp_path))


# ------------------------------------------------------------------ MemoryAgentBench


def test_mab_loads_hf_parquet_layout():
    cr = mab.load_memoryagentbench(str(FIX / "memoryagentbench"), split="Conflict_Resolution")
    assert [s.source for s in cr] == ["factconsolidation_sh_6k", "factconsolidation_mh_6k"]
    s = cr[0]
    assert isinstance(s.context, str) and len(s) == 2
    assert s.answers == [["Brenmouth"], ["Ines Moreau"]]
    ar = mab.load_memoryagentbench(str(FIX / "memoryagentbench"), split="Accurate_Retrieval", sources="ruler_qa1_197K")
    assert len(ar) == 1 and ar[0].answers[1] == ["1899", "in 1899"]


def test_mab_loads_jsonl_and_fsspec(tmp_path):
    import fsspec

    rows = [{"context": "ctx", "questions": ["q1"], "answers": ["a1"], "metadata": {"source": "eventqa_full"}}]
    p = tmp_path / "rows.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    got = mab.load_memoryagentbench(str(p))
    assert got[0].answers == [["a1"]] and got[0].source == "eventqa_full"
    fs = fsspec.filesystem("memory")
    src = FIX / "memoryagentbench" / "data" / "Conflict_Resolution-00000-of-00001.parquet"
    fs.pipe("/nbtest_mab/data/Conflict_Resolution-00000-of-00001.parquet", src.read_bytes())
    got = mab.load_memoryagentbench("memory://nbtest_mab", split="Conflict_Resolution", max_samples=1)
    assert len(got) == 1 and got[0].source == "factconsolidation_sh_6k"
    fs.rm("/nbtest_mab", recursive=True)


def test_mab_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Conflict_Resolution.*expected MemoryAgentBench rows"):
        mab.load_memoryagentbench(str(tmp_path), split="Conflict_Resolution")
    with pytest.raises(FileNotFoundError, match="MemoryAgentBench file not found"):
        mab.load_memoryagentbench(str(tmp_path / "missing.parquet"))
    with pytest.raises(ValueError, match="pass split="):
        mab.load_memoryagentbench(str(FIX / "memoryagentbench"))
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"context": "c", "questions": ["q"]}))
    with pytest.raises(ValueError, match=r"lacks columns \['answers'\]"):
        mab.load_memoryagentbench(str(p))
    p.write_text(json.dumps({"context": "c", "questions": ["q", "r"], "answers": ["a"]}))
    with pytest.raises(ValueError, match="2 questions but 1 answers"):
        mab.load_memoryagentbench(str(p))


def test_mab_prompts_budgets_and_accuracy():
    assert mab.task_family("factconsolidation_mh_262k") == "factconsolidation"
    assert mab.task_family("ruler_qa2_421K") == "ruler_qa"
    assert mab.task_family("eventqa_full") == "eventqa"
    sources = ("ruler_qa1_197K", "eventqa_65536", "factconsolidation_sh_6k")
    assert [mab.generation_max_length(s) for s in sources] == [50, 40, 10]
    q = mab.build_query("factconsolidation_sh_6k", "what is the capital of Veloria?")
    assert q.endswith("Based on the provided Knowledge Pool, what is the capital of Veloria? \nAnswer:")
    assert len(mab.PAPER_SOURCES) == 11
    with pytest.raises(KeyError):
        mab.task_family("longmemeval_s")
    outputs, answers = ["Brenmouth", "Samuel Obi"], [["Brenmouth"], ["Ines Moreau"]]
    assert mab.accuracy("factconsolidation_sh_6k", outputs, answers) == 50.0
