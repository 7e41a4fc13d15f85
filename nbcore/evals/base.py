"""The one interface every benchmark implements, and the registry that finds one by name.

In the spirit of lm-evaluation-harness' ``Task``: a benchmark object yields its examples and
evaluates (and scores) one example; the registry maps a name to the class, so a worker process
rebuilds the same benchmark from ``(name, options)`` and the example item it was sent.

    from nbcore.evals import get_benchmark
    bench = get_benchmark("ruler")(seed=0, max_new_tokens=128)
    for item in bench.examples():                       # JSON-able, carries what a worker needs
        rows = bench.evaluate(backbone, item, ["plain", "nb-tf-top2"], notebank=NoteBankConfig())

Registered names: ``ruler``, ``longbench`` (v1), ``longbench_v2``, ``memoryagentbench``, ``mone``.
A benchmark is a dataclass whose fields are its options (``options()`` -> the constructor's
keyword arguments); ``evaluate`` returns one row (dict) per question and method, every row with
``score`` on 0-100 under the benchmark's official metric (``score``). This module uses only the
standard library; a benchmark's module is imported on its first ``get_benchmark``.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, ClassVar, Iterable, Sequence

__all__ = ["Benchmark", "register", "get_benchmark", "benchmark_names", "build_benchmark"]

# name -> module that registers it (imported on first use: the package import stays light)
_MODULES: dict[str, str] = {
    "ruler": "nbcore.evals.ruler",
    "longbench": "nbcore.evals.longbench",
    "longbench_v2": "nbcore.evals.longbench",
    "memoryagentbench": "nbcore.evals.memoryagentbench",
    "mone": "nbcore.evals.mone",
}
_REGISTRY: dict[str, type] = {}


class Benchmark:
    """A benchmark: the examples it asks, one example's evaluation under many methods, its metric.

    Subclasses are dataclasses (their fields are the options) and set ``name``. ``model_kind`` says
    what ``evaluate`` receives as ``model``: ``"backbone"``, an nbcore Backbone read by the NoteBank
    reader (methods: plain, jrt, clean-start, nb-<router>-top<R>[-reset]); ``"mone"``, the
    ``(MoNeModel, tokenizer)`` pair of ``load_model``. ``tokens_column`` names the row column that
    counts the context tokens read.
    """

    name: ClassVar[str] = ""
    model_kind: ClassVar[str] = "backbone"
    tokens_column: ClassVar[str] = "n_tokens"

    def examples(self, tokenizer=None) -> Iterable[dict]:
        """The examples, in a fixed order: JSON-able items, each one unit of work (one context read
        once, one or more questions) carrying all the data a worker needs (no file access there).
        ``tokenizer``: the model's, for benchmarks whose selection counts tokens (LongBench v2)."""
        raise NotImplementedError

    def score(self, item: dict, prediction: str, answers: Sequence) -> float:
        """Score of one prediction on 0-100 under the benchmark's official metric."""
        raise NotImplementedError

    def evaluate(self, model, item: dict, methods: Sequence[str], *, notebank=None,
                 block_size: int = 65536) -> list[dict]:
        """One example under every method -> rows (one per question and method), each with `score`.
        ``notebank``: the NoteBankConfig the archive is written with (backbone benchmarks)."""
        raise NotImplementedError

    def options(self) -> dict:
        """The constructor's keyword arguments: ``type(self)(**self.options())`` is this benchmark."""
        return dataclasses.asdict(self)


def register(cls: type) -> type:
    """Class decorator: make ``cls`` findable by ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}: a registered benchmark needs a name")
    _REGISTRY[cls.name] = cls
    return cls


def get_benchmark(name: str) -> type:
    """The benchmark class registered under ``name`` (its module is imported on first use)."""
    if name not in _REGISTRY and name in _MODULES:
        importlib.import_module(_MODULES[name])
    if name not in _REGISTRY:
        raise KeyError(f"unknown benchmark {name!r}; registered: {benchmark_names()}")
    return _REGISTRY[name]


def build_benchmark(name: str, options: dict[str, Any] | None = None) -> Benchmark:
    """``get_benchmark(name)(**options)``: how a worker rebuilds the driver's benchmark."""
    return get_benchmark(name)(**(options or {}))


def benchmark_names() -> list[str]:
    return sorted(set(_MODULES) | set(_REGISTRY))
