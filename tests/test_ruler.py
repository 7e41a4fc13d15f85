"""RULER generators, scoring and the project tokenizer (fast: a few seconds on 2 cores)."""
from __future__ import annotations

import collections
import re
import time

import pytest

from nbcore.tasks import haystack as hs
from nbcore.tasks import ruler
from nbcore.tasks.tokenizer import build_tokenizer, load_tokenizer

NEEDLE_RE = re.compile(r"One of the special magic (numbers|uuids) for ([a-z]+-[a-z]+) is: ([0-9a-f-]+)\.")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def needles_of(ex):
    return [ex["context"][a:b] for a, b in ex["needle_spans"]]


# ---------------------------------------------------------------------------------------------
# scoring

def test_string_match_all_hand_checked():
    assert ruler.string_match_all(["abc 123"], ["123", "456"]) == 50
    assert ruler.string_match_all(["abc 123", "456"], [["123"], ["456", "789"]]) == 75
    assert ruler.score("niah_single_1", " The answer is 1234567.", ["1234567"]) == 100
    assert ruler.score("niah_single_3", "ABCDEF12-x", ["abcdef12-x"]) == 100  # case-insensitive
    assert ruler.score("niah_multivalue", "1, 2", ["1", "2", "3", "4"]) == 50
    assert ruler.score("niah_single_1", "", ["1234567"]) == 0


def test_registry():
    assert ruler.PAPER_SIX == ("niah_single_1", "niah_single_2", "niah_single_3",
                               "niah_multikey_1", "niah_multiquery", "niah_multivalue")
    assert set(ruler.PAPER_SIX) | {"cwe", "fwe"} == set(ruler.TASKS)


# ---------------------------------------------------------------------------------------------
# NIAH structure

@pytest.mark.parametrize("task,n_needles,n_answers", [
    ("niah_single_1", 1, 1), ("niah_single_2", 1, 1), ("niah_single_3", 1, 1),
    ("niah_multikey_1", 4, 1), ("niah_multiquery", 4, 4), ("niah_multivalue", 4, 4)])
def test_niah_counts_and_needles(tok, task, n_needles, n_answers):
    spec = ruler.TASKS[task]
    ex = ruler.generate(task, 4096, 3, tok)
    assert len(ex["needle_spans"]) == n_needles
    assert len(ex["answers"]) == n_answers
    found = [NEEDLE_RE.fullmatch(n) for n in needles_of(ex)]
    assert all(found), needles_of(ex)
    assert {m.group(1) for m in found} == {spec.type_v}
    keys = [m.group(2) for m in found]
    values = [m.group(3) for m in found]
    assert len(set(values)) == n_needles
    assert set(ex["answers"]) <= set(values)
    if task == "niah_multivalue":
        assert len(set(keys)) == 1
    else:
        assert len(set(keys)) == n_needles
    for v in values:
        if spec.type_v == "numbers":
            assert re.fullmatch(r"[1-9][0-9]{6}", v)
        else:
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", v)
    # every queried key appears in the question; answers are the queried keys' values
    asked = [k for k in set(keys) if k in ex["question"]]
    assert len(asked) == (4 if task == "niah_multiquery" else 1)
    assert sorted(ex["answers"]) == sorted(v for k, v in zip(keys, values) if k in asked)


