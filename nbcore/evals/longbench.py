"""LongBench v1 (12 English subsets) and LongBench v2: prompts, scoring, loaders, subsets, and the
two benchmarks (:class:`LongBench`, :class:`LongBenchV2`; ``nbcore.evals.base``).

Reimplemented from THUDM/LongBench (commit 2e00731): ``LongBench/config/dataset2prompt.json``,
``LongBench/config/dataset2maxlen.json``, ``LongBench/eval.py``, ``LongBench/pred.py`` (v1);
``prompts/0shot.txt``, ``pred.py``, ``result.py`` (v2). Paper protocol (App. C.2): v1 uses 30 fixed
examples per subset shared across methods, native task prompts without chat formatting, and the
unweighted macro-average on 0-100; v2 keeps an example only when its complete prompt plus the
reserved replay and generation budget fits the position budget (never truncated).

Published data formats:

* v1: ``data/{dataset}.jsonl`` from LongBench's ``data.zip`` (the HF dataset ``THUDM/LongBench``),
  one JSON object per line with ``input``, ``context``, ``answers`` (list), ``length``, ``dataset``,
  ``language``, ``all_classes`` (list or null) and ``_id``.
* v2: ``data.json`` of ``THUDM/LongBench-v2``, a JSON array of objects with ``_id``, ``domain``,
  ``sub_domain``, ``difficulty``, ``length``, ``question``, ``choice_A`` .. ``choice_D``, ``answer``
  and ``context`` (JSONL with the same fields is accepted too).

Paths may be local or fsspec URLs (``memory://``, ``s3://``, ...).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from nbcore.evals.base import Benchmark, register
from nbcore.evals.methods import answer_methods, qa_rows
from nbcore.evals.metrics import (
    choice_accuracy,
    classification_score,
    extract_choice,
    first_line,
    max_over_references,
    qa_f1_score,
    rouge_score,
)

__all__ = [
    "V1_DATASETS",
    "DATASET2PROMPT",
    "DATASET2MAXLEN",
    "DATASET2METRIC",
    "FIRST_LINE_DATASETS",
    "CATEGORIES",
    "V1_FIELDS",
    "V2_FIELDS",
    "V2_PROMPT_0SHOT",
    "V2_MAX_NEW_TOKENS",
    "V2_PAPER_DOMAINS",
    "V2_PAPER_SUB_DOMAINS",
    "build_prompt",
    "max_new_tokens",
    "score_prediction",
    "dataset_score",
    "aggregate_scores",
    "select_subset",
    "split_prompt",
    "truncate_middle",
    "load_longbench",
    "build_prompt_v2",
    "split_at_context",
    "chat_prompt",
    "parse_choice",
    "v2_accuracy",
    "fits_in_budget",
    "filter_fits",
    "select_v2",
    "load_longbench_v2",
    "capped",
    "v1_category",
    "LongBench",
    "LongBenchV2",
]

# ----------------------------------------------------------------------------- v1 configuration

V1_DATASETS: tuple[str, ...] = (
    "narrativeqa", "qasper", "multifieldqa_en",
    "hotpotqa", "2wikimqa", "musique",
    "gov_report", "qmsum", "multi_news",
    "trec", "triviaqa", "samsum",
)

_MULTI_DOC = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nThe following are given passages.\n{context}\n\n"
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nQuestion: {input}\nAnswer:"
)
_QASPER_RULE = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered "
    "based on the information in the article, write \"unanswerable\". If the question is a yes/no question, "
    "answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation."
)

#: Official ``LongBench/config/dataset2prompt.json`` entries, byte for byte. (The official
#: narrativeqa prompt really reads "asconcisely"; it is kept, as the released prompts are.)
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\n"
        "Story: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single "
        "phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question " + _QASPER_RULE
        + "\n\nArticle: {context}\n\n Answer the question based on the above article " + _QASPER_RULE
        + "\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
        "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "hotpotqa": _MULTI_DOC,
    "2wikimqa": _MULTI_DOC,
    "musique": _MULTI_DOC,
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. "
        "The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    ),
}

#: Official ``LongBench/config/dataset2maxlen.json`` (max new tokens).
DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64,
    "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
    "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "trec": 64, "triviaqa": 32, "samsum": 128,
}

_METRICS: dict[str, Callable[..., float]] = {"qa_f1": qa_f1_score, "rouge": rouge_score,
                                             "classification": classification_score}

#: Official ``dataset2metric`` of ``LongBench/eval.py`` (by name; see :data:`_METRICS`).
DATASET2METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1",
    "hotpotqa": "qa_f1", "2wikimqa": "qa_f1", "musique": "qa_f1",
    "gov_report": "rouge", "qmsum": "rouge", "multi_news": "rouge",
    "trec": "classification", "triviaqa": "qa_f1", "samsum": "rouge",
}

#: Datasets whose prediction is cut to its first line before scoring (``eval.py``).
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})

#: LongBench task categories used for the paper's macro-averages (Table 5).
CATEGORIES: dict[str, tuple[str, ...]] = {
    "single_doc_qa": ("narrativeqa", "qasper", "multifieldqa_en"),
    "multi_doc_qa": ("hotpotqa", "2wikimqa", "musique"),
    "summarization": ("gov_report", "qmsum", "multi_news"),
    "few_shot": ("trec", "triviaqa", "samsum"),
}

V1_FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")
V2_FIELDS = ("_id", "domain", "sub_domain", "difficulty", "length", "question",
             "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context")


def _check_dataset(dataset: str) -> None:
    if dataset not in DATASET2PROMPT:
        raise KeyError(f"unknown LongBench v1 dataset {dataset!r}; expected one of {V1_DATASETS}")


def build_prompt(dataset: str, example: Mapping[str, Any]) -> str:
    """The native task prompt: ``dataset2prompt[dataset].format(**example)`` (no chat template)."""
    _check_dataset(dataset)
    return DATASET2PROMPT[dataset].format(**example)


def max_new_tokens(dataset: str) -> int:
    """Official generation budget for ``dataset`` (``dataset2maxlen.json``)."""
    _check_dataset(dataset)
    return DATASET2MAXLEN[dataset]


def score_prediction(
    dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """Score of one prediction in [0, 1], as ``eval.py``'s ``scorer`` does per example.

    First-line cut for trec/triviaqa/samsum, then the dataset's metric maximised over ``answers``.
    """
    _check_dataset(dataset)
    if dataset in FIRST_LINE_DATASETS:
        prediction = first_line(prediction)
    metric = _METRICS[DATASET2METRIC[dataset]]
    if metric is classification_score:
        if not all_classes:
            raise ValueError(f"{dataset}: classification_score needs all_classes")
        return max_over_references(metric, prediction, answers, all_classes=all_classes)
    return max_over_references(metric, prediction, answers)


def dataset_score(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None = None,
) -> float:
    """Dataset score on 0-100, rounded to 2 decimals like ``eval.py`` (``round(100 * mean, 2)``)."""
    if len(predictions) != len(answers):
        raise ValueError(f"{dataset}: {len(predictions)} predictions vs {len(answers)} answer lists")
    if not predictions:
        raise ValueError(f"{dataset}: no predictions to score")
    total = sum(score_prediction(dataset, p, a, all_classes) for p, a in zip(predictions, answers))
    return round(100 * total / len(predictions), 2)


def aggregate_scores(scores: Mapping[str, float], *, ndigits: int | None = 2) -> dict[str, float]:
    """Category macro-averages and the overall macro-average over evaluated tasks (paper Table 5).

    ``scores`` maps dataset -> 0-100 score (e.g. :func:`dataset_score`). A category is reported
    when at least one of its datasets is present (mean over the present ones); ``overall`` is the
    unweighted mean over all present datasets, which equals the mean of the four categories when
    every category is complete (3 tasks each).
    """
    unknown = set(scores) - set(DATASET2METRIC)
    if unknown:
        raise KeyError(f"unknown LongBench v1 datasets {sorted(unknown)}")
    if not scores:
        raise ValueError("aggregate_scores needs at least one dataset score")

    def r(x: float) -> float:
        return round(x, ndigits) if ndigits is not None else x

    out: dict[str, float] = {}
    for cat, names in CATEGORIES.items():
        present = [scores[n] for n in names if n in scores]
        if present:
            out[cat] = r(sum(present) / len(present))
    out["overall"] = r(sum(scores.values()) / len(scores))
    return out


def select_subset(examples: Sequence[Any], n: int, seed: int = 0) -> list[Any]:
    """A fixed subset of ``n`` examples chosen by ``seed`` (paper: 30 per v1 subset).

    ``random.Random(seed).sample(range(len(examples)), n)``, returned in original file order; all
    examples when ``n >= len(examples)``. Deterministic for a given file order, seed and ``n``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n >= len(examples):
        return list(examples)
    idx = sorted(random.Random(seed).sample(range(len(examples)), n))
    return [examples[i] for i in idx]


