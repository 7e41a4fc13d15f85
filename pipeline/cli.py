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
    OUTPUT.update(json=args.json, verbose=args.verbose)
    if not args.verbose:
        from notebank.pipeline.quiet import quiet_third_party
        quiet_third_party()
    try:
        cfg = load_config(cls, args.config, args.set)
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
    return cfg


def setup(cfg):
    from notebank.pipeline.pool import init_ray
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


def run_job(cls, description: str, run, argv=None, errors: tuple = ()) -> int:
    """The body of every jobs/*.py main(): typed config -> Ray setup -> run(cfg) -> cleanup ->
    one-line JSON summary. Exceptions in `errors` (user-facing: wrong model, missing input) print
    one line and exit 2; a summary's "failures" list goes to stderr, one line each."""
    cfg = parse(cls, description, argv)
    if callable(errors):          # imported only now: the config is checked before torch loads
        errors = errors()
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