def test_single_template_exact(tok):
    ex = ruler.generate("niah_single_1", 4096, 0, tok)
    (key,) = ex["queries"]
    assert ex["context"].startswith(
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\n")
    assert ex["question"] == (
        f"\nWhat is the special magic number for {key} mentioned in the provided text? "
        f"The special magic number for {key} mentioned in the provided text is")
    # noise haystack: every line is RULER's noise block or a needle
    lines = ex["context"].split("\n")[1:]
    assert all(ln == hs.NOISE or NEEDLE_RE.fullmatch(ln) for ln in lines)
    assert sum(ln != hs.NOISE for ln in lines) == 1


def test_multi_template_exact(tok):
    ex = ruler.generate("niah_multiquery", 4096, 0, tok)
    a, b, c, d = ex["queries"]
    assert ex["context"].startswith(
        "Some special magic numbers are hidden within the following text. Make sure to memorize "
        "it. I will quiz you about the numbers afterwards.\n")
    assert ex["question"] == (
        f"\nWhat are all the special magic numbers for {a}, {b}, {c}, and {d} mentioned in the "
        f"provided text? The special magic numbers for {a}, {b}, {c}, and {d} mentioned in the "
        "provided text are")
    ex = ruler.generate("niah_single_3", 4096, 0, tok)
    assert "special magic uuid for" in ex["question"] and ex["question"].endswith("text is")


def test_essay_needles_at_sentence_boundaries(tok):
    for i in range(5):
        ex = ruler.generate("niah_multikey_1", 4096, i, tok)
        head_end = ex["context"].index("\n") + 1
        for a, b in ex["needle_spans"]:
            before = ex["context"][max(head_end, a - 2):a]
            assert a == head_end or before.endswith(" ") and (
                re.search(r"[.!?][\"')]? $", ex["context"][a - 4:a]) or a - 1 == head_end
                or NEEDLE_RE.search(ex["context"][head_end:a].rsplit(" ", 20)[-1] + " ") is None)
            assert b == len(ex["context"]) or ex["context"][b] == " "


# ---------------------------------------------------------------------------------------------
# sizing, determinism, splits

@pytest.mark.parametrize("task", list(ruler.TASKS))
@pytest.mark.parametrize("length", [4096, 16384])
def test_length_within_one_percent(tok, task, length):
    ex = ruler.generate(task, length, 1, tok)
    n = len(tok(ex["context"] + ex["question"], add_special_tokens=False)["input_ids"])
    assert n == ex["n_tokens"]
    assert abs(n - length) <= 0.01 * length, (n, length)


def test_one_million_tokens_fast(tok):
    ruler.generate("niah_single_2", 4096, 0, tok)  # warm the per-tokenizer word-count cache
    t = time.time()
    ex = ruler.generate("niah_multivalue", 1 << 20, 0, tok)
    assert time.time() - t < 30
    assert abs(ex["n_tokens"] - (1 << 20)) <= 0.01 * (1 << 20)


def test_deterministic(tok):
    a = ruler.generate("niah_single_1", 4096, 7, tok, seed=3)
    b = ruler.generate("niah_single_1", 4096, 7, tok, seed=3)
    c = ruler.generate("niah_single_1", 4096, 8, tok, seed=3)
    assert a == b
    assert a["answers"] != c["answers"] or a["context"] != c["context"]
    assert a["index"] == 7 and a["task"] == "niah_single_1" and a["length_target"] == 4096


def test_train_test_keys_disjoint(tok):
    train, test = set(ruler.split_keys("train")), set(ruler.split_keys("test"))
    assert train and test and not train & test
    assert train | test == set(ruler.all_keys())
    for i in range(5):
        assert set(ruler.generate("niah_single_1", 1024, i, tok)["queries"]) <= test
        assert set(ruler.generate("niah_single_1", 1024, i, tok, split="train")["queries"]) <= train
    with pytest.raises(ValueError):
        ruler.generate("niah_single_1", 1024, 0, tok, split="dev")


# ---------------------------------------------------------------------------------------------
# CWE / FWE

def test_cwe_counts(tok):
    ex = ruler.generate("cwe", 4096, 0, tok)
    assert len(ex["answers"]) == 10
    lst = ex["context"].rsplit("\n", 1)[1]
    words = re.findall(r"\d+\. (\S+)", lst)
    cnt = collections.Counter(words)
    assert all(cnt[w] == 30 for w in ex["answers"])
    assert max(c for w, c in cnt.items() if w not in ex["answers"]) == 3
    assert ex["question"].endswith("Answer: The top 10 words that appear most often in the list are:")


def test_fwe_answers_are_ranks_two_to_four(tok):
    ex = ruler.generate("fwe", 4096, 0, tok)
    words = ex["context"].split(" ")
    cnt = collections.Counter(w for w in words if re.fullmatch(r"[a-z]{6}", w))
    top = [w for w, _ in cnt.most_common(3)]
    assert sorted(top) == sorted(ex["answers"])
    assert "..." in words
    assert ex["context"].startswith("Read the following coded text and track the frequency")


# ---------------------------------------------------------------------------------------------
# tokenizer

def test_tokenizer_offsets_digits_punctuation(tok, tmp_path):
    text = "The sky is blue. Call 1234567 now!\nWhat? 3fa9c2e1-77ab wonderful-apple \u00fcber"
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    pieces = [text[a:b] for a, b in enc["offset_mapping"]]
    assert "".join(pieces) == text  # offsets tile the text exactly
    assert [p.strip() for p in pieces if p.strip().isdigit()] == list("1234567") + ["3", "9", "2", "1", "7", "7"]
    assert all(len(p.strip()) == 1 for p in pieces if any(ch.isdigit() for ch in p))
    for mark in (".", "!", "?", "\n"):
        assert mark in pieces
    assert tok.decode(tok(text.replace("\u00fc", "u"), add_special_tokens=False)["input_ids"]) == text.replace("\u00fc", "u")
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.eos_token and again.bos_token and again.pad_token


def test_tokenizer_build_reproduces_shipped(tok):
    built = build_tokenizer()
    assert built.get_vocab() == tok.get_vocab()
