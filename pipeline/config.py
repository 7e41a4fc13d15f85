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

from nbcore.config import PAPER_READ, NoteBankConfig, ReadConfig


class ConfigError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------
# Job config types
# ---------------------------------------------------------------------------------------------
@dataclass
class ModelSpec:
    """Which frozen backbone every actor loads."""

    path: str | None = None             # checkpoint directory (config.json + weights [+ tokenizer]), a .gguf
                                        # file, or pkg:<package>/<file> (a file inside an installed package)
    gguf_file: str | None = None        # GGUF file inside the path directory (path: a directory)
    cache_dir: str | None = None        # where GGUF checkpoints are dequantised to (once, keyed by sha256);
                                        # None: $NB_MODEL_CACHE, else ~/.cache/notebank/gguf
    hf_config: dict | None = None       # or: transformers config kwargs incl. model_type (random init)
    tokenizer: str | None = None        # tokenizer directory, "byte" (byte-level, ids = 3 + byte), "project"
                                        # (nbcore.tasks.tokenizer); default: the checkpoint's own
    seed: int = 0                       # random-init seed (hf_config only)
    dtype: str | None = None            # float32 | bfloat16 | float16 | None (checkpoint default)
    device: str = "auto"                # auto (cuda if the actor has a GPU) | cpu | cuda
    adapter: str | None = None          # NB-LoRA read adapter (dir or fsspec URL from jobs/train_lora.py):
                                        # on for replay/question/answer only, off for writing and routing
    streaming: dict | None = None       # {sinks, window}: Llama/Qwen2 checkpoints are read with attention
                                        # sinks + a sliding window (nbcore.backbones.streaming; defaults there)

    def validate(self, where="model"):
        if (self.path is None) == (self.hf_config is None):
            raise ConfigError(f"{where}: set exactly one of model.path or model.hf_config")
        if self.hf_config is not None and "model_type" not in self.hf_config:
            raise ConfigError(f"{where}.hf_config needs a model_type")
        if self.gguf_file is not None and self.path is None:
            raise ConfigError(f"{where}.gguf_file needs model.path (the directory that holds it)")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"{where}.dtype must be float32, bfloat16, float16 or null, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"{where}.device must be auto, cpu or cuda, got {self.device!r}")
        if self.streaming is not None:
            if not isinstance(self.streaming, dict) or set(self.streaming) - {"sinks", "window"}:
                raise ConfigError(f"{where}.streaming must be a table with keys sinks and/or window, "
                                  f"got {self.streaming!r}")
            if int(self.streaming.get("sinks", 0)) < 0 or int(self.streaming.get("window", 1)) < 1:
                raise ConfigError(f"{where}.streaming: need sinks >= 0 and window >= 1, got {self.streaming!r}")

    def preflight(self, where="model"):
        """The checkpoint, tokenizer and adapter exist (before Ray starts or any model loads)."""
        import os

        gguf = self.path is not None and (bool(self.gguf_file) or self.path.lower().endswith(".gguf")
                                          or self.path.startswith("pkg:"))     # nbcore.backbones.gguf's rule
        if gguf:
            from nbcore.backbones.gguf import MissingDependency, ModelSourceError, check_source   # (loads torch)
            try:
                check_source(self.path, self.gguf_file, self.cache_dir)
            except (ModelSourceError, MissingDependency) as e:
                raise ConfigError(f"{where}.path: {e}") from e
        elif self.path is not None:
            if not os.path.isdir(self.path):
                raise ConfigError(f"{where}.path: no checkpoint directory {self.path!r}")
            if not os.path.isfile(os.path.join(self.path, "config.json")):
                raise ConfigError(f"{where}.path: {self.path!r} has no config.json (not a transformers checkpoint)")
        if self.tokenizer not in (None, "byte", "project"):
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


def require_fields(url: str, key: str, required: tuple[str, ...]) -> None:
    """The first row of the first shard of `url` has every field in `required`: a corpus or
    question file written with other field names is refused before any work, naming what it has."""
    from notebank.pipeline.corpus import iter_raw_rows, list_shards
    try:
        fs, paths = list_shards(url)
        first = next(((row, err) for _, row, err in iter_raw_rows(fs, paths[0], batch_rows=1)), (None, None))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{key}: {e}") from e
    row, err = first
    if err is not None or row is None:
        return                                   # unreadable rows are reported row by row, with their line
    found = list(row) if isinstance(row, dict) else []
    missing = [f for f in required if f not in found]
    if missing:
        raise ConfigError(f"{key}: rows need the fields {list(required)}; the first row of {paths[0]} has "
                          f"{found} (missing {missing}; rename them, e.g. with jq or pandas)")


