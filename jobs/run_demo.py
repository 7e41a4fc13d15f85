"""End-to-end demo on embedded defaults: generated needle corpus -> ingest -> batch QA.

    python jobs/run_demo.py                        # local Ray, the shipped tiny GDN, a RULER corpus, ~1 min on 2 CPUs
    python jobs/run_demo.py -c configs/demo.yaml --set n_docs=8
    ray job submit --working-dir . -- python jobs/run_demo.py

Writes corpus.jsonl, questions.jsonl, archive/ (layout v2) and answers/ (a Parquet dataset) under
`workdir` (default: a new temporary folder) and prints one JSON line: {"workdir", "ingest": {...},
"query": {...}}. The default model is the shipped tiny GDN (models/tiny-gdn), which reads RULER's
needle templates at these lengths; `--set task=null --set model.path=...` runs other models.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

if not __package__:   # run as a script from a checkout (or ray job submit): the repo root holds notebank/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from notebank.pipeline.cli import run_job  # noqa: E402


def make_inputs(cfg, workdir: str) -> tuple[str, str]:
    corpus, questions = os.path.join(workdir, "corpus.jsonl"), os.path.join(workdir, "questions.jsonl")
    if cfg.task:
        return _ruler_inputs(cfg, corpus, questions)
    from nbcore.testing import needle_text
    with open(corpus, "w") as fc, open(questions, "w") as fq:
        for d in range(cfg.n_docs):
            text, needles = needle_text(cfg.doc_tokens, n_needles=cfg.questions_per_doc, seed=cfg.seed + d)
            doc_id = f"doc-{d:04d}"
            fc.write(json.dumps({"doc_id": doc_id, "text": text, "source": "demo", "seed": cfg.seed + d}) + "\n")
            for i, (key, value) in enumerate(needles):
                fq.write(json.dumps({"question_id": f"{doc_id}-q{i}", "doc_id": doc_id,
                                     "question": f" What is the special magic number for {key}? Answer:",
                                     "answers": [value]}) + "\n")
    return corpus, questions


def _ruler_inputs(cfg, corpus: str, questions: str) -> tuple[str, str]:
    """RULER examples sized in the model's own tokens: context -> corpus row, question -> query row."""
    from nbcore.backbones.loading import build_tokenizer
    from nbcore.tasks import ruler
    tok = build_tokenizer(cfg.model.tokenizer) if cfg.model.tokenizer else None
    if tok is None:
        if not cfg.model.path:
            raise SystemExit("demo: task mode needs a tokenizer (model.path or model.tokenizer); or set task: null")
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(cfg.model.path)
    with open(corpus, "w") as fc, open(questions, "w") as fq:
        for d in range(cfg.n_docs):
            ex = ruler.generate(cfg.task, cfg.doc_tokens, d, tok, seed=cfg.seed)
            doc_id = f"doc-{d:04d}"
            fc.write(json.dumps({"doc_id": doc_id, "text": ex["context"], "source": f"ruler/{cfg.task}",
                                 "seed": cfg.seed}) + "\n")
            fq.write(json.dumps({"question_id": f"{doc_id}-q0", "doc_id": doc_id, "question": ex["question"],
                                 "answers": list(ex["answers"])}) + "\n")
    return corpus, questions


def run(cfg) -> dict:
    from notebank.pipeline.config import IngestJobConfig, QueryJobConfig
    from notebank.pipeline.ingest import run_ingest
    from notebank.pipeline.query import run_query
    if cfg.model.path and "://" not in cfg.model.path and os.path.isdir(cfg.model.path):
        cfg.model.path = os.path.abspath(cfg.model.path)        # actors may not share our cwd
    workdir = cfg.workdir or tempfile.mkdtemp(prefix="notebank-demo-")
    os.makedirs(workdir, exist_ok=True)
    corpus, questions = make_inputs(cfg, workdir)
    archive, answers = os.path.join(workdir, "archive"), os.path.join(workdir, "answers")
    ing = IngestJobConfig(corpus=corpus, output=archive, model=cfg.model, notebank=cfg.notebank,
                          block_size=cfg.block_size, actors=cfg.actors, ray=cfg.ray, progress=cfg.progress)
    qry = QueryJobConfig(questions=questions, archive=archive, output=answers, model=cfg.model,
                         methods=list(cfg.methods), read=cfg.read, actors=cfg.actors, ray=cfg.ray,
                         progress=cfg.progress)
    s_ing = run_ingest(ing)
    s_ing.pop("failures", None)
    s_qry = run_query(qry)
    return {"workdir": workdir, "ingest": s_ing, "query": s_qry}


def main(argv=None) -> int:
    from notebank.pipeline.config import DemoConfig
    return run_job(DemoConfig, __doc__.splitlines()[0], run, argv, errors=())


if __name__ == "__main__":
    sys.exit(main())
