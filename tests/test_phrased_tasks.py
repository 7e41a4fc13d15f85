"""Phrased needle tasks (nbcore/tasks/phrased.py) and their held-out prose (nbcore/tasks/docprose.py):
registry, determinism, sizing, needle spans, TRAIN/HELD-OUT separation, scoring, the shipped prose and
its licence, and configs/eval_phrasings.yaml. RULER's own examples must not change. A few seconds."""
from __future__ import annotations

import hashlib
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

from nbcore.tasks import docprose
from nbcore.tasks import haystack as hs
from nbcore.tasks import phrased, ruler
from nbcore.tasks.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
SINGLE = [t for t, s in phrased.TASKS.items() if s.num_k == 1]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def needles_of(ex):
    return [ex["context"][a:b] for a, b in ex["needle_spans"]]


def _trigrams(fam: phrased.Phrasing) -> set:
    out = set()
    for text in (fam.needle, fam.question, fam.prefix):
        w = re.findall(r"\{\w+\}|[A-Za-z']+", text.lower())
        out |= {tuple(w[i:i + 3]) for i in range(len(w) - 2)}
    return out


# ---------------------------------------------------------------------------------------------
# registry: found by name through ruler.generate / score; RULER itself unchanged

def test_registry_and_lookup(tok):
    assert set(ruler.PAPER_SIX) | {"cwe", "fwe"} == set(ruler.TASKS)          # RULER's own list as it was
    assert set(phrased.TASKS) == set(ruler.other_tasks()) and not set(phrased.TASKS) & set(ruler.TASKS)
    assert all(ruler.is_task(t) for t in [*ruler.TASKS, *phrased.TASKS]) and not ruler.is_task("nope")
    assert phrased.TRAIN_TASKS == ("phrased_niah_train", "phrased_multikey_train", "phrased_niah_varied",
                                   "phrased_multikey_varied", "phrased_niah_random", "phrased_multikey_random",
                                   "phrased_niah_echo", "phrased_multikey_echo")
    assert phrased.FIXED_TRAIN_TASKS == phrased.TRAIN_TASKS[:2]
    ex = ruler.generate("phrased_niah_heldout", 1024, 0, tok)
    assert ex == phrased.generate("phrased_niah_heldout", 1024, 0, tok)
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        ruler.generate("nope", 1024, 0, tok)
    with pytest.raises(KeyError):
        ruler.score("nope", "1", ["1"])
    with pytest.raises(ValueError):
        ruler.generate("phrased_niah_train", 1024, 0, tok, split="dev")


def test_ruler_examples_are_byte_identical(tok):
    """The family registry leaves RULER's generator alone: this digest was taken before it existed."""
    h = hashlib.sha256()
    for task in ruler.TASKS:
        for split in ("test", "train"):
            for i in range(2):
                h.update(json.dumps(ruler.generate(task, 2048, i, tok, seed=0, split=split), sort_keys=True).encode())
    assert h.hexdigest() == "c1b28164ef95f776d111bf72e7703a04d5fb2974f78c4d00abbdf1e8fce9bc1d"


# ---------------------------------------------------------------------------------------------
# examples

def test_deterministic(tok):
    a = ruler.generate("phrased_niah_heldout", 4096, 7, tok, seed=3)
    assert a == ruler.generate("phrased_niah_heldout", 4096, 7, tok, seed=3)
    for other in (dict(index=8, seed=3), dict(index=7, seed=4)):
        b = ruler.generate("phrased_niah_heldout", 4096, other["index"], tok, seed=other["seed"])
        assert (a["answers"], a["context"]) != (b["answers"], b["context"])
    assert a["index"] == 7 and a["task"] == "phrased_niah_heldout" and a["length_target"] == 4096
    assert a["prose"] == "python-docs" and a["phrasing"] == phrased.HELDOUT_PHRASINGS[7 % 4].name


@pytest.mark.parametrize("task", list(phrased.TASKS))
@pytest.mark.parametrize("length", [2048, 16384])
def test_length_within_one_percent(tok, task, length):
    ex = ruler.generate(task, length, 1, tok)
    n = len(tok(ex["context"] + ex["question"], add_special_tokens=False)["input_ids"])
    assert n == ex["n_tokens"]
    assert abs(n - length) <= 0.01 * length, (n, length)


