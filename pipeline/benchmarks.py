"""Registry of evaluation jobs behind `jobs/evaluate.py`: the YAML's top-level `benchmark:` key
(default `ruler`) picks the job config class; every job runs through the one sweep runner,
`pipeline.evaluate.run_sweep` (the config takes its validated YAML, Ray already initialised by the CLI,
and returns a JSON-able summary dict).

Each entry: name -> (module, config class). The per-example evaluation of each lives in nbcore.evals
(ruler, longbench + longbench_v2 + memoryagentbench, mone), the reports in pipeline/reporting.
"""
from __future__ import annotations

import importlib

BENCHMARKS: dict[str, tuple[str, str]] = {
    "ruler": ("notebank.pipeline.evaluate_ruler", "RulerJobConfig"),
    "longbench": ("notebank.pipeline.evaluate_longbench", "LongBenchJobConfig"),
    "mone": ("notebank.pipeline.evaluate_mone", "MoneEvalJobConfig"),
}


def resolve(name: str):
    """-> (config class, run function) for a benchmark name; clear error for an unknown one."""
    from notebank.pipeline.config import ConfigError
    from notebank.pipeline.evaluate import run_sweep
    if name not in BENCHMARKS:
        raise ConfigError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARKS)}")
    mod, cls = BENCHMARKS[name]
    return getattr(importlib.import_module(mod), cls), run_sweep


def benchmark_name(config_path: str | None, overrides: list[str]) -> str:
    """The `benchmark:` key from the YAML file and --set overrides (last wins), default ruler."""
    import yaml

    from notebank.pipeline.config import parse_overrides
    name = "ruler"
    if config_path:
        try:
            with open(config_path) as f:
                data = yaml.safe_load(f) or {}
            if isinstance(data, dict) and data.get("benchmark"):
                name = str(data["benchmark"])
        except (OSError, yaml.YAMLError):
            pass                                    # load_config reports these properly
    ov = parse_overrides(overrides or [])
    if ov.get("benchmark"):
        name = str(ov["benchmark"])
    return name
