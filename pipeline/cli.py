"""CLI plumbing shared by jobs/*.py: typed config from YAML + overrides, Ray setup/cleanup, summary."""
from __future__ import annotations

import argparse
import json
import os
import sys


def parse(cls, description: str, argv=None, extra_args=()):
    """Typed config from -c/--set (exit 2 on a config error). extra_args: (flags, argparse kwargs)
    pairs of job-specific flags, listed in --help; the caller reads their values itself."""
    import yaml

    from notebank.pipeline.config import ConfigError, add_config_args, keys_help, load_config, to_dict
    p = add_config_args(argparse.ArgumentParser(description=description, epilog=keys_help(cls),
                                                formatter_class=argparse.RawDescriptionHelpFormatter))
    for flags, kw in extra_args:
        p.add_argument(*flags, **kw)
    args = p.parse_args(argv)
    try:
        cfg = load_config(cls, args.config, args.set)
        if args.print_config:
            print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            raise SystemExit(0)
        # Inputs that must exist (corpus, questions, archive, model dir) are checked here, before
        # Ray starts or a model loads, so a typo costs a second, not a cluster start.
        if hasattr(cfg, "preflight"):
            cfg.preflight()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2)
    return cfg


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
    ray.init(address=address, **kwargs)
    return True


def setup(cfg):
    from notebank.pipeline.ray_stderr import drop_ray_data_restart_warning
    drop_ray_data_restart_warning()     # one known-false core_worker error line per actor (see that module)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return init_ray(cfg.ray)


def cleanup(started: bool):
    import ray
    if started and ray.is_initialized():
        ray.shutdown()


def emit(summary: dict) -> None:
    """The one-line JSON summary (last line of stdout)."""
    print(json.dumps(summary, sort_keys=False), flush=True)


def run_job(cls, description: str, run, argv=None, errors: tuple = ()) -> int:
    """The body of every jobs/*.py main(): typed config -> Ray setup -> run(cfg) -> cleanup ->
    one-line JSON summary. Exceptions in `errors` (user-facing: wrong model, missing input) print
    one line and exit 2; a summary's "failures" list goes to stderr, one line each."""
    cfg = parse(cls, description, argv)
    started = setup(cfg)
    try:
        summary = run(cfg)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        cleanup(started)
    for f in summary.pop("failures", []) if isinstance(summary, dict) else []:
        print(f"failed: {f}", file=sys.stderr)
    emit(summary)
    if isinstance(summary, dict) and (summary.get("docs_failed") or summary.get("questions_failed")
                                      or summary.get("shards_failed")):
        return 1          # the job ran, but some inputs failed (listed above and in the outputs)
    return 0
