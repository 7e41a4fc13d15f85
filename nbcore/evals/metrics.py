"""Answer metrics of LongBench v1/v2 and MemoryAgentBench, reimplemented from the official sources.

Sources read (behaviour reproduced, code not copied):

* THUDM/LongBench ``LongBench/metrics.py`` and ``LongBench/eval.py`` (commit 2e00731): ``qa_f1_score``
  with ``normalize_answer``, ``rouge_score`` (Rouge-L F of the ``rouge`` package), and
  ``classification_score``; the scorer keeps the max over reference answers and, for trec,
  triviaqa, samsum and lsht, scores only the first line of the prediction.
* pltrdy/rouge 1.0.1 (``rouge/rouge.py``, ``rouge/rouge_score.py``): ``Rouge().get_scores`` with its
  defaults (``exclusive=True``, summary-level Rouge-L).
* THUDM/LongBench ``pred.py`` (v2): ``extract_answer``.
* HUST-AI-HYZ/MemoryAgentBench ``utils/eval_other_utils.py``: ``normalize_answer``,
  ``substring_exact_match_score``, ``drqa_metric_max_over_ground_truths``, ``parse_output``.

All functions are pure and use only the standard library. Scores are in [0, 1] unless noted.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from typing import Callable, Iterable, Sequence

__all__ = [
    "normalize_answer",
    "token_f1",
    "qa_f1_score",
    "rouge_sentences",
    "rouge_l_f",
    "rouge_score",
    "classification_score",
    "first_line",
    "max_over_references",
    "extract_choice",
    "choice_accuracy",
    "substring_exact_match",
    "flatten_ground_truths",
    "max_over_ground_truths",
    "parse_output",
]

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


# --------------------------------------------------------------------------------------------
# LongBench v1
# --------------------------------------------------------------------------------------------


def normalize_answer(s: str) -> str:
    """Official SQuAD-style normalisation used by LongBench and MemoryAgentBench.

    In this order: lowercase; drop every ``string.punctuation`` character; replace the whole words
    ``a``/``an``/``the`` by a space; collapse whitespace (``" ".join(s.split())``).
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 (multiset overlap), 0.0 when nothing overlaps (LongBench ``f1_score``)."""
    same = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if same == 0:
        return 0.0
    p = same / len(prediction_tokens)
    r = same / len(reference_tokens)
    return 2 * p * r / (p + r)


def qa_f1_score(prediction: str, ground_truth: str, **_: object) -> float:
    """LongBench ``qa_f1_score``: token F1 of the normalised, whitespace-split strings."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def rouge_sentences(text: str) -> list[str]:
    """Sentence split of ``rouge`` 1.0.1: split on ``"."``, drop empty pieces, collapse whitespace.

    Whitespace-only pieces survive as ``""`` sentences (the package checks ``len`` before collapsing).
    """
    return [" ".join(piece.split()) for piece in text.split(".") if len(piece) > 0]


def _lcs_path_words(ref: Sequence[str], hyp: Sequence[str]) -> list[str]:
    """Words of the LCS of ``ref`` and ``hyp`` along ``rouge``'s reconstruction path.

    Same DP table and tie-breaking as ``rouge_score._recon_lcs``: walk back from the end; on a
    match take the word, else move up (drop a ref word) only if that cell is strictly larger than
    the cell to the left, otherwise move left. Iterative, so no recursion limit.
    """
    n, m = len(ref), len(hyp)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        ri, row, prev = ref[i - 1], table[i], table[i - 1]
        for j in range(1, m + 1):
            if ri == hyp[j - 1]:
                row[j] = prev[j - 1] + 1
            else:
                row[j] = prev[j] if prev[j] > row[j - 1] else row[j - 1]
    out: list[str] = []
    i, j = n, m
    while i > 0 and j > 0:
        if ref[i - 1] == hyp[j - 1]:
            out.append(ref[i - 1])
            i -= 1
            j -= 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out


def rouge_l_f(prediction: str, reference: str) -> float:
    """Rouge-L F of ``rouge.Rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"]``.

    ``rouge`` 1.0.1 defaults (``exclusive=True``), summary level, no lowercasing or stemming:

    * both texts are split into sentences by :func:`rouge_sentences`; words are ``split(" ")``;
    * ``m`` / ``n`` are the numbers of *distinct* words of the reference / prediction;
    * ``LCS_u`` is the number of distinct words in the union, over every (reference sentence,
      prediction sentence) pair, of the words on that pair's LCS path;
    * ``R = LCS_u / m``, ``P = LCS_u / n``, ``F = 2 P R / (P + R + 1e-8)``.

    An empty prediction or reference (no sentence left) makes the package raise; LongBench's
    ``rouge_score`` turns that into 0.0, and so does this function.

    Difference: the package reconstructs each LCS recursively, so a sentence pair whose lengths sum
    to more than roughly Python's recursion limit (~1000 words) raises ``RecursionError``, which
    LongBench's bare ``except`` also turns into 0.0. This implementation is iterative and returns
    the actual score for such pairs.
    """
    hyp = rouge_sentences(prediction)
    ref = rouge_sentences(reference)
    if not hyp or not ref:
        return 0.0
    hyp_words = [s.split(" ") for s in hyp]
    ref_words = [s.split(" ") for s in ref]
    m = len({w for ws in ref_words for w in ws})
    n = len({w for ws in hyp_words for w in ws})
    union: set[str] = set()
    for rw in ref_words:
        for hw in hyp_words:
            union.update(_lcs_path_words(rw, hw))
    llcs = len(union)
    r = llcs / m
    p = llcs / n
    return 2.0 * ((p * r) / (p + r + 1e-8))