def split_prompt(dataset: str, example: Mapping[str, Any]) -> tuple[str, str]:
    """The native prompt cut right after the context: ``(head, question)``, ``head + question == prompt``.

    ``head`` (instruction + context) is what a recurrent reader ingests into its state; ``question``
    (the template text after ``{context}``, with ``{input}`` filled in) is what it reads at answer time.
    """
    _check_dataset(dataset)
    before, after = DATASET2PROMPT[dataset].split("{context}")
    return before.format(**example) + str(example["context"]), after.format(**example)


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def truncate_middle(tokenizer, head: str, question: str, max_length: int | None) -> tuple[str, str, bool]:
    """Official v1 middle truncation (``pred.py``) of the prompt ``head + question`` to ``max_length`` tokens.

    When the tokenised prompt is longer than ``max_length``, only its first and last
    ``max_length // 2`` tokens are kept (decoded and joined, as ``pred.py`` does); the question, at
    the end of the prompt, survives whole while it is shorter than half the budget (else ValueError).
    -> (head, question, truncated?). ``max_length=None`` never truncates. ``tokenizer`` is a
    transformers tokenizer (``__call__`` -> ``input_ids``, ``decode``).
    """
    if max_length is None:
        return head, question, False
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 tokens, got {max_length}")
    ids = _ids(tokenizer, head + question, True)
    if len(ids) <= max_length:
        return head, question, False
    half = max_length // 2
    n_q = len(_ids(tokenizer, question, False))
    if n_q >= half:
        raise ValueError(f"question of {n_q} tokens does not fit in half of max_length={max_length}")
    first = tokenizer.decode(ids[:half], skip_special_tokens=True)
    last = tokenizer.decode(ids[-half:], skip_special_tokens=True)
    if last.endswith(question):
        return first + last[: len(last) - len(question)], question, True
    # The tokeniser merged across the context/question boundary: cut by the question's token count.
    return first + tokenizer.decode(ids[-half:-n_q], skip_special_tokens=True), question, True


