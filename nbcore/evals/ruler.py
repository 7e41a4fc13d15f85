"""RULER (the paper's six NIAH tasks and more, `nbcore.tasks.ruler`) as a benchmark.

An example item is ``{"task", "length", "index"}``: the worker generates it with the backbone's
tokenizer (identical for identical task, target length, index, seed and tokenizer). One ingest per
example serves every method (`nbcore.evals.methods.answer_methods`). Rows carry the score
(string_match_all, 0-100), the gold-value coverage of the archive and of the replayed notes
(paper Fig. 5a), the reader's counters (context, question, replay and answer tokens, notes, archived
tokens, address bytes per note) and the stage timings.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from nbcore.evals.base import Benchmark, register
from nbcore.evals.methods import answer_methods, coverage


@register
@dataclass
class Ruler(Benchmark):
    name = "ruler"

    tasks: list[str] = field(default_factory=lambda: ["niah_single_1"])
    lengths: list[int] = field(default_factory=lambda: [4096])      # target context lengths (tokens)
    n_examples: int = 1                                             # per (task, length)
    seed: int = 0
    max_new_tokens: int = 128          # RULER NIAH tokens_to_generate; generation stops at EOS anyway

    def examples(self, tokenizer=None) -> Iterator[dict]:
        for task in self.tasks:
            for n in self.lengths:
                for i in range(self.n_examples):
                    yield {"task": task, "length": int(n), "index": i}

    def generate(self, item: dict, tokenizer) -> dict:
        """The example itself: context, question, gold answers."""
        from nbcore.tasks import ruler
        return ruler.generate(item["task"], int(item["length"]), int(item["index"]), tokenizer, seed=self.seed)

    def score(self, item: dict, prediction: str, answers: Sequence) -> float:
        from nbcore.tasks import ruler
        return float(ruler.score(item["task"], prediction, list(answers)))

    def evaluate(self, model, item: dict, methods: Sequence[str], *, notebank=None, block_size: int = 65536,
                 example: dict | None = None) -> list[dict]:
        """-> one row per method. ``example``: an already generated example (else generated here)."""
        from nbcore.config import NoteBankConfig
        bb, tok = model, model.tokenizer
        example = example or self.generate(item, tok)
        answers = list(example["answers"])
        run = answer_methods(bb, example["context"], [example["question"]], [answers], list(methods),
                             notebank or NoteBankConfig(), max_new_tokens=self.max_new_tokens,
                             block_size=block_size)
        res = run.ingest
        notes: dict[int, tuple[list[str], float]] = {}          # per archive: note texts, archived coverage
        rows = []
        for a in run.answers:
            if id(a.archive) not in notes:
                texts = [tok.decode(z.tolist(), skip_special_tokens=True) for z in a.archive.token_ids]
                notes[id(a.archive)] = (texts, coverage(answers, texts))
            texts, archived = notes[id(a.archive)]
            ans = a.answer
            rows.append({
                "task": item["task"], "length": int(item["length"]), "index": int(item["index"]), "method": a.method,
                "score": self.score(item, ans.text, answers),
                "prediction": ans.text, "answers": answers,
                "archived_cov": archived,
                "retrieved_cov": coverage(answers, [texts[i] for i in ans.retrieved]) if ans.retrieved else 0.0,
                "n_tokens": int(res.n_tokens), "n_notes": len(a.archive),
                "archived_tokens": int(a.archive.n_archived_tokens), "replay_len": int(ans.replay_len),
                "address_bytes_per_note": int(2 * a.archive.addresses.shape[1] * a.notebank.addr_dim),
                "question_tokens": int(ans.n_question_tokens), "retrieved": [int(i) for i in ans.retrieved],
                "prefill_s": res.timings["prefill_s"], "write_s": res.timings["write_s"], "ingest_s": run.ingest_s,
                "probe_s": ans.timings["probe_s"], "route_s": ans.timings["route_s"],
                "replay_generate_s": ans.timings["replay_generate_s"], "answer_s": a.answer_s,
                "answer_tokens": len(ans.token_ids),
            })
        return rows
