"""MoNe vs ICL vs RAG on RULER (paper Tables 1-2) as a benchmark: the same frozen base, RULER
S-NIAH / MK-NIAH / FWE at several context lengths, write/query cost per example.

Item: ``{"task", "length", "index"}`` (generated on the worker from the key ``split``). The model is
the ``(MoNeModel, tokenizer)`` pair of :meth:`MoNe.load_model`; every method runs through
:func:`nbcore.mone.evaluation.evaluate_example` (one row per method, one per K for rag).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from nbcore.evals.base import Benchmark, register

TASKS = ("niah_single_1", "niah_multikey_1", "fwe")


@register
@dataclass
class MoNe(Benchmark):
    name = "mone"
    model_kind = "mone"
    tokens_column = "context_tokens"

    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    lengths: list[int] = field(default_factory=lambda: [1024, 8192])
    n_examples: int = 10
    seed: int = 0
    split: str = "test"                    # RULER key split (meta-training used train)
    rag_top_k: list[int] = field(default_factory=lambda: [1, 4, 8])
    rag_chunk: int = 128                   # tokens per RAG chunk (paper: 128)
    rag_encoder: str = "dense"             # dense (offline MiniLM) | bm25
    max_new_tokens: int = 0                # 0: reference answer length + 2 tokens
    measure_cost: bool = True              # FLOPs + peak tensor memory of every example
    icl_window: int = 0                    # icl prompt limit in tokens (0: the base's max_position_embeddings)

    def examples(self, tokenizer=None) -> Iterator[dict]:
        for t in self.tasks:
            for n in self.lengths:
                for i in range(self.n_examples):
                    yield {"task": t, "length": int(n), "index": i}

    def score(self, item: dict, prediction: str, answers: Sequence) -> float:
        from nbcore.tasks import ruler
        return float(ruler.score(item["task"], prediction, list(answers)))

    def evaluate(self, model, item: dict, methods: Sequence[str], *, notebank=None,
                 block_size: int = 65536) -> list[dict]:
        from nbcore.mone.evaluation import ExampleSpec, evaluate_example
        mone, tok = model
        if "mone" in methods and not getattr(mone, "has_adapters", True):
            raise FileNotFoundError(f"{mone.adapters_dir}: no meta-trained MoNe parameters (mone_config.json); "
                                    f"run jobs/train_mone.py or set adapters:")
        return evaluate_example(mone, tok, ExampleSpec(item["task"], int(item["length"]), int(item["index"]),
                                                       self.seed, self.split),
                                methods=list(methods), rag_top_k=list(self.rag_top_k), rag_chunk=self.rag_chunk,
                                rag_encoder=self.rag_encoder, max_new_tokens=self.max_new_tokens,
                                measure_cost=self.measure_cost, icl_window=self.icl_window)

    @staticmethod
    def load_model(spec: dict):
        """``{"path": base model dir, "adapters": meta-trained MoNe dir}`` -> (MoNeModel, tokenizer).
        Without MoNe parameters the frozen base still serves icl and rag (``has_adapters`` False)."""
        from nbcore.mone.model import MoNeModel
        from nbcore.tasks.tokenizer import load_tokenizer
        base, adapters = spec["path"], spec["adapters"]
        found = bool(adapters) and os.path.isfile(os.path.join(adapters, "mone_config.json"))
        model = MoNeModel.from_pretrained(base, adapters if found else None).eval()
        model.has_adapters, model.adapters_dir = found, adapters
        return model, load_tokenizer(base)
