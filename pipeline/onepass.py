"""One-pass mode for evaluation sweeps: ingest and answer in one job, nothing persisted.

    rows = run_onepass(examples, backbone_spec, nb_cfg, read_cfgs)

examples:      iterable of {"doc_id", "text", "questions": [{"question_id", "question", "answers"?}]}
backbone_spec: a ModelSpec, a dict of its fields, or a checkpoint path
nb_cfg:        a NoteBankConfig or a list of them (each context is re-ingested per config)
read_cfgs:     ReadConfigs; every question is answered with each, from copies of the same state
Returns a list of answer rows (schemas.answers columns + notebank, n_tokens, n_notes, ingest_s),
ordered by (doc_id, question_id, notebank, method); scored when answers are given.
"""
from __future__ import annotations

import json

from nbcore.config import NoteBankConfig, ReadConfig
from notebank.pipeline.config import ActorSpec, ModelSpec, build
from notebank.pipeline.pool import dispatch, start_workers, stop_workers
from notebank.pipeline.query import fail_row, rc_dict, score_fn


def _model(spec) -> ModelSpec:
    if isinstance(spec, ModelSpec):
        m = spec
    elif isinstance(spec, dict):
        m = build(ModelSpec, spec, "model")
    elif isinstance(spec, str):
        m = ModelSpec(path=spec)
    else:
        raise TypeError(f"backbone_spec: expected ModelSpec, dict or path, got {type(spec).__name__}")
    m.validate()
    return m


def run_onepass(examples, backbone_spec, nb_cfg, read_cfgs, *, actors: ActorSpec | None = None,
                block_size: int = 8192, workers: tuple | None = None, on_rows=None) -> list[dict]:
    nb_list = list(nb_cfg) if isinstance(nb_cfg, (list, tuple)) else [nb_cfg or NoteBankConfig()]
    nb_dicts = [n.validate().to_dict() for n in nb_list]
    rc_dicts = [rc_dict(rc.validate()) for rc in (read_cfgs or [ReadConfig()])]
    actors = actors or ActorSpec()
    own = workers is None
    handles, _ = workers if workers is not None else start_workers(_model(backbone_spec), actors)
    rows: list[dict] = []

    def items():
        for ex in examples:
            yield {"doc_id": str(ex["doc_id"]), "text": ex["text"],
                   "questions": [{"question_id": str(q["question_id"]), "question": q["question"],
                                  "answers": _answers(q.get("answers"))} for q in ex["questions"]]}

    def on_done(ex, res, err):
        if err is not None:
            res = [{**fail_row({**q, "doc_id": ex["doc_id"]}, rc, f"worker failed: {type(err).__name__}: {err}"),
                    "notebank": json.dumps(nb, sort_keys=True)}
                   for nb in nb_dicts for q in ex["questions"] for rc in rc_dicts]
        rows.extend(res)
        if on_rows:
            on_rows(res)

    try:
        dispatch(handles, items(), lambda a, ex: a.onepass.remote(ex, nb_dicts, rc_dicts, block_size), on_done,
                 max_in_flight=actors.max_in_flight)
    finally:
        if own:
            stop_workers(handles)
    fn, _ = score_fn()
    for r in rows:
        r.pop("trace", None)
        if r.get("status") == "ok" and r.get("answers"):
            r["score"] = float(fn(r["answer"], r["answers"]))
    rows.sort(key=lambda r: (r["doc_id"], r["question_id"], r.get("notebank", ""), r["method"]))
    return rows


def _answers(a):
    if a is None:
        return None
    return [a] if isinstance(a, str) else list(a)
