"""Registry of evaluation jobs behind `jobs/evaluate.py`: the YAML's top-level `benchmark:` key
(default `ruler`) picks the job config class and the function that runs it.

Each entry: name -> (module, config class, run function). The run function takes the validated
config (Ray already initialised by the CLI) and returns a JSON-able summary dict.
"""
from __future__ import annotations

import importlib

BENCHMARKS: dict[str, tuple[str, str, str]] = {
    "ruler": ("pipeline.evaluate", "EvalJobConfig", "run_sweep"),
    "longbench": ("pipeline.evaluate_longbench", "LongBenchJobConfig", "run_longbench"),
    "mone": ("pipeline.evaluate_mone", "MoneEvalJobConfig", "run_mone_eval"),
}


def resolve(name: str):
    """-> (config class, run function) for a benchmark name; clear error for an unknown one."""
    from pipeline.config import ConfigError
    if name not in BENCHMARKS:
        raise ConfigError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARKS)}")
    mod, cls, fn = BENCHMARKS[name]
    m = importlib.import_module(mod)
    return getattr(m, cls), getattr(m, fn)


def benchmark_name(config_path: str | None, overrides: list[str]) -> str:
    """The `benchmark:` key from the YAML file and --set overrides (last wins), default ruler."""
    import yaml

    from pipeline.config import parse_overrides
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