def rouge_score(prediction: str, ground_truth: str, **_: object) -> float:
    """LongBench ``rouge_score`` (gov_report, qmsum, multi_news, samsum): :func:`rouge_l_f`."""
    return rouge_l_f(prediction, ground_truth)


def classification_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str], **_: object) -> float:
    """LongBench ``classification_score`` (trec, lsht), reproducing the official behaviour exactly.

    1. Collect, in ``all_classes`` order, every class name that occurs as a substring of the
       prediction (case-sensitive).
    2. Walk that list once, front to back, removing any entry that is a substring of the ground
       truth but not equal to it. As in the official loop (``list.remove`` while iterating), the
       entry right after a removed one is skipped by the walk.
    3. Score ``1 / len(list)`` if the ground truth is still in the list, else 0.

    (The official difflib fallback is unreachable: its guard ``em_match_list != 0`` is always true.)
    """
    matches = [c for c in all_classes if c in prediction]
    i = 0
    while i < len(matches):  # emulates Python's list iterator over a list mutated in the loop
        term = matches[i]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)  # removes the first equal element, like the official code
        i += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def first_line(prediction: str) -> str:
    """LongBench post-processing for trec/triviaqa/samsum/lsht: ``lstrip("\\n")``, then the first line."""
    return prediction.lstrip("\n").split("\n")[0]


def max_over_references(
    metric: Callable[..., float], prediction: str, references: Iterable[str], **kwargs: object
) -> float:
    """LongBench scorer: ``max(0, metric(prediction, ref) for ref in references)``."""
    score = 0.0
    for ref in references:
        score = max(score, float(metric(prediction, ref, **kwargs)))
    return score


# --------------------------------------------------------------------------------------------
# LongBench v2
# --------------------------------------------------------------------------------------------

_CHOICE_PAREN = re.compile(r"The correct answer is \(([A-D])\)")
_CHOICE_BARE = re.compile(r"The correct answer is ([A-D])")


def extract_choice(response: str) -> str | None:
    """LongBench v2 answer parser (``pred.py``: ``extract_answer`` on the stripped output).

    Remove every ``*``; return X from the first ``The correct answer is (X)`` (X in A-D); failing
    that, from the first ``The correct answer is X``; else ``None`` (counted wrong). Case-sensitive.
    """
    text = response.strip().replace("*", "")
    m = _CHOICE_PAREN.search(text) or _CHOICE_BARE.search(text)
    return m.group(1) if m else None


def choice_accuracy(predictions: Sequence[str | None], answers: Sequence[str], *, compensated: bool = False) -> float:
    """Accuracy in percent (0-100) over examples (LongBench v2 ``result.py``).

    ``compensated=True`` counts an unparsed prediction (``None``) as 0.25, the official
    ``result.py`` option (off by default, as there).
    """
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions vs {len(answers)} answers")
    if not answers:
        raise ValueError("choice_accuracy needs at least one example")
    total = 0.0
    for p, a in zip(predictions, answers):
        if p is None and compensated:
            total += 0.25
        else:
            total += float(p == a)
    return 100.0 * total / len(answers)


# --------------------------------------------------------------------------------------------
# MemoryAgentBench
# --------------------------------------------------------------------------------------------


def substring_exact_match(prediction: str, ground_truth: str) -> bool:
    """MemoryAgentBench ``substring_exact_match_score``: normalised reference in normalised prediction."""
    return normalize_answer(ground_truth) in normalize_answer(prediction)


def flatten_ground_truths(ground_truths: str | Sequence) -> list[str]:
    """Official flattening: a string -> [string]; a list whose first item is a list -> flattened."""
    if isinstance(ground_truths, str):
        return [ground_truths]
    gts = list(ground_truths)
    if gts and isinstance(gts[0], (list, tuple)):
        return [g for sub in gts for g in sub]
    return gts


def max_over_ground_truths(
    metric: Callable[[str, str], float], prediction: str, ground_truths: str | Sequence
) -> float:
    """MemoryAgentBench ``drqa_metric_max_over_ground_truths`` (raises on an empty list, as official)."""
    gts = flatten_ground_truths(ground_truths)
    if not gts:
        raise ValueError("no ground-truth answers to score against")
    return max(float(metric(prediction, g)) for g in gts)


def parse_output(output_text: str, answer_prefix: str = "Answer:") -> str | None:
    """MemoryAgentBench ``parse_output``: the rest of the line after ``answer_prefix``, else the first line.

    Case-insensitive search for ``answer_prefix``; take what follows up to the end of that line,
    strip it, and drop a repeated leading ``answer_prefix``. Without the prefix, the first line of
    the output is used the same way. (Never ``None`` in practice: the fallback always matches.)
    """
    for pattern in (
        re.compile(f"(?:{answer_prefix})(.*)(?:\n|$)", flags=re.IGNORECASE),
        re.compile(r"(?:^)(.*)(?:\n|$)"),
    ):
        m = pattern.search(output_text)
        if m:
            extracted = m[1].strip()
            return re.sub(f"^{re.escape(answer_prefix)}", "", extracted, flags=re.IGNORECASE).strip()
    return None