def require_archive(url: str, key: str = "archive") -> None:
    """`url` is an ingest output folder (it has manifest/_run.json)."""
    require_input(url, key, "archive folder")
    require_input(url.rstrip("/") + "/manifest/_run.json", key, "ingest run record (is it an ingest output?)")


#: config keys that may hold local paths: inputs (made absolute when they exist here) and outputs
#: (always made absolute); pkg:, byte/project tokenizers and URLs are left as they are
LOCAL_INPUT_KEYS = ("corpus", "questions", "archive", "mone_adapters", "model.path", "model.tokenizer",
                    "model.adapter", "model.cache_dir")
LOCAL_OUTPUT_KEYS = ("output", "workdir", "out", "run_dir")


def absolutize_local_paths(cfg) -> list[str]:
    """Make the local relative paths of a job config absolute, in place -> ["key=new path", ...].
    For a job on an existing cluster (`ray.address`): its actors do not run in this folder."""
    import os
    changed = []
    for key in LOCAL_INPUT_KEYS + LOCAL_OUTPUT_KEYS:
        *parents, name = key.split(".")
        obj = cfg
        for p in parents:
            obj = getattr(obj, p, None)
        if obj is None or not dataclasses.is_dataclass(obj) or name not in {f.name for f in dataclasses.fields(obj)}:
            continue
        val = getattr(obj, name)
        if not isinstance(val, str) or not val or os.path.isabs(val) or "://" in val or val.startswith("pkg:") \
                or val in ("byte", "project"):
            continue
        if key in LOCAL_INPUT_KEYS and not os.path.exists(val):
            continue                        # not a local path (a name, a glob): left to the job's own checks
        new = os.path.abspath(val)
        setattr(obj, name, new)
        changed.append(f"{key}={new}")
    return changed


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


MEMORIES = ("notebank", "mone")
MONE_METHODS = ("mone",)


def validate_memory(memory: str, model: ModelSpec, mone_adapters: str | None = None) -> None:
    """`memory` is notebank or mone; mone needs a checkpoint directory or GGUF source (frozen
    Qwen2/Llama-family base) on CPU, and for a GGUF source the MoNe parameters' folder."""
    if memory not in MEMORIES:
        raise ConfigError(f"memory must be one of {list(MEMORIES)}, got {memory!r}")
    if memory == "mone":
        if not model.path:
            raise ConfigError("memory: mone needs model.path (a frozen Qwen2/Llama-family checkpoint dir, e.g. "
                              "models/tiny-qwen2, or a GGUF source), not model.hf_config")
        from nbcore.backbones.gguf import is_gguf_source, is_pkg_source
        if not mone_adapters and (is_gguf_source(model.path, model.gguf_file) or is_pkg_source(model.path)):
            raise ConfigError("mone_adapters: a GGUF / pkg: base has no <model.path>/mone folder; set mone_adapters "
                              "to the meta-trained MoNe parameters")
        if model.device == "cuda" or model.adapter or model.dtype not in (None, "float32"):
            raise ConfigError("memory: mone runs in float32 on CPU without an NB-LoRA adapter: leave model.device "
                              "auto/cpu, model.dtype null/float32 and model.adapter null")


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


READ_PRESETS = {"paper": PAPER_READ,          # the paper's read: router native (Eq. 5), no reset
                "best": {"router": ReadConfig.router, "lam": None,   # the defaults: best measured (docs/results.md)
                         "reset_above_tokens": ReadConfig.reset_above_tokens}}


def _apply_read_preset(data: dict) -> None:
    """`read.preset: paper | best` sets read.router, read.lam and read.reset_above_tokens together
    (over the same keys given beside it: the preset is the one setting that switches the read)."""
    read = data.get("read")
    if not isinstance(read, dict) or "preset" not in read:
        return
    name = read.pop("preset")
    if name is None:
        return
    if name not in READ_PRESETS:
        raise ConfigError(f"read.preset must be one of {sorted(READ_PRESETS)} or null, got {name!r}")
    read.update(READ_PRESETS[name])


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
    _apply_read_preset(data)
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
    parser.add_argument("--json", action="store_true",
                        help="end with the one-line JSON summary (for scripts) instead of the table")
    parser.add_argument("--verbose", action="store_true",
                        help="keep third-party notices (transformers, Hugging Face Hub bars, UserWarnings)")
    return parser


# The job configs sit beside their runners; these names stay importable from here (lazily: the
# runner modules import this one).
_JOB_CONFIGS = {"IngestJobConfig": "notebank.pipeline.ingest", "QueryJobConfig": "notebank.pipeline.query",
                "DemoConfig": "notebank.pipeline.demo"}


def __getattr__(name):
    if name in _JOB_CONFIGS:
        import importlib
        return getattr(importlib.import_module(_JOB_CONFIGS[name]), name)
    raise AttributeError(name)