@pytest.mark.parametrize("task", list(phrased.TASKS))
def test_needle_spans_keys_values_and_question(tok, task):
    spec = phrased.TASKS[task]
    fams = phrased.PHRASINGS[spec.phrasings]
    # every family of a small set; of a large (generated) set, a few and the wrap-around
    for i in (range(len(fams) + 1) if len(fams) <= 12 else (*range(6), len(fams) - 1, len(fams))):
        for split in ("test", "train"):
            ex = ruler.generate(task, 2048, i, tok, split=split)
            fam = fams[i % len(fams)]
            assert ex["phrasing"] == fam.name and ex["prose"] == phrased.PROSE_NAMES[spec.prose]
            found = [phrased.needle_regex(fam).fullmatch(n) for n in needles_of(ex)]
            assert len(found) == spec.num_k and all(found), needles_of(ex)
            keys = [m["key"] for m in found]
            assert sorted(keys) == sorted(ex["keys"]) and len(set(keys)) == spec.num_k
            assert set(keys) <= set(ruler.split_keys(split))
            (query,) = ex["queries"]
            assert ex["answers"] == [m["value"] for m in found if m["key"] == query]
            q = fam.question.format(key=query) + fam.prefix.format(key=query)
            assert ex["question"] == "\n" + q
            assert [k for k in ex["keys"] if k in ex["question"]] == [query]
            for a, b in ex["needle_spans"]:   # at sentence boundaries, whole
                assert ex["context"][a - 1:a] in ("", " ", "\n") and ex["context"][b:b + 1] in ("", " ")
            if spec.phrasings == "ruler":     # niah_single_2's own header, needle and question
                h, qq = ruler._niah_texts(ruler.TASKS["niah_single_2"], query)
                assert ex["context"].startswith(h + "\n") and ex["question"] == qq


def test_answer_continuation_scores_with_ruler_scoring(tok):
    from nbcore.evals.ruler import Ruler
    ex = ruler.generate("phrased_niah_heldout", 2048, 2, tok)
    bench = Ruler(tasks=["phrased_niah_heldout"], lengths=[2048])
    item = {"task": "phrased_niah_heldout", "length": 2048, "index": 2}
    assert bench.generate(item, tok) == ex
    assert bench.score(item, ruler.answer_text(ex["answers"]), ex["answers"]) == 100.0
    assert ruler.score("phrased_multikey_heldout", "dial 1234567 now", ["1234567"]) == 100
    assert ruler.score("phrased_niah_train", "1234576", ["1234567"]) == 0


# ---------------------------------------------------------------------------------------------
# TRAIN vs HELD-OUT

def test_phrasing_families_train_and_heldout_differ():
    train, held = phrased.TRAIN_PHRASINGS, phrased.HELDOUT_PHRASINGS
    assert len(train) >= 6 and len(held) >= 3
    assert not {f.name for f in train} & {f.name for f in held}
    for f in train + held:
        assert f.needle.count("{key}") == 1 and f.needle.count("{value}") == 1
        assert "{key}" in f.question and "{key}" in f.prefix and f.prefix.startswith(" ")
        assert "{value}" not in f.question + f.prefix
    seen = set().union(*(_trigrams(f) for f in train + (phrased.RULER_PHRASING,)))
    for f in held:  # not a one-word swap: no word trigram shared with any TRAIN or RULER template
        assert not _trigrams(f) & seen, (f.name, _trigrams(f) & seen)
    assert all(phrased.needle_regex(f).fullmatch(f.needle.format(key="a-b", value="1234567")) for f in train + held)
    tr = [phrased.needle_regex(f) for f in train]
    assert not any(r.search(f.needle.format(key="odd-cat", value="1234567")) for r in tr for f in held)



