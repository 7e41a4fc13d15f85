"""MemoryAgentBench (HUST-AI-HYZ/MemoryAgentBench): loaders, query prompts, accuracy, and the
benchmark (:class:`MemoryAgentBench`; ``nbcore.evals.base``).

Reimplemented from the official repository (``utils/eval_data_utils.py``, ``utils/templates.py``,
``utils/eval_other_utils.py``, ``configs/data_conf/*``). The paper (App. C.2) evaluates 11
configurations: FactConsolidation-sh/-mh at 6K, 32K and 262K; EventQA at 64K, 128K and full
length; RULER QA1 and QA2. Accuracy is ``substring_exact_match`` (README: "accuracy" maps to
``substring_exact_match`` for event_qa, ruler_qa1/2, fact_sh/mh).

Published format: the HF dataset ``ai-hyz/MemoryAgentBench`` stores one parquet file per split,
``data/{split}-00000-of-00001.parquet`` (splits ``Accurate_Retrieval``, ``Conflict_Resolution``,
``Test_Time_Learning``, ``Long_Range_Understanding``). Each row is one long ``context`` (string)
with a list of ``questions`` and a parallel list of ``answers`` (each answer a string or a list of
acceptable strings) and a ``metadata`` struct whose ``source`` names the configuration (e.g.
``factconsolidation_sh_6k``, ``eventqa_65536``, ``ruler_qa1_197K``). JSON/JSONL files with the
same columns are accepted too. Paths may be local or fsspec URLs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

from nbcore.evals.base import Benchmark, register
from nbcore.evals.methods import answer_methods, qa_rows
from nbcore.evals.metrics import max_over_ground_truths, parse_output, substring_exact_match

__all__ = [
    "SPLITS",
    "PAPER_SOURCES",
    "QUERY_TEMPLATES",
    "GENERATION_MAX_LENGTH",
    "MABSample",
    "task_family",
    "build_query",
    "generation_max_length",
    "score_answer",
    "accuracy",
    "load_memoryagentbench",
    "split_of",
    "MemoryAgentBench",
]

SPLITS = ("Accurate_Retrieval", "Conflict_Resolution", "Test_Time_Learning", "Long_Range_Understanding")

#: The paper's 11 configurations: ``metadata.source`` -> split (``configs/data_conf``).
PAPER_SOURCES: dict[str, str] = {
    "factconsolidation_sh_6k": "Conflict_Resolution",
    "factconsolidation_sh_32k": "Conflict_Resolution",
    "factconsolidation_sh_262k": "Conflict_Resolution",
    "factconsolidation_mh_6k": "Conflict_Resolution",
    "factconsolidation_mh_32k": "Conflict_Resolution",
    "factconsolidation_mh_262k": "Conflict_Resolution",
    "eventqa_65536": "Accurate_Retrieval",
    "eventqa_131072": "Accurate_Retrieval",
    "eventqa_full": "Accurate_Retrieval",
    "ruler_qa1_197K": "Accurate_Retrieval",
    "ruler_qa2_421K": "Accurate_Retrieval",
}

#: ``long_context_agent`` query templates of ``utils/templates.py`` (``{question}`` placeholder).
QUERY_TEMPLATES: dict[str, str] = {
    "ruler_qa": (
        "Answer the question based on the memorized documents. Only give me the answer and do not output any "
        "other words. \n\nQuestion: {question} \n\n Answer:"
    ),
    "eventqa": (
        "Based on the context you memorized, complete the task below:\n\n{question}\n\n The event that happens next is:"
    ),
    "factconsolidation": (
        "Pretend you are a knowledge management system. Each fact in the knowledge pool is provided with a serial "
        "number at the beginning, and the newer fact has larger serial number. \n You need to solve the conflicts "
        "of facts in the knowledge pool by finding the newest fact with larger serial number. You need to answer a "
        "question based on this rule. You should give a very concise answer without saying other words for the "
        "question **only** from the knowledge pool you have memorized rather than the real facts in real world. "
        "\n\nFor example:\n\n [Knowledge Pool] \n\n Question: Based on the provided Knowledge Pool, what is the "
        "name of the current president of Russia? \nAnswer: Donald Trump \n\n Now Answer the Question: Based on "
        "the provided Knowledge Pool, {question} \nAnswer:"
    ),
}

#: ``generation_max_length`` of the official data configs, by task family.
GENERATION_MAX_LENGTH: dict[str, int] = {"ruler_qa": 50, "eventqa": 40, "factconsolidation": 10}

REQUIRED_COLUMNS = ("context", "questions", "answers")
_FORMAT = (
    "MemoryAgentBench rows (HF ai-hyz/MemoryAgentBench, data/{split}-00000-of-00001.parquet; or JSON/JSONL "
    "with the same columns): 'context' (str), 'questions' (list of str), 'answers' (list, one str or list of "
    "str per question), 'metadata' (struct with 'source')"
)


@dataclass(frozen=True)
class MABSample:
    """One context with its questions; ``answers[i]`` lists the accepted answers of ``questions[i]``."""

    context: str
    questions: list[str]
    answers: list[list[str]]
    source: str = ""
    metadata: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.questions)


def task_family(source: str) -> str:
    """Template family of a ``metadata.source`` name (``utils/templates.py`` mapping rules)."""
    s = source.strip()
    if "ruler_" in s and "qa" in s:
        return "ruler_qa"
    if "eventqa_" in s:
        return "eventqa"
    if "factconsolidation_" in s:
        return "factconsolidation"
    raise KeyError(
        f"unsupported MemoryAgentBench source {source!r}; expected ruler_qa*, eventqa_*, factconsolidation_*"
    )


def build_query(source: str, question: str) -> str:
    """The long-context-agent query prompt for one question."""
    return QUERY_TEMPLATES[task_family(source)].format(question=question)


def generation_max_length(source: str) -> int:
    """Official max new tokens for the configuration's family (ruler_qa 50, eventqa 40, fact 10)."""
    return GENERATION_MAX_LENGTH[task_family(source)]