# ----------------------------------------------------------------------------- I/O helpers


def _is_url(path: str) -> bool:
    return "://" in str(path)


def _exists(path: str) -> bool:
    if _is_url(path):
        import fsspec

        fs, p = fsspec.core.url_to_fs(path)
        return fs.exists(p)
    import os

    return os.path.exists(path)


def _isdir(path: str) -> bool:
    if _is_url(path):
        import fsspec

        fs, p = fsspec.core.url_to_fs(path)
        return fs.isdir(p)
    import os

    return os.path.isdir(path)


def _read_text(path: str) -> str:
    if _is_url(path):
        import fsspec

        with fsspec.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    with open(path, encoding="utf-8") as f:
        return f.read()


def _join(base: str, *parts: str) -> str:
    return "/".join([str(base).rstrip("/"), *parts])


def _parse_records(path: str, text: str, fmt_hint: str) -> list[dict]:
    """JSON array, or JSONL (one object per line); errors name the file and the expected format."""
    stripped = text.lstrip()
    try:
        if stripped.startswith("["):
            rows = json.loads(stripped)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON/JSONL ({e}); expected {fmt_hint}") from e
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: every record must be a JSON object; expected {fmt_hint}")
    return rows


def _check_fields(path: str, rows: list[dict], fields: Iterable[str], fmt_hint: str) -> None:
    for i, row in enumerate(rows):
        missing = [k for k in fields if k not in row]
        if missing:
            raise ValueError(f"{path}: record {i} lacks fields {missing}; expected {fmt_hint}")


_V1_FORMAT = ("LongBench v1 JSONL (data/{dataset}.jsonl from THUDM/LongBench data.zip): one JSON object per "
              "line with fields " + ", ".join(V1_FIELDS))
_V2_FORMAT = ("LongBench v2 data.json (THUDM/LongBench-v2): a JSON array (or JSONL) of objects with fields "
              + ", ".join(V2_FIELDS))


