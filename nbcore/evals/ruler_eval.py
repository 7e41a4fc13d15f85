"""RULER evaluation of one example under many methods (pure torch; the Ray sweep calls this).

One ingest per (backbone, budget, example) serves every method: writing never changes the
backbone state, so Plain/JRT/clean-start read the same S_T as NoteBank, each from its own copy.

Method names (the `summary.json` vocabulary):
  plain, jrt, clean-start                   no replay (clean-start: state x 0 before the question)
  nb-<router>-top<R>[-reset]                NoteBank, router tf (= native, paper Eq. 5), bm25,
                                            dense, oracle, random, meanemb or any registered router;
                                            -reset: lam = 0 before replay (App. C.3)
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from nbcore.config import NoteBankConfig, ReadConfig

ROUTER_ALIASES = {"tf": "native", "meanemb": "mean_embedding"}
_NB = re.compile(r"^nb-(?P<router>[a-z0-9_]+)-top(?P<r>\d+)(?P<reset>-reset)?$")

# Native addressing variants (issue 9): name -> (writer overrides, router). `tf` is the paper.
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
    """NoteBankConfig fields a method needs beyond the backbone's config (issue 9 variants)."""
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
    if name == "clean-start":
        return ReadConfig(method="clean_start", lam=0.0, **base).validate()
    m = _NB.match(name)
    if not m:
        raise ValueError(f"unknown method {name!r}: use plain, jrt, clean-start or nb-<router>-top<R>[-reset]")
    router = VARIANTS[m["router"]][1] if m["router"] in VARIANTS else ROUTER_ALIASES.get(m["router"], m["router"])
    return ReadConfig(method="notebank", top_r=int(m["r"]), router=router,
                      lam=0.0 if m["reset"] else None, **base).validate()


def coverage(values, texts) -> float:
    """Fraction of gold values found (case-insensitive substring) in any of the texts."""
    if not values:
        return 0.0
    low = [t.lower() for t in texts]
    return sum(any(v.lower() in t for t in low) for v in values) / len(values)


@dataclass
class EvalSpec:
    task: str
    length: int
    index: int
    seed: int = 0
    max_new_tokens: int = 32


def evaluate_example(bb, spec: EvalSpec, methods: list[str], nb_cfg: NoteBankConfig,
                     block_size: int = 65536, example: dict | None = None) -> list[dict]:
    """-> one row per method: score, coverage (paper Fig. 5a), cost counters and stage timings."""
    from nbcore.reader import answer, ingest
    from nbcore.tasks import ruler

    if example is None:
        example = ruler.generate(spec.task, spec.length, spec.index, bb.tokenizer, seed=spec.seed)
    answers = list(example["answers"])
    tok = bb.tokenizer
    # One ingest pass serves every method: the variants' writers (issue 9) only change how notes
    # are written, so they are fed from the same feature stream (ingest(also=...)).
    groups: dict[str, list[str]] = {}
    for name in methods:
        groups.setdefault(json.dumps(writer_overrides(name), sort_keys=True), []).append(name)
    keys = list(groups)
    cfgs = [NoteBankConfig(**{**nb_cfg.to_dict(), **json.loads(k)}).validate() for k in keys]
    t0 = time.perf_counter()
    res = ingest(bb, example["context"], cfgs[0], block_size=block_size, also=cfgs[1:])
    ingest_s = time.perf_counter() - t0
    archives = [res.archive, *res.also_archives]
    rows = []
    for key, cfg, archive in zip(keys, cfgs, archives):
        names = groups[key]
        note_texts = [tok.decode(z.tolist(), skip_special_tokens=True) for z in archive.token_ids]
        archived = coverage(answers, note_texts)
        for name in names:
            rc = method_config(name, spec.max_new_tokens)
            t1 = time.perf_counter()
            ans = answer(bb, res.state, archive, example["question"], rc, answers=answers,
                         context_ids=res.token_ids)
            wall = time.perf_counter() - t1
            rows.append({
                "task": spec.task, "length": spec.length, "index": spec.index, "method": name,
                "score": float(ruler.score(spec.task, ans.text, answers)),
                "prediction": ans.text, "answers": answers,
                "archived_cov": archived,
                "retrieved_cov": coverage(answers, [note_texts[i] for i in ans.retrieved]) if ans.retrieved else 0.0,
                "n_tokens": int(res.n_tokens), "n_notes": len(archive),
                "archived_tokens": int(archive.n_archived_tokens), "replay_len": int(ans.replay_len),
                "address_bytes_per_note": int(2 * archive.addresses.shape[1] * cfg.addr_dim),
                "question_tokens": int(ans.n_question_tokens), "retrieved": [int(i) for i in ans.retrieved],
                "prefill_s": res.timings["prefill_s"], "write_s": res.timings["write_s"], "ingest_s": ingest_s,
                "probe_s": ans.timings["probe_s"], "route_s": ans.timings["route_s"],
                "replay_generate_s": ans.timings["replay_generate_s"], "answer_s": wall,
            })
    order = {n: i for i, n in enumerate(methods)}
    return sorted(rows, key=lambda r: order[r["method"]])