def score_answer(source: str, output: str, answers: str | Sequence) -> bool:
    """``substring_exact_match`` of one model output, following the official post-processing.

    EventQA scores the parsed output only (``parse_output``); the other families
    (``default_post_process``) take the max of the raw and the parsed output. Both maximise over
    the accepted answers (nested lists flattened).
    """
    fam = task_family(source)
    parsed = parse_output(output)
    if fam == "eventqa":
        return bool(max_over_ground_truths(substring_exact_match, parsed if parsed is not None else "", answers))
    raw = max_over_ground_truths(substring_exact_match, output, answers)
    if parsed is not None:
        raw = max(raw, max_over_ground_truths(substring_exact_match, parsed, answers))
    return bool(raw)


def accuracy(source: str, outputs: Sequence[str], answers: Sequence[str | Sequence]) -> float:
    """Accuracy in percent (0-100) over questions of one configuration."""
    if len(outputs) != len(answers):
        raise ValueError(f"{len(outputs)} outputs vs {len(answers)} answers")
    if not outputs:
        raise ValueError("accuracy needs at least one question")
    return 100.0 * sum(score_answer(source, o, a) for o, a in zip(outputs, answers)) / len(outputs)


# ----------------------------------------------------------------------------- loading


def _as_list(v: Any) -> list:
    """Official ``_ensure_field_is_list``: lists kept, a truthy scalar wrapped, empty -> []."""
    if isinstance(v, list):
        return v
    if isinstance(v, tuple):
        return list(v)
    return [v] if v else []


def _to_sample(path: str, i: int, row: Mapping[str, Any]) -> MABSample:
    missing = [c for c in REQUIRED_COLUMNS if c not in row]
    if missing:
        raise ValueError(f"{path}: row {i} lacks columns {missing}; expected {_FORMAT}")
    if not isinstance(row["context"], str):
        raise ValueError(f"{path}: row {i} 'context' must be a string; expected {_FORMAT}")
    questions = [str(q) for q in _as_list(row["questions"])]
    answers = [[str(a)] if isinstance(a, str) else [str(x) for x in a] for a in _as_list(row["answers"])]
    if len(questions) != len(answers):
        raise ValueError(f"{path}: row {i} has {len(questions)} questions but {len(answers)} answers")
    meta = row.get("metadata") or {}
    if isinstance(meta, str):
        meta = json.loads(meta)
    meta = dict(meta)
    return MABSample(context=row["context"], questions=questions, answers=answers,
                     source=str(meta.get("source", row.get("source", "")) or "").strip(), metadata=meta)


def _fs(path: str):
    import fsspec

    return fsspec.core.url_to_fs(path)


def _read_rows(path: str) -> list[dict]:
    fs, p = _fs(path)
    if path.endswith(".parquet"):
        from notebank.schemas._base import read_parquet_file

        with fs.open(p, "rb") as f:
            return read_parquet_file(f).to_pylist()
    with fs.open(p, "rt", encoding="utf-8") as f:
        text = f.read()
    try:
        if text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON/JSONL ({e}); expected {_FORMAT}") from e
    return rows


def _resolve(source: str, split: str | None) -> list[str]:
    fs, p = _fs(source)
    if not fs.isdir(p):
        if fs.exists(p):
            return [source]
        raise FileNotFoundError(f"MemoryAgentBench file not found: {source}; expected {_FORMAT}")
    if split is None:
        raise ValueError(f"{source} is a directory: pass split= (one of {SPLITS}) to pick data/{{split}}-*.parquet")
    proto = source.split("://", 1)[0] + "://" if "://" in source else ""
    base = p.rstrip("/")
    tried = []
    for pattern in (f"{base}/data/{split}-*.parquet", f"{base}/{split}-*.parquet",
                    f"{base}/{split}.parquet", f"{base}/{split}.jsonl", f"{base}/{split}.json"):
        tried.append(proto + pattern)
        hits = sorted(fs.glob(pattern))
        if hits:
            return [proto + h if proto and not h.startswith(proto) else h for h in hits]
    raise FileNotFoundError(f"MemoryAgentBench split {split!r} not found under {source}: tried {tried}; "
                            f"expected {_FORMAT}")


