"""Ingest on Ray Data: corpus shards -> archive (layout v2, pipeline/archive.py).

    scan   ray.data.from_items(shards).map(scan_corpus_shard)     ids + text hashes only (Ray tasks)
    plan   driver: fixed groups of `docs_per_group` rows per shard; drop committed groups and documents,
           reject bad rows and duplicate ids -- before any model work
    read   .flat_map(read_corpus_groups)                          the planned rows' text (Ray tasks)
    write  .map_batches(IngestActor, batch_size=1, compute=ActorPoolStrategy(size=n), num_gpus=g, ...)
           one memory backend per actor (NoteBank or MoNe, nbcore.memory); the actor writes states, the
           group's notes part (NoteBank only), documents part and commit record straight to the
           store, and returns one small record per row
The driver holds ids, hashes and records, never text, notes or states. Ray Data schedules, retries
(a killed actor is restarted and its group redone, with the same bytes) and applies backpressure.
A killed driver leaves committed groups; the rerun redoes the rest. One writer per output folder
(a lease); paths that escape the folder through symlinks are refused.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Callable

from dataclasses import dataclass, field

from nbcore.config import NoteBankConfig, ReadConfig
from notebank.pipeline.config import (MONE_METHODS, ActorSpec, ConfigError, ModelSpec, RaySpec, require_archive,
                                      require_fields, require_input, require_shards, validate_memory)

log = logging.getLogger(__name__)


@dataclass
class IngestJobConfig:
    """jobs/ingest.py"""

    corpus: str = ""                       # fsspec URL/path: a file, a folder or a glob of .jsonl/.parquet shards
    output: str = ""                       # fsspec URL/path of the archive folder
    model: ModelSpec = field(default_factory=ModelSpec)
    notebank: NoteBankConfig = field(default_factory=NoteBankConfig)
    block_size: int = 8192                 # tokens per forward block (memory does not grow with doc length)
    actors: ActorSpec = field(default_factory=ActorSpec)
    ray: RaySpec = field(default_factory=RaySpec)
    limit: int | None = None               # ingest at most this many corpus rows
    progress: bool = True                 # progress bars (stderr)
    memory: str = "notebank"               # notebank | mone (per-document MoNe fast-weight state)
    mone_adapters: str | None = None       # mone: meta-trained MoNe parameters dir; default <model.path>/mone
    append: bool = False                   # mone: the old name of mode: append (sets it)
    mode: str = "ingest"                   # ingest | append (rows carry an archived doc_id and the text to
                                           # add; the document continues from its stored state, both memories)
    docs_per_group: int = 64               # corpus rows per group: one notes part + one commit per group
    verify: bool = False                   # rerun: also check committed files' sha256 (not only sizes)
    retry_failed: bool = True              # rerun: a corpus row that failed before (bad JSON/UTF-8, a failed
                                           # document) and now reads differently is tried again, its group redone
    state_piece_mib: int = 1024            # states above this are written in pieces of about this size

    def validate(self):
        if not self.corpus:
            raise ConfigError("corpus is required (--set corpus=URL)")
        if not self.output:
            raise ConfigError("output is required (--set output=URL)")
        if self.block_size < 1:
            raise ConfigError("block_size must be >= 1")
        validate_memory(self.memory, self.model, self.mone_adapters)
        if self.mode not in ("ingest", "append"):
            raise ConfigError(f"mode must be ingest or append, got {self.mode!r}")
        if self.memory == "mone" and self.mode == "append":
            self.append = True
        if self.memory == "mone" and self.append:
            self.mode = "append"               # MoNe's old switch: the same plan as NoteBank's mode: append
        if self.append and self.memory != "mone":
            raise ConfigError("append: true is the MoNe switch; for NoteBank archives use mode: append")
        if self.docs_per_group < 1:
            raise ConfigError(f"docs_per_group must be >= 1, got {self.docs_per_group}")
        if self.state_piece_mib < 1:
            raise ConfigError(f"state_piece_mib must be >= 1, got {self.state_piece_mib}")
        if self.limit is not None and self.limit < 0:
            raise ConfigError(f"limit must be >= 0 or null, got {self.limit}")
        self.model.validate()
        self.actors.validate()
        try:
            self.notebank.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from e
        return self

    def preflight(self):
        """Before Ray starts or a model loads: the output folder cannot be escaped (no symlink or '..'
        leaves it, at any depth: pipeline.safety.check_no_escape), the corpus has shards and the
        checkpoint is there."""
        from notebank.pipeline.safety import check_no_escape
        check_no_escape(self.output, list(OUTPUT_WRITES))
        require_shards(self.corpus, "corpus")
        require_fields(self.corpus, "corpus", ("doc_id", "text"))
        self.model.preflight()
        if self.mone_adapters:
            require_input(self.mone_adapters, "mone_adapters", "MoNe parameters folder")


#: what an ingest writes under its output folder (checked by check_no_escape before anything is written)
OUTPUT_WRITES = ("manifest", "notes", "documents", "state", "_lease.json")


def committed_in_store(cfg) -> dict:
    """What the output holds, read from the store itself (the summary of a job the store failed
    under): committed groups and their ok documents."""
    from notebank.pipeline.archive import Archive
    commits, _problems = Archive(cfg.output).load_commits()
    return {"committed_groups": len(commits),
            "committed_docs": sum(e.status == "ok" for rec in commits.values() for e in rec.documents),
            "output": cfg.output}


def sha256_text(text: str) -> str:
    """Hex sha256 of the UTF-8 text: a committed document is skipped when its text is unchanged."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def run_ingest(cfg: IngestJobConfig, on_commit: Callable[[dict], None] | None = None) -> dict:
    """Run one ingest job (Ray must be initialised). Returns the summary dict.

    on_commit(record) is called for each row's small record as it arrives (tests, progress hooks).
    Both memories (`memory: notebank | mone`) go through the same driver and actor
    (pipeline.dataplane.ingest_dataset, pipeline.actors.IngestActor on nbcore.memory's backends)."""
    cfg.validate()
    from notebank.pipeline.dataplane import ingest_dataset
    return ingest_dataset(cfg, on_commit=on_commit)