def load_longbench(source: str, dataset: str) -> list[dict]:
    """Load one LongBench v1 subset in its published JSONL format.

    ``source`` is either the ``.jsonl`` file itself or a directory (local or fsspec URL) holding
    ``{dataset}.jsonl`` or ``data/{dataset}.jsonl``. Raises ``FileNotFoundError`` naming the paths
    tried and the expected format; ``ValueError`` for malformed records.
    """
    _check_dataset(dataset)
    src = str(source)
    if src.endswith((".jsonl", ".json")):
        candidates = [src]
    else:
        candidates = [_join(src, f"{dataset}.jsonl"), _join(src, "data", f"{dataset}.jsonl")]
    for path in candidates:
        if _exists(path) and not _isdir(path):
            rows = _parse_records(path, _read_text(path), _V1_FORMAT)
            _check_fields(path, rows, ("input", "context", "answers"), _V1_FORMAT)
            for r in rows:
                if not isinstance(r["answers"], list):
                    raise ValueError(f"{path}: 'answers' must be a list of strings; expected {_V1_FORMAT}")
            return rows
    raise FileNotFoundError(f"LongBench v1 subset {dataset!r} not found: tried {candidates}; expected {_V1_FORMAT}")


# ----------------------------------------------------------------------------- LongBench v2

#: ``prompts/0shot.txt`` of THUDM/LongBench (v2), byte for byte (no trailing newline).
V2_PROMPT_0SHOT = (
    "Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
    "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$\n\n"
    "Format your response as follows: \"The correct answer is (insert answer here)\"."
)

#: Max new tokens of v2 ``pred.py`` without chain-of-thought.
V2_MAX_NEW_TOKENS = 128

#: The paper's v2 subset (App. C.2): these domains, plus the "User guide QA" sub-domain.
V2_PAPER_DOMAINS = ("Single-Document QA", "Multi-Document QA", "Long-dialogue History Understanding")
V2_PAPER_SUB_DOMAINS = ("User guide QA",)


def build_prompt_v2(example: Mapping[str, Any]) -> str:
    """Official 0-shot prompt: placeholders replaced in order ($DOC$, $Q$, $C_A$..$C_D$) by stripped fields."""
    prompt = V2_PROMPT_0SHOT
    for ph, key in (("$DOC$", "context"), ("$Q$", "question"), ("$C_A$", "choice_A"), ("$C_B$", "choice_B"),
                    ("$C_C$", "choice_C"), ("$C_D$", "choice_D")):
        prompt = prompt.replace(ph, str(example[key]).strip())
    return prompt


def chat_prompt(tokenizer, prompt: str, use_template: bool = True) -> str:
    """``prompt`` as one user turn of the tokenizer's chat template (with the generation prompt), or
    unchanged when ``use_template`` is off or the tokenizer has no template (v2 ``pred.py``)."""
    if not use_template or tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def split_at_context(prompt: str, context: str) -> tuple[str, str]:
    """Cut ``prompt`` right after the (last occurrence of the stripped) ``context``: ``(head, question)``.

    The head (instructions + document) is ingested, the question part (question, choices, output
    format, chat-template suffix) is read at answer time; ``head + question == prompt``.
    """
    ctx = str(context).strip()
    at = prompt.rfind(ctx) if ctx else -1
    if at < 0:
        raise ValueError("context not found in the prompt")
    end = at + len(ctx)
    return prompt[:end], prompt[end:]


def parse_choice(response: str) -> str | None:
    """Official v2 parser: "The correct answer is (X)", else "The correct answer is X", else None."""
    return extract_choice(response)


def v2_accuracy(responses: Sequence[str], answers: Sequence[str], *, compensated: bool = False) -> float:
    """Accuracy (0-100) of raw model responses against gold letters (unparsed responses are wrong)."""
    return choice_accuracy([parse_choice(r) for r in responses], answers, compensated=compensated)


def fits_in_budget(prompt_tokens: int, *, position_budget: int, replay_reserve: int, max_new_tokens: int) -> bool:
    """Keep an example iff ``prompt_tokens + replay_reserve + max_new_tokens <= position_budget``."""
    for k, v in (("prompt_tokens", prompt_tokens), ("replay_reserve", replay_reserve),
                 ("max_new_tokens", max_new_tokens), ("position_budget", position_budget)):
        if v < 0:
            raise ValueError(f"{k} must be >= 0, got {v}")
    return prompt_tokens + replay_reserve + max_new_tokens <= position_budget