def load_memoryagentbench(
    source: str,
    *,
    split: str | None = None,
    sources: str | Iterable[str] | None = None,
    max_samples: int | None = None,
) -> list[MABSample]:
    """Load MemoryAgentBench rows as :class:`MABSample` objects.

    ``source``: a parquet/JSON/JSONL file, or a directory (local or fsspec URL) holding the HF
    layout ``data/{split}-*.parquet`` (then ``split`` is required). ``sources`` keeps only rows whose
    ``metadata.source`` matches (the official filter); ``max_samples`` keeps the first rows after
    filtering, as the official ``max_test_samples`` does.
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown MemoryAgentBench split {split!r}; expected one of {SPLITS}")
    keep = None if sources is None else ({sources} if isinstance(sources, str) else set(sources))
    out: list[MABSample] = []
    for path in _resolve(str(source), split):
        for i, row in enumerate(_read_rows(path)):
            s = _to_sample(path, i, row)
            if keep is None or s.source in keep:
                out.append(s)
    if keep is not None and not out:
        raise ValueError(f"no rows with metadata.source in {sorted(keep)} under {source}")
    if max_samples is not None:
        out = out[:max_samples]
    return out


# ----------------------------------------------------------------------------- benchmark


def split_of(config: str) -> str:
    """HF split holding a MemoryAgentBench configuration (``metadata.source``)."""
    if config in PAPER_SOURCES:
        return PAPER_SOURCES[config]
    return "Conflict_Resolution" if task_family(config) == "factconsolidation" else "Accurate_Retrieval"


@register
@dataclass
class MemoryAgentBench(Benchmark):
    """MemoryAgentBench: one context, many questions (ingest once, answer each from a copy).

    Item: ``{"dataset" (configuration), "index", "id", "context", "questions", "answers"}``; each
    question is the official long-context-agent query; rows record the ingest time amortised over
    the context's questions.
    """

    name = "memoryagentbench"

    source: str | None = None           # HF layout dir (data/{split}-*.parquet) or one parquet/JSON(L) file
    configs: list[str] = field(default_factory=lambda: list(PAPER_SOURCES))   # metadata.source names
    max_samples: int | None = None      # contexts per configuration (official max_test_samples); None: all
    max_questions: int | None = None    # questions per context (first ones); None: all
    max_new_tokens_cap: int | None = None

    def examples(self, tokenizer=None) -> Iterator[dict]:
        fs, p = _fs(str(self.source))
        if not fs.exists(p):
            raise FileNotFoundError(f"{self.source} not found; expected the HF layout "
                                    "(data/{split}-00000-of-00001.parquet) or one parquet/JSON/JSONL file")
        is_dir = fs.isdir(p)
        loaded = {c: load_memoryagentbench(self.source, split=split_of(c) if is_dir else None, sources=[c],
                                           max_samples=self.max_samples) for c in self.configs}
        for conf, samples in loaded.items():
            for i, s in enumerate(samples):
                n_q = len(s) if self.max_questions is None else min(len(s), self.max_questions)
                yield {"dataset": conf, "index": i, "id": f"{conf}-{i}", "context": s.context,
                       "questions": s.questions[:n_q], "answers": s.answers[:n_q]}

    def max_new_tokens(self, item: dict) -> int:
        n = generation_max_length(item["dataset"])
        return n if self.max_new_tokens_cap is None else min(n, self.max_new_tokens_cap)

    def score(self, item: dict, prediction: str, answers: Sequence) -> float:
        return 100.0 * score_answer(item["dataset"], prediction, answers)

    def evaluate(self, model, item: dict, methods: Sequence[str], *, notebank=None,
                 block_size: int = 65536) -> list[dict]:
        from nbcore.config import NoteBankConfig
        ds = item["dataset"]
        queries = [build_query(ds, q) for q in item["questions"]]
        budget = self.max_new_tokens(item)
        rows = qa_rows(answer_methods(model, item["context"], queries, item["answers"], list(methods),
                                      notebank or NoteBankConfig(), max_new_tokens=budget,
                                      block_size=block_size), item["answers"])
        for r in rows:
            r.update(category=task_family(ds), truncated=False, parsed=None,
                     score=self.score(item, r["prediction"], r["answers"]))
            r.update(benchmark=self.name, dataset=ds, id=item["id"], index=item["index"], max_new_tokens=budget)
        return rows
