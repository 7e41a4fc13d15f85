"""The demo's runner (jobs/run_demo.py): a generated corpus -> ingest -> batch QA on embedded defaults."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field

from nbcore.config import NoteBankConfig, ReadConfig
from notebank.pipeline.config import ActorSpec, ConfigError, ModelSpec, RaySpec


@dataclass
class DemoConfig:
    """jobs/run_demo.py: generated corpus -> ingest -> batch QA, all on embedded defaults."""

    workdir: str | None = None            # default: a fresh temporary folder
    n_docs: int = 4                        # generated documents
    doc_tokens: int = 8192                 # document length: RULER tokens of the model (task set), else characters
    questions_per_doc: int = 2             # needle-text mode only (a RULER example has its own question)
    seed: int = 0                          # corpus generation seed
    task: str | None = "niah_single_1"     # RULER task generating the corpus (needs the model's tokenizer);
                                           # null: planted-needle noise text (any tokenizer, e.g. byte)
    model: ModelSpec = field(default_factory=lambda: ModelSpec(path="models/tiny-gdn", device="cpu"))
    block_size: int = 8192                 # tokens per forward block
    notebank: NoteBankConfig = field(default_factory=NoteBankConfig)
    methods: list[str] = field(default_factory=lambda: ["plain", "notebank", "clean_start"])  # ReadConfig methods
    read: ReadConfig = field(default_factory=lambda: ReadConfig(max_new_tokens=12, top_r=2))
    actors: ActorSpec = field(default_factory=ActorSpec)
    ray: RaySpec = field(default_factory=RaySpec)
    progress: bool = True                 # progress bars (stderr)

    def validate(self):
        if self.n_docs < 1 or self.doc_tokens < 1 or self.questions_per_doc < 1:
            raise ConfigError("n_docs, doc_tokens and questions_per_doc must be >= 1")
        self.model.validate()
        self.actors.validate()
        self.notebank.validate()
        import dataclasses
        for m in self.methods:
            try:
                dataclasses.replace(self.read, method=m).validate()
            except ValueError as e:
                raise ConfigError(str(e)) from e
        return self

    def preflight(self):
        """The checkpoint exists (before Ray starts, the corpus is generated or a model loads)."""
        self.model.preflight()


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
    from notebank.pipeline.ingest import IngestJobConfig, run_ingest
    from notebank.pipeline.query import QueryJobConfig, run_query
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