def filter_fits(
    examples: Iterable[Mapping[str, Any]],
    count_tokens: Callable[[str], int],
    *,
    position_budget: int,
    replay_reserve: int,
    max_new_tokens: int,
    prompt_fn: Callable[[Mapping[str, Any]], str] = build_prompt_v2,
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """Split examples into (kept, dropped) by :func:`fits_in_budget`; prompts are never truncated.

    ``count_tokens`` receives the complete prompt from ``prompt_fn`` and must count it exactly as
    it will be fed (apply the chat template inside it when one is used).
    """
    kept, dropped = [], []
    for ex in examples:
        n = int(count_tokens(prompt_fn(ex)))
        ok = fits_in_budget(n, position_budget=position_budget, replay_reserve=replay_reserve,
                            max_new_tokens=max_new_tokens)
        (kept if ok else dropped).append(ex)
    return kept, dropped


def select_v2(
    examples: Iterable[Mapping[str, Any]],
    domains: Sequence[str] = V2_PAPER_DOMAINS,
    sub_domains: Sequence[str] = V2_PAPER_SUB_DOMAINS,
) -> list[Mapping[str, Any]]:
    """Examples whose ``domain`` is in ``domains`` or whose ``sub_domain`` is in ``sub_domains``."""
    d, s = set(domains), set(sub_domains)
    return [ex for ex in examples if ex.get("domain") in d or ex.get("sub_domain") in s]


def load_longbench_v2(source: str) -> list[dict]:
    """Load LongBench v2 in its published format.

    ``source`` is ``data.json`` (JSON array) / a ``.jsonl`` file, or a directory (local or fsspec
    URL) holding ``data.json``. Raises ``FileNotFoundError`` naming the path and expected format.
    """
    src = str(source)
    path = src if src.endswith((".json", ".jsonl")) else _join(src, "data.json")
    if not _exists(path) or _isdir(path):
        raise FileNotFoundError(f"LongBench v2 data not found: {path}; expected {_V2_FORMAT}")
    rows = _parse_records(path, _read_text(path), _V2_FORMAT)
    _check_fields(path, rows, V2_FIELDS, _V2_FORMAT)
    for i, r in enumerate(rows):
        if r["answer"] not in ("A", "B", "C", "D"):
            raise ValueError(f"{path}: record {i} has answer {r['answer']!r}, expected one of A-D")
    return rows


# ----------------------------------------------------------------------------- benchmarks


def capped(n: int, cap: int | None) -> int:
    """Generation budget: the official ``n``, or ``cap`` when it is smaller."""
    return n if cap is None else min(n, cap)


def v1_category(dataset: str) -> str:
    """The paper's category of a v1 dataset (:data:`CATEGORIES`)."""
    return next(c for c, names in CATEGORIES.items() if dataset in names)


@register
@dataclass
class LongBench(Benchmark):
    """LongBench v1: the paper's 12 English subsets, a fixed seeded subset of each (App. C.2).

    Item: ``{"dataset", "index" (file row), "id", "example" (the published record)}``. The native
    prompt is cut right after the context: the head (instruction + context) is ingested, the rest
    is the question; official middle truncation of the whole prompt to ``max_length`` model tokens
    (None: never), no chat template, official max new tokens (``max_new_tokens_cap``: CI only).
    """

    name = "longbench"

    source: str | None = None           # dir (local or fsspec URL) with {dataset}.jsonl or data/{dataset}.jsonl
    datasets: list[str] = field(default_factory=lambda: list(V1_DATASETS))
    n_examples: int = 30                # per subset, chosen by `seed`, shared by every method (paper: 30)
    max_length: int | None = None       # official middle truncation of the prompt (model tokens); None: never
    seed: int = 0
    max_new_tokens_cap: int | None = None

    def examples(self, tokenizer=None) -> Iterator[dict]:
        for ds in self.datasets:
            rows = load_longbench(self.source, ds)
            for i, ex in select_subset(list(enumerate(rows)), self.n_examples, self.seed):
                yield {"dataset": ds, "index": i, "id": str(ex.get("_id", i)), "example": ex}

    def max_new_tokens(self, item: dict) -> int:
        return capped(max_new_tokens(item["dataset"]), self.max_new_tokens_cap)

    def score(self, item: dict, prediction: str, answers: Sequence) -> float:
        return 100.0 * score_prediction(item["dataset"], prediction, answers, item["example"].get("all_classes"))

    def evaluate(self, model, item: dict, methods: Sequence[str], *, notebank=None,
                 block_size: int = 65536) -> list[dict]:
        ds, ex = item["dataset"], item["example"]
        head, question = split_prompt(ds, ex)
        head, question, cut = truncate_middle(model.tokenizer, head, question, self.max_length)
        stop = ("\n",) if ds == "samsum" else ()          # pred.py: samsum also stops at a newline
        gold = [list(ex["answers"])]
        budget = self.max_new_tokens(item)
        rows = qa_rows(answer_methods(model, head, [question], gold, list(methods), _nb(notebank),
                                      max_new_tokens=budget, stop=stop, block_size=block_size), gold)
        for r in rows:
            r.update(category=v1_category(ds), truncated=cut, parsed=None,
                     score=self.score(item, r["prediction"], ex["answers"]))
            r.update(benchmark=self.name, dataset=ds, id=item["id"], index=item["index"], max_new_tokens=budget)
        return rows


@register
@dataclass
class LongBenchV2(Benchmark):
    """LongBench v2: 0-shot multiple choice, kept only where the whole prompt fits (App. C.2).

    Item: ``{"index", "id", "head", "question", "answer", "domain"}``, the official 0-shot prompt
    (chat template when the tokenizer has one) cut right after the context. Never truncated: an
    example is kept only if its full prompt + replay reserve + generation fits ``position_budget``
    (counted with the backbone's tokenizer, so ``examples`` needs it).
    """

    name = "longbench_v2"

    source: str | None = None           # data.json / .jsonl file or a dir holding data.json
    paper_subset: bool = True           # the paper's domains (single-/multi-doc QA, dialogue history, user guides)
    n_examples: int | None = None       # after the fit filter, chosen by `seed`; None: all that fit
    position_budget: int = 131072       # positions the backbone may use (prompt + replay + generation)
    replay_reserve: int = 0             # replayed tokens reserved (the job: max over methods of top_R x B)
    max_new_tokens: int = V2_MAX_NEW_TOKENS
    chat_template: bool = True          # apply the tokenizer's chat template when it has one
    seed: int = 0
    max_new_tokens_cap: int | None = None

    def candidates(self) -> list[tuple[int, dict]]:
        """[(file index, record)] of the paper subset (domains) when ``paper_subset``, else all."""
        rows = list(enumerate(load_longbench_v2(self.source)))
        return [(i, r) for i, r in rows if select_v2([r])] if self.paper_subset else rows

    def select(self, tokenizer, candidates: list[tuple[int, dict]] | None = None) -> tuple[list[dict], dict]:
        """-> (items that fit, {"candidates", "kept", "dropped", "position_budget", "replay_reserve"})."""
        rows = self.candidates() if candidates is None else candidates
        max_new = capped(self.max_new_tokens, self.max_new_tokens_cap)
        prompts = [chat_prompt(tokenizer, build_prompt_v2(r), self.chat_template) for _, r in rows]
        kept = [(i, r, p) for (i, r), p in zip(rows, prompts)
                if fits_in_budget(len(tokenizer(p)["input_ids"]), position_budget=self.position_budget,
                                  replay_reserve=self.replay_reserve, max_new_tokens=max_new)]
        dropped = len(rows) - len(kept)
        if self.n_examples is not None:
            kept = select_subset(kept, self.n_examples, self.seed)
        items = []
        for i, ex, prompt in kept:
            head, question = split_at_context(prompt, ex["context"])
            items.append({"index": i, "id": str(ex["_id"]), "head": head, "question": question,
                          "answer": ex["answer"], "domain": ex["domain"]})
        return items, {"candidates": len(rows), "kept": len(kept), "dropped": dropped,
                       "position_budget": self.position_budget, "replay_reserve": self.replay_reserve}

    def examples(self, tokenizer=None) -> list[dict]:
        if tokenizer is None:
            raise ValueError("LongBench v2 counts prompt tokens: examples() needs the model's tokenizer")
        return self.select(tokenizer)[0]

    def score(self, item: dict, prediction: str, answers: Sequence) -> float:
        return 100.0 * (parse_choice(prediction) == item["answer"])

    def evaluate(self, model, item: dict, methods: Sequence[str], *, notebank=None,
                 block_size: int = 65536) -> list[dict]:
        gold = [[item["answer"]]]
        budget = capped(self.max_new_tokens, self.max_new_tokens_cap)
        rows = qa_rows(answer_methods(model, item["head"], [item["question"]], gold, list(methods), _nb(notebank),
                                      max_new_tokens=budget, block_size=block_size), gold)
        for r in rows:
            r.update(category=item["domain"], truncated=False, parsed=parse_choice(r["prediction"]))
            r["score"] = self.score(item, r["prediction"], [item["answer"]])
            r.update(benchmark=self.name, dataset=self.name, id=item["id"], index=item["index"],
                     max_new_tokens=budget)
        return rows


def _nb(notebank):
    from nbcore.config import NoteBankConfig
    return notebank or NoteBankConfig()