def test_varied_phrasings_are_many_wellformed_and_share_no_heldout_trigram():
    varied, held = phrased.VARIED_PHRASINGS, phrased.HELDOUT_PHRASINGS
    assert len(varied) == 600 and len({f.name for f in varied}) == 600
    assert len({(f.needle, f.question, f.prefix) for f in varied}) == 600
    assert len({f.needle for f in varied}) >= 300                       # wording varies, not only the pairing
    assert not {f.name for f in varied} & {f.name for f in held + phrased.TRAIN_PHRASINGS}
    held3 = set().union(*(_trigrams(f) for f in held))
    for f in varied:
        assert f.needle.count("{key}") == 1 and f.needle.count("{value}") == 1
        assert "{key}" in f.question and f.prefix.startswith(" ") and "{value}" not in f.question + f.prefix
        assert not _trigrams(f) & held3, (f.name, _trigrams(f) & held3)
        assert phrased.needle_regex(f).fullmatch(f.needle.format(key="a-b", value="1234567"))
    # the same families on every import (a training run and its evaluation agree)
    assert phrased._varied_phrasings() == varied
    vr = [phrased.needle_regex(f) for f in varied]
    assert not any(r.search(f.needle.format(key="odd-cat", value="1234567")) for r in vr for f in held)
    # the filter is live: without it, the grammar would make families that share held-out trigrams
    keep = phrased.HELDOUT_PHRASINGS
    try:
        phrased.HELDOUT_PHRASINGS = (phrased.Phrasing("probe", "The pin of {key} is {value}.", "q {key}?", " {key}"),)
        probe = phrased._varied_phrasings(200, seed=1)
    finally:
        phrased.HELDOUT_PHRASINGS = keep
    assert not any("The pin of {key} is {value}." == f.needle for f in probe)


def test_random_phrasings_are_random_words_wellformed_and_share_no_heldout_trigram():
    rand, held = phrased.RANDOM_PHRASINGS, phrased.HELDOUT_PHRASINGS
    assert len(rand) == 1000 and len({f.name for f in rand}) == 1000
    assert len({f.needle for f in rand}) == 1000 and len({f.question for f in rand}) >= 900
    assert not {f.name for f in rand} & {f.name for f in held + phrased.TRAIN_PHRASINGS + phrased.VARIED_PHRASINGS}
    vocab = set(phrased._prose_vocabulary())
    essay = {w.lower() for w in hs.essay_words() if w.isalpha()}
    assert len(vocab) == 2000 and vocab <= essay          # words of the TRAINING prose only
    held3 = set().union(*(_trigrams(f) for f in held))
    value_first = 0
    for f in rand:
        assert f.needle.count("{key}") == 1 and f.needle.count("{value}") == 1
        assert "{key}" in f.question and f.prefix.startswith(" ") and "{value}" not in f.question + f.prefix
        assert not _trigrams(f) & held3, (f.name, _trigrams(f) & held3)
        assert phrased.needle_regex(f).fullmatch(f.needle.format(key="a-b", value="1234567"))
        words = re.findall(r"[A-Za-z']+", re.sub(r"\{\w+\}", " ", f.needle + f.question + f.prefix))
        assert {w.lower() for w in words} <= vocab
        value_first += f.needle.index("{value}") < f.needle.index("{key}")
    assert 250 <= value_first <= 450
    assert phrased._random_phrasings() == rand          # the same families on every import

def test_echo_phrasings_end_the_prefix_with_the_words_before_the_value_and_share_no_heldout_trigram():
    echo, held = phrased.ECHO_PHRASINGS, phrased.HELDOUT_PHRASINGS
    assert len(echo) == 1000 and len({f.name for f in echo}) == 1000 and len({f.needle for f in echo}) == 1000
    others = held + phrased.TRAIN_PHRASINGS + phrased.VARIED_PHRASINGS + phrased.RANDOM_PHRASINGS
    assert not {f.name for f in echo} & {f.name for f in others}
    vocab, held3 = set(phrased._prose_vocabulary()), set().union(*(_trigrams(f) for f in held))
    with_key = 0
    for f in echo:
        assert f.needle.count("{key}") == 1 and f.needle.count("{value}") == 1
        assert f.needle.index("{key}") < f.needle.index("{value}")            # key first, always
        assert "{key}" in f.question and f.prefix.startswith(" ") and "{value}" not in f.question + f.prefix
        assert not _trigrams(f) & held3, (f.name, _trigrams(f) & held3)
        assert phrased.needle_regex(f).fullmatch(f.needle.format(key="a-b", value="1234567"))
        before = f.needle[:f.needle.index(" {value}")].split(" ")     # the needle's words before the value
        assert f.prefix.split(" ")[-1] == before[-1] != "{key}"       # the prefix ends with the word before it
        words = re.findall(r"[A-Za-z']+", re.sub(r"\{\w+\}", " ", f.needle + f.question + f.prefix))
        assert {w.lower() for w in words} <= vocab
        with_key += "{key}" in f.prefix
    assert 600 <= with_key <= 800
    assert phrased._echo_phrasings() == echo


def _prose_sentences(ex) -> list[str]:
    ctx = ex["context"]
    for a, b in sorted(ex["needle_spans"], reverse=True):
        ctx = ctx[:a] + ctx[b:]
    if ctx.startswith("A special magic number"):
        ctx = ctx.split("\n", 1)[1]
    return [s for s in hs.split_sentences(ctx) if len(s) > 20]


