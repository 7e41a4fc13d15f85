"""Batch QA over an ingest output: questions grouped by document, each group answered by one
memory-holding actor (pipeline.actors.QueryActor, NoteBank or MoNe) that loads the document's memory
once, every configured method per question. Output: answers dataset (schemas.answers)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from nbcore.config import NoteBankConfig, ReadConfig
from notebank.pipeline.config import (MONE_METHODS, ActorSpec, ConfigError, ModelSpec, RaySpec, require_archive,
                                      require_fields, require_input, require_shards, validate_memory)

@dataclass
class QueryJobConfig:
    """jobs/query.py"""

    questions: str = ""                   # fsspec URL/path of question shards (.jsonl/.parquet)
    archive: str = ""                     # an ingest output folder (or, for one-pass mode, leave empty and set corpus)
    corpus: str = ""                      # one-pass mode: corpus shards; each document is ingested and answered
                                          # in the same actor, and its state is never persisted (hybrids at long T)
    output: str = ""                      # answers folder: a Parquet dataset of part-*.parquet files
    notebank: NoteBankConfig = field(default_factory=NoteBankConfig)   # one-pass mode: the writer config
    block_size: int = 8192                # one-pass mode: tokens per forward block
    model: ModelSpec = field(default_factory=ModelSpec)
    methods: list[str] = field(default_factory=lambda: ["plain", "notebank", "clean_start"])  # ReadConfig methods
    read: ReadConfig = field(default_factory=ReadConfig)   # shared settings; `method` is set per method
    actors: ActorSpec = field(default_factory=ActorSpec)
    ray: RaySpec = field(default_factory=RaySpec)
    progress: bool = True                 # progress bars (stderr)
    memory: str = "notebank"              # notebank | mone (answer from per-document MoNe state)
    mone_adapters: str | None = None      # mone: meta-trained MoNe parameters dir; default <model.path>/mone
    retry_failed: bool = True             # rerun: answer failed (question_id, method) pairs again (their failed
                                          # rows are replaced: one row per pair); false: keep them as they are

    @property
    def onepass(self) -> bool:
        return bool(self.corpus)

    def validate(self):
        for name in ("questions", "output"):
            if not getattr(self, name):
                raise ConfigError(f"{name} is required (--set {name}=URL)")
        if bool(self.archive) == bool(self.corpus):
            raise ConfigError("set exactly one of archive (answer from an ingest output) or corpus (one-pass mode: "
                              "ingest and answer in the same actor, nothing persisted)")
        if self.block_size < 1:
            raise ConfigError("block_size must be >= 1")
        validate_memory(self.memory, self.model, self.mone_adapters)
        if self.memory == "mone":
            return self._validate_mone()
        if not self.methods:
            raise ConfigError("methods must not be empty")
        try:
            self.notebank.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if "jrt" in self.methods and not self.onepass:
            raise ConfigError("method jrt re-reads the context, which an archive does not keep: use the one-pass "
                              "mode (set corpus instead of archive) for jrt")
        self.model.validate()
        self.actors.validate()
        for cfg in self.read_configs():
            try:
                cfg.validate()
            except ValueError as e:
                raise ConfigError(str(e)) from e
        return self

    def preflight(self):
        """Before Ray starts or a model loads: the output cannot be escaped (pipeline.safety.
        check_no_escape) and is not inside any ingest output (check_query_output); the questions,
        the archive (or the one-pass corpus) and the checkpoint exist."""
        from notebank.pipeline.safety import check_no_escape, check_query_output
        check_no_escape(self.output, ["_lease.json"])
        check_query_output(self.output, self.archive or None)
        require_shards(self.questions, "questions")
        require_fields(self.questions, "questions", ("question_id", "doc_id", "question"))
        if self.onepass:
            require_shards(self.corpus, "corpus")
            require_fields(self.corpus, "corpus", ("doc_id", "text"))
        else:
            require_archive(self.archive)
        self.model.preflight()
        if self.mone_adapters:
            require_input(self.mone_adapters, "mone_adapters", "MoNe parameters folder")

    def read_configs(self) -> list[ReadConfig]:
        return [dataclasses.replace(self.read, method=m) for m in self.methods]

    def _validate_mone(self):
        """memory: mone answers with method `mone` only (the notebank default list becomes [mone]);
        of `read`, max_new_tokens, stop and stop_at_eos apply."""
        if self.methods == QueryJobConfig().methods:
            self.methods = list(MONE_METHODS)
        bad = [m for m in self.methods if m not in MONE_METHODS]
        if not self.methods or bad:
            raise ConfigError(f"methods: memory: mone answers with {list(MONE_METHODS)} only, got {self.methods}")
        if not isinstance(self.read.max_new_tokens, int) or self.read.max_new_tokens < 0:
            raise ConfigError(f"read.max_new_tokens must be >= 0, got {self.read.max_new_tokens!r}")
        self.model.validate()
        self.actors.validate()
        return self


def committed_in_store(cfg) -> dict:
    """What the answers folder holds, read from the store (the summary of a job the store failed
    under): answers parts and their rows, ok or failed."""
    import fsspec
    from notebank.schemas._base import open_parquet_file
    fs, root = fsspec.core.url_to_fs(cfg.output)
    parts = [p for p in (fs.ls(root, detail=False) if fs.exists(root) else [])
             if p.rsplit("/", 1)[-1].startswith("part-") and p.endswith(".parquet")]
    rows = 0
    for p in parts:
        with fs.open(p, "rb") as f:
            rows += open_parquet_file(f).metadata.num_rows
    return {"committed_parts": len(parts), "committed_rows": rows, "output": cfg.output}


def score_fn():
    """-> (fn(prediction, references) -> 0..100, metric name). RULER's string_match_all from
    nbcore.tasks.ruler when that module exists, else the same rule implemented here."""
    try:
        from nbcore.tasks import ruler
    except ImportError:
        return substring_score, "substring_match_all"
    if hasattr(ruler, "string_match_all"):
        return (lambda p, refs: float(ruler.string_match_all([p or ""], [list(refs)]))), "nbcore.tasks.ruler.string_match_all"
    return (lambda p, refs: float(ruler.score("niah_single_1", p or "", refs))), "nbcore.tasks.ruler.score"


def substring_score(prediction: str, references: list[str]) -> float:
    """Mean over references of case-insensitive substring presence, x100 (RULER string_match_all)."""
    if not references:
        return 0.0
    p = (prediction or "").lower()
    return round(100.0 * sum(r.lower() in p for r in references) / len(references), 2)


def run_query(cfg: QueryJobConfig) -> dict:
    """Questions -> answers dataset (pipeline.dataplane.query_dataset, on Ray Data), for both memories
    (`memory: notebank | mone`); a query with the other memory than the archive holds is refused."""
    cfg.validate()
    from notebank.pipeline.dataplane import query_dataset
    return query_dataset(cfg)


def answer_rows_table(rows: list[dict]):
    for r in rows:
        r.pop("trace", None)
    rows.sort(key=lambda r: (r["doc_id"], r["question_id"], r["method"]))
    from notebank.schemas.answers import answers_table
    return answers_table(rows)


def write_rejected(out, rejected: list[dict], methods: list[str], provenance: dict,
                   retried: set | frozenset = frozenset()) -> list[dict]:
    """Failed rows for questions that were not answered (bad rows, duplicates, unknown documents),
    written by the driver as one answers part. `retried`: the (question_id, method) pairs that had
    failed in an earlier run. -> the rows."""
    import hashlib
    import json as _json
    rows = []
    for r in rejected:
        for m in (r.get("methods") or ["-"]):
            rows.append({"question_id": str(r["question_id"]), "doc_id": str(r.get("doc_id") or ""), "method": m,
                         "read_config": "{}", "status": "failed", "error": r["error"],
                         "source_shard": r.get("source_shard"), "source_row": r.get("source_row"), **provenance,
                         "retried": (str(r["question_id"]), m) in retried})
    key = hashlib.sha1(_json.dumps(sorted((r["question_id"], r["method"], r["source_row"] or 0) for r in rows)).encode()).hexdigest()[:16]
    from notebank.schemas._base import table_to_parquet_bytes
    out.atomic_write(f"part-rejected-{key}.parquet", table_to_parquet_bytes(answer_rows_table(rows)))
    return rows
