"""Evaluation jobs on Ray. `benchmark:` in the YAML picks one (pipeline/benchmarks.py):
ruler (default): backbones x methods x routers x tasks x lengths x budgets; longbench: LongBench
v1/v2 and MemoryAgentBench files; mone: the MoNe backend against ICL and RAG. One sweep runner
(pipeline/evaluate.py) runs them all; the benchmarks are nbcore.evals, the reports pipeline/reporting.

    python jobs/evaluate.py -c configs/eval_ruler.yaml                 # full grid (documented, not CI)
    python jobs/evaluate.py -c configs/eval_smoke.yaml                 # CI smoke: 4K/16K, few examples
    ray job submit --working-dir . -- python jobs/evaluate.py -c configs/eval_ruler.yaml

Resumable: finished cells are skipped on rerun. Writes results.parquet, results.json, summary.json,
report.md (+ report-appendix.md for RULER) and plots under `output`; prints a one-line JSON summary.

    python jobs/evaluate.py -c configs/eval_ruler.yaml --report-only   # rebuild the report from the
                                                                       # shipped results.parquet alone
"""
from __future__ import annotations

import os
import sys

if not __package__:   # run as a script from a checkout (or ray job submit): the repo root holds notebank/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from notebank.pipeline.cli import cleanup, emit, parse, setup  # noqa: E402


REPORT_ONLY = dict(action="store_true", help=(
    "rebuild the report (report.md, results.json, summary.json, plots) from <output>/results.parquet "
    "alone: no model, no Ray, no cells; results.parquet is read (and validated), never written. "
    "Unlike `--set report_only=true`, which gathers finished cells into results.parquet first."))


FORCE = dict(action="store_true", help="with --report-only / report_only: rewrite the report even where "
             "its files are committed to git (by default that is refused)")


def committed_files(output: str) -> list[str]:
    """Files under a local `output` folder that git tracks (empty: not in a checkout, or none)."""
    import subprocess
    if "://" in output or not os.path.isdir(output):
        return []
    try:
        p = subprocess.run(["git", "-C", output, "ls-files", "--", "."], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return p.stdout.split() if p.returncode == 0 else []


def main(argv=None):
    import argparse

    from notebank.pipeline.benchmarks import benchmark_name, resolve
    from notebank.pipeline.config import ConfigError, add_config_args
    # The YAML's `benchmark:` key (ruler | longbench | mone; default ruler) picks the job.
    pre, _ = add_config_args(argparse.ArgumentParser(add_help=False)).parse_known_args(argv)
    try:
        cls, run = resolve(benchmark_name(pre.config, pre.set))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2)
    args = sys.argv[1:] if argv is None else argv
    cfg = parse(cls, __doc__.split("\n")[0], argv, extra_args=[(("--report-only",), REPORT_ONLY),
                                                                (("--force",), FORCE)])
    from_results = "--report-only" in args
    if (from_results or cfg.report_only) and "--force" not in args:
        tracked = committed_files(cfg.output)
        if tracked:
            print(f"error: {cfg.output} holds {len(tracked)} committed files (e.g. {tracked[0]}); rebuilding the "
                  f"report there rewrites them. Copy the folder and set output to the copy, e.g.\n"
                  f"  cp -r {cfg.output} out/report && python jobs/evaluate.py -c CONFIG --report-only "
                  f"--set output=out/report\nor pass --force to rewrite the committed files.", file=sys.stderr)
            raise SystemExit(2)
    # report_only / --report-only run no cell: no Ray (starting one on a busy node can time out)
    started = False if from_results or cfg.report_only else setup(cfg)
    try:
        if from_results:
            from notebank.pipeline.evaluate import report_from_results
            summary = report_from_results(cfg)
        else:
            summary = run(cfg)
    except ConfigError as e:                        # e.g. a data file found missing at run time
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2)
    finally:
        cleanup(started)
    emit(summary)
    return summary


if __name__ == "__main__":
    main()


def cli() -> int:
    """Console-script entry (notebank-eval): exit status 0 once the sweep has run."""
    main()
    return 0
