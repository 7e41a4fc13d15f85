"""Typed job configs: dataclasses loaded from YAML, with `--set key.sub=value` overrides.

Unknown keys and wrong types are errors (the message names the key path and the accepted keys).
Override values are parsed as YAML scalars/flow collections: `--set read.top_r=4`,
`--set methods=[plain,notebank]`, `--set ray.address=null`.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nbcore.config import NoteBankConfig, ReadConfig


class ConfigError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------
# Job config types
# ---------------------------------------------------------------------------------------------
@dataclass
class ModelSpec:
    """Which frozen backbone every actor loads."""

    path: str | None = None             # checkpoint directory (config.json + weights [+ tokenizer])
    hf_config: dict | None = None       # or: transformers config kwargs incl. model_type (random init)
    tokenizer: str | None = None        # tokenizer directory, "byte" (byte-level, ids = 3 + byte), "project"
                                        # (nbcore.tasks.tokenizer); default: the checkpoint's own
    seed: int = 0                       # random-init seed (hf_config only)
    dtype: str | None = None            # float32 | bfloat16 | float16 | None (checkpoint default)
    device: str = "auto"                # auto (cuda if the actor has a GPU) | cpu | cuda
    adapter: str | None = None          # NB-LoRA read adapter (dir or fsspec URL from jobs/train_lora.py):
                                        # on for replay/question/answer only, off for writing and routing

    def validate(self, where="model"):
        if (self.path is None) == (self.hf_config is None):
            raise ConfigError(f"{where}: set exactly one of model.path or model.hf_config")
        if self.hf_config is not None and "model_type" not in self.hf_config:
            raise ConfigError(f"{where}.hf_config needs a model_type")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"{where}.dtype must be float32, bfloat16, float16 or null, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"{where}.device must be auto, cpu or cuda, got {self.device!r}")

    def preflight(self, where="model"):
        """The checkpoint, tokenizer and adapter exist (before Ray starts or any model loads)."""
        if self.path is not None:
            import os
            if not os.path.isdir(self.path):
                raise ConfigError(f"{where}.path: no checkpoint directory {self.path!r}")
            if not os.path.isfile(os.path.join(self.path, "config.json")):
                raise ConfigError(f"{where}.path: {self.path!r} has no config.json (not a transformers checkpoint)")
        if self.tokenizer not in (None, "byte", "project"):
            import os
            if not os.path.isdir(self.tokenizer) and not os.path.isfile(self.tokenizer):
                raise ConfigError(f"{where}.tokenizer: no tokenizer at {self.tokenizer!r} (a directory, 'byte' or "
                                  f"'project')")
        if self.adapter is not None:
            require_input(self.adapter, f"{where}.adapter", "adapter folder")


@dataclass
class ActorSpec:
    """Actor pool shape and fault tolerance."""

    num_actors: int = 1                  # model-holding actors (one backbone each; one per GPU on a cluster)
    num_cpus: float = 1.0                # CPUs reserved per actor
    num_gpus: float = 0.0                # GPUs per actor (1 on a GPU cluster)
    accelerator_type: str | None = None  # e.g. H100, H200 (Ray accelerator type)
    torch_threads: int = 0               # 0: max(1, int(num_cpus))
    max_restarts: int = 3                # actor restarts after its process dies
    max_task_retries: int = 3            # per-call retries on a restarted actor
    max_in_flight: int = 2               # calls queued per actor (bounded: driver memory stays flat)
    start_timeout_s: float = 900.0       # give up if the actors cannot be placed/loaded within this

    def validate(self, where="actors"):
        if self.num_actors < 1:
            raise ConfigError(f"{where}.num_actors must be >= 1")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ConfigError(f"{where}: num_cpus/num_gpus must be >= 0")
        if self.max_in_flight < 1:
            raise ConfigError(f"{where}.max_in_flight must be >= 1")


def require_input(url: str, key: str, what: str) -> None:
    """`url` (local path or fsspec URL) exists, else a ConfigError naming the key."""
    import fsspec
    try:
        fs, path = fsspec.core.url_to_fs(url)
        ok = bool(fs.glob(path)) if any(c in path for c in "*?[") else fs.exists(path)
    except (ImportError, ValueError) as e:                 # unknown protocol, missing s3fs, ...
        raise ConfigError(f"{key}: cannot open {url!r}: {e}") from e
    if not ok:
        raise ConfigError(f"{key}: {what} {url!r} does not exist")


def require_shards(url: str, key: str) -> None:
    """`url` names at least one .jsonl/.parquet shard (a file, a folder or a glob)."""
    from notebank.pipeline.corpus import list_shards
    try:
        list_shards(url)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{key}: {e}") from e


def require_archive(url: str, key: str = "archive") -> None:
    """`url` is an ingest output folder (it has manifest/_run.json)."""
    require_input(url, key, "archive folder")
    require_input(url.rstrip("/") + "/manifest/_run.json", key, "ingest run record (is it an ingest output?)")


@dataclass
class RaySpec:
    address: str | None = None   # None: $RAY_ADDRESS if set (ray job submit sets it), else a new local Ray
    num_cpus: int | None = None  # only for a new local Ray
    namespace: str | None = None  # Ray namespace (None: anonymous)


@dataclass
class BenchmarkJobConfig:
    """Keys every `benchmark:` job of jobs/evaluate.py has (pipeline/benchmarks.py). A job redeclares
    the defaults of benchmark, output and report_title; these keys come first in its config."""

    benchmark: str = ""                             # picks the job's config in jobs/evaluate.py
    output: str = ""
    report_title: str = ""
    progress: bool = True                 # progress bars (stderr)
    ray: RaySpec = field(default_factory=RaySpec)

    def check_benchmark(self, name: str) -> None:
        """The YAML picked this job (`benchmark: name`) and names an output."""
        if self.benchmark != name:
            raise ConfigError(f"benchmark must be {name!r} for this job, got {self.benchmark!r}")
        if not self.output:
            raise ConfigError("output is required (--set output=PATH)")


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
    state_piece_mib: int = 1024            # states above this are written in pieces of about this size

    def validate(self):
        if not self.corpus:
            raise ConfigError("corpus is required (--set corpus=URL)")
        if not self.output:
            raise ConfigError("output is required (--set output=URL)")
        if self.block_size < 1:
            raise ConfigError("block_size must be >= 1")
        validate_memory(self.memory, self.model)
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
        """Inputs exist: the corpus has shards, the checkpoint is there (no Ray, no model load)."""
        require_shards(self.corpus, "corpus")
        self.model.preflight()
        if self.mone_adapters:
            require_input(self.mone_adapters, "mone_adapters", "MoNe parameters folder")


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
        validate_memory(self.memory, self.model)
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
        """Inputs exist: questions, the archive (or the one-pass corpus) and the checkpoint."""
        require_shards(self.questions, "questions")
        if self.onepass:
            require_shards(self.corpus, "corpus")
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


MEMORIES = ("notebank", "mone")
MONE_METHODS = ("mone",)


def validate_memory(memory: str, model: ModelSpec) -> None:
    """`memory` is notebank or mone; mone needs a checkpoint directory (frozen Qwen2-family base) on CPU."""
    if memory not in MEMORIES:
        raise ConfigError(f"memory must be one of {list(MEMORIES)}, got {memory!r}")
    if memory == "mone":
        if not model.path:
            raise ConfigError("memory: mone needs model.path (a frozen Qwen2-family checkpoint dir, e.g. "
                              "models/tiny-qwen2), not model.hf_config")
        if model.device == "cuda" or model.adapter or model.dtype not in (None, "float32"):
            raise ConfigError("memory: mone runs in float32 on CPU without an NB-LoRA adapter: leave model.device "
                              "auto/cpu, model.dtype null/float32 and model.adapter null")


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
        for m in self.methods:
            ReadConfig(method=m).validate()
        return self


# A tiny all-linear-attention Qwen3.5 text config (random init): runs everywhere in seconds.
TINY_GDN = dict(
    model_type="qwen3_5_text", vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    layer_types=["linear_attention", "linear_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


# ---------------------------------------------------------------------------------------------
# Loader
# ---------------------------------------------------------------------------------------------
def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp, path: str):
    """Check/convert `value` against annotation `tp`; raise ConfigError with the key path."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{path}: {value!r} does not match {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__} {value!r}")
        return build(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected a bool, got {type(value).__name__} {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an int, got {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}: expected a number, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, str) and origin is tuple:
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        item = args[0] if args else Any
        items = [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    raise ConfigError(f"{path}: unsupported config type {_type_name(tp)}")


def build(cls, data: dict, path: str = ""):
    """Build dataclass `cls` from a nested dict; unknown keys and wrong types raise ConfigError."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [k for k in data if k not in names]
    if unknown:
        where = path or cls.__name__
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {names}")
    base = cls()
    kwargs = {}
    for name in names:
        sub = f"{path}.{name}" if path else name
        if name in data:
            cur = getattr(base, name)
            val = data[name]
            if dataclasses.is_dataclass(cur) and isinstance(val, dict):
                # merge into the default (keeps defaults of nested keys not given)
                merged = {**_shallow(cur), **val}
                kwargs[name] = build(type(cur), merged, sub)
            else:
                kwargs[name] = _coerce(val, hints[name], sub)
    try:
        return dataclasses.replace(base, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from e


def _shallow(dc) -> dict:
    return {f.name: getattr(dc, f.name) for f in dataclasses.fields(dc) if f.init}


def _plain(v):
    if dataclasses.is_dataclass(v):
        return to_dict(v)
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def to_dict(dc) -> dict:
    return {f.name: _plain(getattr(dc, f.name)) for f in dataclasses.fields(dc)}


def parse_overrides(overrides: list[str]) -> dict:
    """['a.b=1', 'c=[x,y]'] -> {'a': {'b': 1}, 'c': ['x', 'y']}"""
    out: dict = {}
    for ov in overrides or []:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not key=value")
        key, raw = ov.split("=", 1)
        key = key.strip()
        if not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override {ov!r} has an empty key")
        try:
            val = yaml.safe_load(raw) if raw.strip() != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {ov!r}: value is not valid YAML: {e}") from e
        if isinstance(val, str) and raw.strip() != raw:
            val = raw
        d = out
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = d.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {ov!r} conflicts with an earlier override of {p!r}")
            d = nxt
        d[parts[-1]] = val
    return out


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(cls, path: str | Path | None = None, overrides: list[str] | None = None):
    """YAML file (optional) + overrides -> validated `cls` instance."""
    data: dict = {}
    if path:
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except FileNotFoundError as e:
            raise ConfigError(f"config file {path} not found") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    data = _deep_merge(data, parse_overrides(overrides or []))
    # Optional model.hf_config etc. are plain dicts: overrides into them merge, which _deep_merge did.
    cfg = build(cls, data)
    if hasattr(cfg, "validate"):
        try:
            cfg.validate()
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from e
    return cfg


# ---------------------------------------------------------------------------------------------
# --help: every key with its default and the one-line doc written beside its field
# ---------------------------------------------------------------------------------------------
_FIELD_LINE = re.compile(r"^\s+(\w+)\s*:[^#]*?(?:#\s?(.*))?$")
_COMMENT_LINE = re.compile(r"^\s+#\s?(.*)$")


def field_docs(cls) -> dict[str, str]:
    """{field name: its trailing `# comment`} from the dataclass source (comment lines right under
    a field continue its doc). The comment beside a field is the one place a key is documented."""
    import inspect
    docs: dict[str, str] = {}
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return docs
    names = {f.name for f in dataclasses.fields(cls)}
    last = None
    for line in lines[1:]:
        m = _FIELD_LINE.match(line)
        if m and m.group(1) in names and not line.lstrip().startswith(("def ", "@")):
            last = m.group(1)
            docs[last] = (m.group(2) or "").strip()
            continue
        c = _COMMENT_LINE.match(line)
        if c and last is not None and line.index("#") > 8:      # an indented continuation of the doc
            docs[last] = (docs[last] + " " + c.group(1).strip()).strip()
            continue
        last = None
    return docs


def config_keys(cls, prefix: str = "", default=None) -> list[tuple[str, str, str, str]]:
    """[(dotted key, type, default as YAML, doc)] for every leaf key of dataclass `cls`, nested
    dataclasses flattened (`notebank.chunk_size`)."""
    obj = default if default is not None else cls()
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        val = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(val):
            out += config_keys(type(val), key + ".", val)
            continue
        shown = yaml.safe_dump(_plain(val), default_flow_style=True, width=10_000).strip()
        shown = shown.removesuffix("\n...").removesuffix("...").strip() or "''"
        out.append((key, _type_name(hints.get(f.name, Any)), shown, docs.get(f.name, "")))
    return out


def keys_help(cls) -> str:
    """The `--help` epilog: one line per key, `key = default  (type)  doc`."""
    rows = config_keys(cls)
    width = min(44, max(len(f"{k} = {d}") for k, _, d, _ in rows) + 2)
    lines = [f"config keys of {cls.__name__} (YAML file and/or --set KEY=VALUE; unknown keys are errors):"]
    for key, tp, dflt, doc in rows:
        head = f"{key} = {dflt}"
        pad = " " * max(1, width - len(head))
        lines.append(f"  {head}{pad}[{tp}] {doc}".rstrip())
    return "\n".join(lines)


def add_config_args(parser):
    parser.add_argument("--config", "-c", help="YAML config file")
    parser.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (dotted path), value parsed as YAML; repeatable")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser
