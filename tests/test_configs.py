"""Typed configs: every shipped config loads; unknown keys and wrong types are errors;
ray_cluster.yaml passes Ray's own cluster-config validation."""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from notebank.pipeline.config import (ConfigError, DemoConfig, IngestJobConfig, QueryJobConfig, load_config,
                             parse_overrides, to_dict)

REPO = Path(__file__).resolve().parents[1]
from notebank.pipeline.train_lora import TrainLoraJobConfig  # noqa: E402

JOB_CONFIGS = {"ingest": IngestJobConfig, "query": QueryJobConfig, "demo": DemoConfig,
               "train_lora": TrainLoraJobConfig}


@pytest.mark.parametrize("name", sorted(JOB_CONFIGS))
def test_every_shipped_config_loads(name):
    """configs/{ingest,query,demo}.yaml (the other configs/*.yaml belong to other jobs and their tests)."""
    path, cls = REPO / "configs" / f"{name}.yaml", JOB_CONFIGS[name]
    cfg = load_config(cls, path)
    assert isinstance(cfg, cls)
    head = "".join(l for l in path.read_text().splitlines(True) if l.startswith("#"))
    job = {"demo": "run_demo"}.get(path.stem, path.stem)
    assert f"python jobs/{job}.py -c configs/{path.name}" in head, "header must give the launch command"
    # round trip: dumping and reloading gives the same config
    again = load_config(cls, None, [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}"
                                    for k, v in to_dict(cfg).items()])
    assert again == cfg


def test_overrides_and_errors(tmp_path):
    base = ["corpus=c", "output=o", "model.path=m", "model.hf_config=null"]
    cfg = load_config(IngestJobConfig, REPO / "configs/ingest.yaml",
                      base + ["notebank.chunk_size=64", "actors.num_gpus=1", "actors.accelerator_type=H100"])
    assert cfg.notebank.chunk_size == 64 and cfg.notebank.note_budget == 64  # nested defaults kept
    assert cfg.actors.num_gpus == 1.0 and cfg.model.path == "m"
    with pytest.raises(ConfigError, match=r"notebank: unknown key\(s\) \['chunk_sze'\]"):
        load_config(IngestJobConfig, None, base + ["notebank.chunk_sze=64"])
    with pytest.raises(ConfigError, match="block_size: expected an int"):
        load_config(IngestJobConfig, None, base + ["block_size=fast"])
    with pytest.raises(ConfigError, match="actors.num_actors: expected an int, got bool"):
        load_config(IngestJobConfig, None, base + ["actors.num_actors=yes"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(IngestJobConfig, None, base + ["colour=red"])
    with pytest.raises(ConfigError, match="write_budget"):
        load_config(IngestJobConfig, None, base + ["notebank.write_budget=3"])
    with pytest.raises(ConfigError, match="exactly one of model.path or model.hf_config"):
        load_config(IngestJobConfig, None, ["corpus=c", "output=o"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("corpus: c\noutput: o\nmodel: {path: m}\nnotebank: {addr_dim: 1.5}\n")
    with pytest.raises(ConfigError, match="notebank.addr_dim: expected an int"):
        load_config(IngestJobConfig, bad)
    q = load_config(QueryJobConfig, REPO / "configs/query.yaml", ["methods=[plain, notebank]", "read.top_r=4",
                                                                  'read.stop=["\\n", "."]'])
    assert [r.method for r in q.read_configs()] == ["plain", "notebank"]
    assert q.read_configs()[1].top_r == 4 and q.read.stop == ("\n", ".")
    with pytest.raises(ConfigError, match="jrt"):
        load_config(QueryJobConfig, REPO / "configs/query.yaml", ["methods=[jrt]"])
    assert parse_overrides(["a.b=1", "a.c=x", "d=[1, 2]"]) == {"a": {"b": 1, "c": "x"}, "d": [1, 2]}
    with pytest.raises(ConfigError):
        parse_overrides(["novalue"])


def test_cli_print_config_and_config_error():
    r = subprocess.run([sys.executable, "jobs/ingest.py", "-c", "configs/ingest.yaml", "--set", "block_size=64",
                        "--print-config"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["block_size"] == 64
    r = subprocess.run([sys.executable, "jobs/query.py", "-c", "configs/query.yaml", "--set", "read.nope=1"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown key" in r.stderr


def _ray_validate(cfg: dict):
    from ray.autoscaler._private.util import prepare_config, validate_config
    validate_config(prepare_config(copy.deepcopy(cfg)))


def test_ray_cluster_yaml_is_valid():
    text = (REPO / "ray_cluster.yaml").read_text()
    cfg = yaml.safe_load(text)
    _ray_validate(cfg)
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert "GPU" not in head.get("resources", {}), "the head is a CPU node"
    gpu_types = {t["node_config"]["InstanceType"] for n, t in types.items() if t.get("resources", {}).get("GPU")}
    assert {"p5.48xlarge", "p5e.48xlarge"} <= gpu_types  # H100 and H200 workers
    accel = {k for t in types.values() for k in t.get("resources", {}) if k.startswith("accelerator_type:")}
    assert accel == {"accelerator_type:H100", "accelerator_type:H200"}
    assert all("[gpu]" in " ".join(t.get("worker_setup_commands", [])) for t in types.values()
               if t.get("resources", {}).get("GPU"))
    assert "[gpu]" not in " ".join(cfg["head_setup_commands"])       # never triton on the CPU head
    start = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start and "0.0.0.0" not in text


def test_ray_validation_catches_a_broken_cluster_yaml():
    cfg = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    broken = copy.deepcopy(cfg)
    broken["available_node_types"]["gpu_h100"]["max_wrokers"] = 2
    with pytest.raises(Exception, match="max_wrokers"):
        _ray_validate(broken)


def test_shipped_configs_and_demo_share_the_tiny_model():
    """Archives written by the demo can be queried with configs/query.yaml (same model fingerprint)."""
    for name, cls in (("ingest", IngestJobConfig), ("query", QueryJobConfig)):
        assert load_config(cls, REPO / f"configs/{name}.yaml").model.path == "models/tiny-gdn"
    assert load_config(DemoConfig, REPO / "configs/demo.yaml").model.path == "models/tiny-gdn"
    assert DemoConfig().model.path == "models/tiny-gdn"


def test_every_model_path_a_shipped_config_names_is_shipped():
    """configs/*.yaml only name checkpoints that are in models/ (pruned ones live in git history)."""
    import re
    missing = []
    for path in sorted((REPO / "configs").glob("*.yaml")):
        for line in path.read_text().splitlines():
            code = line.split("#", 1)[0]
            for m in re.finditer(r"models/[\w.-]+(?:/[\w.-]+)?", code):
                if not (REPO / m.group(0)).exists():
                    missing.append(f"{path.name}: {m.group(0)}")
    assert not missing, missing
