"""Method names of the evaluations and the reader harness every backbone benchmark shares.

Method names (the `summary.json` vocabulary):
  plain, jrt, clean-start                   no replay (clean-start: state x 0 before the question)
  nb-<router>-top<R>[-reset]                NoteBank, router tf (= native, paper Eq. 5), bm25,
                                            dense, oracle, random, meanemb or any registered router;
                                            -reset: lam = 0 before replay (App. C.3)
The router part takes the registry names too (nb-native-top2 = nb-tf-top2, nb-mean_embedding-top2 =
nb-meanemb-top2); an eval method never applies ReadConfig.reset_above_tokens (no suffix: never reset).

`answer_methods` reads a context ONCE and answers every question with every method, each from its
own copy of S_T: writing never changes the backbone state, so Plain/JRT/clean-start read the same
S_T as NoteBank, and the native addressing variants (which change only how notes are written) are
fed from the same feature stream (`ingest(also=...)`).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Sequence

from nbcore.config import ROUTER_ALIASES, NoteBankConfig, ReadConfig  # noqa: F401  (ROUTER_ALIASES: re-exported)

_NB = re.compile(r"^nb-(?P<router>[a-z0-9_]+)-top(?P<r>\d+)(?P<reset>-reset)?$")

# Native addressing variants beyond the paper: name -> (writer overrides, router). `tf` is the paper.
VARIANTS: dict[str, tuple[dict, str]] = {
    "tf": ({}, "native"),
    "margin": ({}, "native_margin"),
    "sum": ({}, "native_sum"),
    "m4": ({"addr_positions": 4}, "native"),
    "m4margin": ({"addr_positions": 4}, "native_margin"),
    "m4sum": ({"addr_positions": 4}, "native_sum"),
    "qnovel": ({"addr_select": "key_qnovel"}, "native"),
    "qnovelmargin": ({"addr_select": "key_qnovel"}, "native_margin"),
    "m4qnovelmargin": ({"addr_positions": 4, "addr_select": "key_qnovel"}, "native_margin"),
}


def writer_overrides(name: str) -> dict:
    """NoteBankConfig fields a method needs beyond the backbone's config (the addressing variants)."""
    m = _NB.match(name)
    if m and m["router"] in VARIANTS:
        return dict(VARIANTS[m["router"]][0])
    return {}


def method_config(name: str, max_new_tokens: int = 32, stop: tuple[str, ...] = ()) -> ReadConfig:
    """Parse a method name into a ReadConfig (see module docstring)."""
    base = dict(max_new_tokens=max_new_tokens, stop=tuple(stop))
    if name == "plain":
        return ReadConfig(method="plain", **base).validate()
    if name == "jrt":
        return ReadConfig(method="jrt", **base).validate()
    if name in ("clean-start", "clean_start"):
        return ReadConfig(method="clean_start", lam=0.0, **base).validate()
    m = _NB.match(name)
    if not m:
        raise ValueError(f"unknown method {name!r}: use plain, jrt, clean-start or nb-<router>-top<R>[-reset]")
    router = VARIANTS[m["router"]][1] if m["router"] in VARIANTS else ROUTER_ALIASES.get(m["router"], m["router"])
    return ReadConfig(method="notebank", top_r=int(m["r"]), router=router,
                      lam=0.0 if m["reset"] else None, reset_above_tokens=None, **base).validate()


def replay_reserve(methods: Sequence[str], nb: NoteBankConfig) -> int:
    """Most replayed tokens any method may add: max over NoteBank methods of top_R x note_budget."""
    return max([method_config(m).top_r * nb.note_budget for m in methods
                if method_config(m).method == "notebank"] or [0])


def coverage(values, texts) -> float:
    """Fraction of gold values found (case-insensitive substring) in any of the texts."""
    if not values:
        return 0.0
    low = [t.lower() for t in texts]
    return sum(any(v.lower() in t for t in low) for v in values) / len(values)


@dataclass
class MethodAnswer:
    """One method's answer to one question: the reader's Answer and the archive it routed over."""

    question_index: int
    method: str
    answer: object                 # nbcore.reader.Answer
    archive: object                # nbcore.notebank.archive.Archive (of this method's writer config)
    notebank: NoteBankConfig       # the writer config of that archive
    answer_s: float


@dataclass
class MethodAnswers:
    """`answer_methods`' result: the one ingest and every (question, method) answer, in question
    order, then the order of `methods`."""

    ingest: object                 # nbcore.reader.IngestResult of the single pass
    ingest_s: float
    n_questions: int
    answers: list[MethodAnswer] = field(default_factory=list)


def answer_methods(bb, context: str, questions: Sequence[str], answers: Sequence[Sequence[str]],
                   methods: Sequence[str], notebank: NoteBankConfig, *, max_new_tokens: int,
                   stop: tuple[str, ...] = (), block_size: int = 65536) -> MethodAnswers:
    """Ingest `context` once (one pass for every writer config the methods need) and answer each
    question with each method from a copy of S_T. `answers[i]` are the gold answers of question i
    (the oracle router reads them; nothing else does)."""
    from nbcore.reader import answer, ingest

    groups: dict[str, list[str]] = {}
    for name in methods:
        groups.setdefault(json.dumps(writer_overrides(name), sort_keys=True), []).append(name)
    keys = list(groups)
    cfgs = [NoteBankConfig(**{**notebank.to_dict(), **json.loads(k)}).validate() for k in keys]
    t0 = time.perf_counter()
    res = ingest(bb, context, cfgs[0], block_size=block_size, also=cfgs[1:])
    ingest_s = time.perf_counter() - t0
    archive_of = {}
    for key, cfg, archive in zip(keys, cfgs, [res.archive, *res.also_archives]):
        for name in groups[key]:
            archive_of[name] = (archive, cfg)
    out = MethodAnswers(ingest=res, ingest_s=ingest_s, n_questions=len(questions))
    for qi, (q, gold) in enumerate(zip(questions, answers)):
        for name in methods:
            archive, cfg = archive_of[name]
            rc = method_config(name, max_new_tokens, stop)
            t1 = time.perf_counter()
            ans = answer(bb, res.state, archive, q, rc, answers=list(gold), context_ids=res.token_ids)
            out.answers.append(MethodAnswer(qi, name, ans, archive, cfg, time.perf_counter() - t1))
    return out


def qa_rows(run: MethodAnswers, answers: Sequence[Sequence[str]]) -> list[dict]:
    """The question-answering rows of LongBench / LongBench v2 / MemoryAgentBench (unscored):
    prediction, gold, the ingest time and its share per question, the answer time and counters."""
    res = run.ingest
    return [dict(question_index=a.question_index, method=a.method, prediction=a.answer.text,
                 answers=list(answers[a.question_index]), ingest_s=run.ingest_s,
                 ingest_amortised_s=run.ingest_s / run.n_questions, n_questions=run.n_questions,
                 answer_s=a.answer_s, n_tokens=int(res.n_tokens), question_tokens=int(a.answer.n_question_tokens),
                 n_notes=len(a.archive), replay_len=int(a.answer.replay_len))
            for a in run.answers]
