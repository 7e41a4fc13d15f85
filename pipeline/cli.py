"""CLI plumbing shared by jobs/*.py: typed config from YAML + overrides, Ray setup/cleanup, summary."""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import sys


def parse(cls, description: str, argv=None, extra_args=()):
    """Typed config from -c/--set (exit 2 on a config error). extra_args: (flags, argparse kwargs)
    pairs of job-specific flags, listed in --help; the caller reads their values itself."""
    import yaml

    from notebank.pipeline.config import ConfigError, add_config_args, keys_help, load_config, to_dict
    from notebank.pipeline.safety import UnsafePath
    p = add_config_args(argparse.ArgumentParser(description=description, epilog=keys_help(cls),
                                                formatter_class=argparse.RawDescriptionHelpFormatter))
    for flags, kw in extra_args:
        p.add_argument(*flags, **kw)
    args = p.parse_args(argv)
    OUTPUT.update(json=args.json, verbose=args.verbose)
    if not args.verbose:
        from notebank.pipeline.quiet import quiet_third_party
        quiet_third_party()
    try:
        cfg = load_config(cls, args.config, args.set)
        resolve_for_cluster(cfg)
        if args.print_config:
            print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            raise SystemExit(0)
        # Inputs that must exist (corpus, questions, archive, model dir) are checked here, before
        # Ray starts or a model loads, so a typo costs a second, not a cluster start.
        if hasattr(cfg, "preflight"):
            cfg.preflight()
        from notebank.schemas.provenance import set_job     # results.json and run records say what ran
        model = getattr(cfg, "model", None)
        set_job(job=cls.__name__, model=to_dict(model) if model is not None and hasattr(model, "__dataclass_fields__")
                else None, config=to_dict(cfg))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2)
    except UnsafePath as e:             # an output that can be escaped, or lies inside an archive
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    return cfg


def resolve_for_cluster(cfg) -> list[str]:
    """With `ray.address` set (an existing cluster), local relative paths in the config are made
    absolute here, on the driver, before they are shipped: the actors do not run in this folder.
    Says so in one line. `$RAY_ADDRESS` alone (set by `ray job submit --working-dir`) changes
    nothing: there the working folder is shipped and relative paths resolve against it."""
    from notebank.pipeline.config import absolutize_local_paths
    ray = getattr(cfg, "ray", None)
    address = getattr(ray, "address", None)
    if not address or address == "local":
        return []
    changed = absolutize_local_paths(cfg)
    if changed:
        print(f"ray.address={address}: local relative paths made absolute for the cluster's actors: "
              + ", ".join(changed), file=sys.stderr)
    return changed


def init_ray(spec=None) -> bool:
    """Connect to `spec.address`, else $RAY_ADDRESS (set by `ray job submit`), else start a new local
    Ray. spec: a RaySpec (default RaySpec()). Returns True if this call started/connected Ray (the
    caller then shuts it down)."""
    import ray

    from notebank.pipeline.config import RaySpec
    if ray.is_initialized():
        return False
    spec = spec or RaySpec()
    address = spec.address or os.environ.get("RAY_ADDRESS") or "local"
    kwargs = {"namespace": spec.namespace, "log_to_driver": True}
    if address == "local":
        kwargs.update(include_dashboard=False, num_cpus=spec.num_cpus)
        # Ray starts workers 15 nice levels below the raylet: under `nice -n 10 python jobs/...` beside
        # other niced work, the cells ran at 19 and starved (one 1K MoNe cell took 328 s instead of ~5).
        # 0 keeps the job's own niceness for its workers, as `ray job submit` does for a job's driver.
        os.environ.setdefault("RAY_worker_niceness", "0")
        # A new local Ray turns token authentication on by itself (kept) and says so in a WARNING line
        # on every run: that notice only.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    ray.init(address=address, **kwargs)
    return True


def setup(cfg):
    from notebank.pipeline.ray_stderr import drop_ray_data_restart_warning
    drop_ray_data_restart_warning()     # one known-false core_worker error line per actor (see that module)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not getattr(cfg.ray, "address", None) and not os.environ.get("RAY_ADDRESS"):
        # the phase a person waits through before the first progress bar (20-60 s on a busy machine)
        print("starting a local Ray, then loading the model ...", file=sys.stderr, flush=True)
    return init_ray(cfg.ray)


def cleanup(started: bool):
    import ray
    if started and ray.is_initialized():
        ray.shutdown()


OUTPUT = {"json": False, "verbose": False}      # --json / --verbose of the job being run (set by parse)


def emit(summary: dict) -> None:
    """The end of a job's stdout: a short table for a person (pipeline/summary_table.py), or with
    --json the one-line JSON summary (last line of stdout)."""
    if OUTPUT["json"] or not isinstance(summary, dict):
        print(json.dumps(summary, sort_keys=False), flush=True)
        return
    from notebank.pipeline.summary_table import render
    print(render(summary), flush=True)


def archive_user_errors() -> tuple:
    """Errors of the archive jobs (ingest, query) that are the user's: wrong model, missing input,
    refused output. One line, exit 2. Called by run_job after the config is checked, because
    pipeline.archive loads torch."""
    from notebank.pipeline.archive import FingerprintMismatch, LayoutError
    from notebank.pipeline.config import ConfigError
    from notebank.pipeline.safety import OutputBusy, UnsafePath
    return (FingerprintMismatch, LayoutError, OutputBusy, UnsafePath, ConfigError, FileNotFoundError)