def test_prose_sources_are_disjoint_and_as_assigned(tok):
    train_text, held_text = hs.essay_text(), docprose.docs_text()
    wrap = {"train": train_text + " " + train_text, "heldout": held_text + " " + held_text}
    a = {s for s in hs.split_sentences(train_text) if len(s) > 30}
    b = {s for s in hs.split_sentences(held_text) if len(s) > 30}
    assert a and b and not a & b
    for task, spec in phrased.TASKS.items():
        for split in ("test", "train"):
            ex = ruler.generate(task, 2048, 3, tok, split=split)
            sents = _prose_sentences(ex)
            assert len(sents) > 20
            other = "heldout" if spec.prose == "train" else "train"
            # (a sentence may be split differently where a needle cut it; most are whole)
            assert sum(s in wrap[spec.prose] for s in sents) >= 0.9 * len(sents), task
            assert not any(s in wrap[other] for s in sents if len(s) > 40), task


def test_shipped_heldout_prose_and_licence():
    text = docprose.docs_text()
    assert hashlib.sha256(text.encode()).hexdigest() == docprose.DOCS_PROSE_SHA256
    assert len(text) <= 300_000 and docprose.DOCS_PROSE_FILE.stat().st_size <= 300_000
    assert text.isascii() and "  " not in text and len(docprose.docs_words()) > 40_000
    lic = (docprose.DOCS_PROSE_FILE.parent / "DOCS-PROSE-LICENSE").read_text()
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in lic and docprose.DOCS_PROSE_SHA256 in lic
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["nbcore.tasks.data"]
    assert "*.gz" in data and "DOCS-PROSE-LICENSE" in data


def test_damaged_heldout_prose_is_a_clear_error(tmp_path):
    bad = tmp_path / "d.gz"
    bad.write_bytes(b"nope")
    with pytest.raises(hs.HaystackUnavailable, match="missing or damaged"):
        docprose.read_docs_prose(bad)


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7), reason="the shipped text was built from CPython 3.11.7")
def test_rebuild_from_this_interpreter_gives_the_shipped_text():
    import sysconfig
    text = docprose.build_docs_prose(sysconfig.get_paths()["stdlib"])
    assert hashlib.sha256(text.encode()).hexdigest() == docprose.DOCS_PROSE_SHA256


# ---------------------------------------------------------------------------------------------
# the evaluation config

@pytest.mark.parametrize("name,tasks", [
    ("eval_phrasings", ["phrased_niah_heldout"]),
    ("eval_phrasings_controls", ["phrased_niah_train", "phrased_niah_heldout_phrasing", "phrased_niah_heldout_prose"])])
def test_eval_phrasings_configs_plan_the_grid(name, tasks):
    """Plain at the training length (2K); plain, oracle notes and the best native router, both with
    lambda = 0, at 64K; 20 examples per cell; the held-out task alone in the main config."""
    from notebank.pipeline.config import ConfigError, load_config
    from notebank.pipeline.evaluate_ruler import RulerJobConfig
    path = REPO / "configs" / f"{name}.yaml"
    assert f"python jobs/evaluate.py -c configs/{name}.yaml" in path.read_text().split("\nbenchmark:")[0]
    cfg = load_config(RulerJobConfig, path).validate()
    assert cfg.tasks == tasks and cfg.n_examples == 20
    assert cfg.output == {"eval_phrasings": "bench/results/phrasings",
                          "eval_phrasings_controls": "bench/results/phrasings-controls"}[name]
    cells, _ = cfg.plan()
    by = {}
    for c in cells:
        by.setdefault((c["entry"], c["item"]["length"]), set()).add(tuple(c["methods"]))
    assert {b.name for b in cfg.backbones} >= {"tiny-gdn-v5", "tiny-mamba2-p5"}
    for b in cfg.backbones:
        assert by[(b.name, 2048)] == {("plain",)}
        assert by[(b.name, 65536)] == {("plain", "nb-oracle-top2-reset", "nb-embmax_centered-top2-reset")}
    assert len(cells) == len(cfg.backbones) * len(cfg.tasks) * 2 * 20
    with pytest.raises(ConfigError, match="unknown task"):
        load_config(RulerJobConfig, path, ["tasks=[phrased_niah_nope]"]).validate()