def run_job(cls, description: str, run, argv=None, errors: tuple = (), committed=None) -> int:
    """The body of every jobs/*.py main(): typed config -> Ray setup -> run(cfg) -> cleanup ->
    one-line JSON summary. Exceptions in `errors` (user-facing: wrong model, missing input) print
    one line and exit 2; a summary's "failures" list goes to stderr, one line each.

    A store that fails under the job (disk full, permission denied, the output folder or bucket
    gone: `store_failure`) prints one line naming the path and what to do, then the JSON summary
    with what the store holds (`committed(cfg)` -> dict, read after the failure), and exits 1: what
    was committed stays, and a rerun continues from it."""
    cfg = parse(cls, description, argv)
    if callable(errors):          # imported only now: the config is checked before torch loads
        errors = errors()
    started = setup(cfg)
    try:
        summary = run(cfg)
    except Exception as e:              # noqa: BLE001 - sorted below: store failure, user error, bug
        why = store_failure(e, cfg)
        if why is None and not isinstance(e, errors):
            raise
        cleanup(started)
        started = False
        if why is None:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"error: {why}", file=sys.stderr)
        summary = {"status": "failed", "error": why}
        try:
            summary.update(committed(cfg) if committed else {})
        except Exception as e2:         # noqa: BLE001 - the store may be gone: say so, still summarise
            summary["committed_error"] = f"{type(e2).__name__}: {e2}"
        emit(summary)
        return 1
    finally:
        cleanup(started)
    for f in summary.pop("failures", []) if isinstance(summary, dict) else []:
        print(f"failed: {f}", file=sys.stderr)
    emit(summary)
    if isinstance(summary, dict) and (summary.get("docs_failed") or summary.get("questions_failed")
                                      or summary.get("shards_failed")):
        return 1          # the job ran, but some inputs failed (listed above and in the outputs)
    return 0


# ---- a store failing under a job --------------------------------------------------------------------
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)
# an OSError as a worker's traceback shows it (Ray Data re-raises actor errors with the worker's trace)
_ERRNO_LINE = re.compile(r"(\w*Error): \[Errno (\d+)\] ([^\n]*?)(?:: '([^'\n]*)')?\s*$", re.M)


def _chain(e: BaseException):
    """`e` and every exception it wraps (__cause__, __context__, Ray's .cause), once each."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__, getattr(x, "cause", None)]


def _stores(cfg) -> list[str]:
    """The store URLs a job writes or reads (its output first)."""
    return [u for u in (getattr(cfg, k, None) for k in ("output", "archive")) if isinstance(u, str) and u]


def _gone(url: str) -> bool:
    import fsspec
    try:
        fs, path = fsspec.core.url_to_fs(url)
        return not fs.exists(path)
    except Exception:                 # noqa: BLE001 - a bucket that is gone can also fail to list
        return True


def store_failure(e: BaseException, cfg) -> str | None:
    """One line (the path, what went wrong, what to do) when `e` is the store failing: no space,
    permission denied, or the output / archive folder gone. None for anything else."""
    found = None
    for x in _chain(e):
        if isinstance(x, OSError) and (x.errno in _NO_SPACE + _DENIED or isinstance(x, (PermissionError,
                                                                                            FileNotFoundError))):
            found = (x.errno or (errno.EACCES if isinstance(x, PermissionError) else errno.ENOENT),
                     x.filename or str(x))
            break
    if found is None:
        for x in _chain(e):
            for m in _ERRNO_LINE.finditer(str(x)):
                found = (int(m.group(2)), m.group(4) or m.group(3))
        if found is None:
            return None
    code, path = found
    stores = _stores(cfg)
    out = stores[0] if stores else "the output"
    if code in _NO_SPACE:
        return (f"no space left writing {path}: free space on that device (or raise the quota), or choose another "
                f"output, and rerun: committed groups in {out} are kept and the rerun does the rest")
    if code in _DENIED:
        return (f"permission denied on {path}: give this user read and write access to {out} (or choose another "
                "output), and rerun: what was committed is kept")
    if code == errno.ENOENT:
        inside = [u for u in stores if isinstance(path, str) and _under(path, u)]
        if inside:
            what = f"the store {inside[0]} vanished" if _gone(inside[0]) else \
                f"a file of {inside[0]} disappeared (removed by something else?)"
            return (f"{what} while the job ran ({path}: not found): check that it is mounted (or that the bucket "
                    "exists and is reachable), and rerun: a rerun redoes whatever was not committed")
    return None


def _under(path: str, url: str) -> bool:
    """`path` (a local path, a URL, or a bucket/key an object store names) lies under store `url`."""
    import fsspec
    try:
        fs, root = fsspec.core.url_to_fs(url)
        p = fsspec.core.url_to_fs(path)[1] if "://" in path else path
    except Exception:                 # noqa: BLE001
        return False
    protos = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "file" in protos:
        root, p = os.path.realpath(root), os.path.realpath(p)
    root = root.rstrip("/")
    return p == root or p.startswith(root + "/")
