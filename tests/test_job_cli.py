"""The job CLIs as a user meets them: `--help` lists every config key with its default and doc, and
bad input exits 2 with one line, before Ray starts or a model loads, leaving no output behind."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from notebank.pipeline.config import config_keys

REPO = Path(__file__).resolve().parents[1]


def _run(*args, timeout=60):
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return p, time.perf_counter() - t0


def _job_configs():
    from notebank.pipeline.config import DemoConfig, IngestJobConfig, QueryJobConfig
    from notebank.pipeline.train_lora import TrainLoraJobConfig
    return {"jobs/ingest.py": IngestJobConfig, "jobs/query.py": QueryJobConfig, "jobs/run_demo.py": DemoConfig,
            "jobs/train_lora.py": TrainLoraJobConfig}


@pytest.mark.parametrize("job", sorted(_job_configs()))
def test_help_lists_every_key_with_default_and_doc(job):
    cls = _job_configs()[job]
    p, _ = _run(job, "--help")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    keys = config_keys(cls)
    assert len(keys) > 10
    for key, _tp, default, doc in keys:
        hit = [l for l in lines if l.strip().startswith(f"{key} = ")]
        assert hit, f"{job} --help does not list {key}"
        assert hit[0].strip().startswith(f"{key} = {default}"), hit[0]
        assert doc, f"{cls.__name__}.{key} has no doc comment beside its field"
        assert doc.split()[0] in hit[0], hit[0]
    if job == "jobs/ingest.py":
        assert any(l.strip().startswith("notebank.chunk_size = 512 ") for l in lines)


def test_unknown_router_exits_2_fast_before_ray(tmp_path):
    out = tmp_path / "answers"
    p, wall = _run("jobs/query.py", "-c", "configs/query.yaml", "--set", "questions=q.jsonl", "--set", "archive=a",
                   "--set", f"output={out}", "--set", "read.router=bm-25")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "unknown router 'bm-25'" in p.stderr and "bm25" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr           # one line, not a traceback
    assert "Started a local Ray" not in p.stderr + p.stdout
    assert wall < 10 and not out.exists()


@pytest.mark.parametrize("override, message", [
    ("corpus={missing}", "corpus: {missing}: no such file or folder"),
    ("model.path={tmp}", "has no config.json"),
    ("model.path={missing}", "no checkpoint directory"),
    ("limit=-1", "limit must be >= 0"),
    ("notebank.write_budget=3", "write_budget must be 1 or 2"),
])
def test_bad_ingest_input_exits_2_and_leaves_nothing(tmp_path, override, message):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"doc_id": "d0", "text": "A sentence."}\n')
    missing = tmp_path / "nope"
    out = tmp_path / "archive"
    fill = dict(missing=missing, tmp=tmp_path)
    p, wall = _run("jobs/ingest.py", "-c", "configs/ingest.yaml", "--set", f"corpus={corpus}",
                   "--set", f"output={out}", "--set", override.format(**fill))
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert message.format(**fill) in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert wall < 10 and not out.exists()


def test_query_needs_an_ingest_output(tmp_path):
    qs = tmp_path / "q.jsonl"
    qs.write_text('{"question_id": "q0", "doc_id": "d0", "question": "?", "answers": ["x"]}\n')
    (tmp_path / "not-an-archive").mkdir()
    out = tmp_path / "answers"
    p, _ = _run("jobs/query.py", "-c", "configs/query.yaml", "--set", f"questions={qs}",
                "--set", f"archive={tmp_path / 'not-an-archive'}", "--set", f"output={out}")
    assert p.returncode == 2 and "is it an ingest output?" in p.stderr, p.stderr
    assert not out.exists()


def test_train_mone_runs_from_the_typed_config(tmp_path):
    """jobs/train_mone.py on the one config system: --help keys, a bad action exits 2, and two
    meta-training steps on the shipped tiny Qwen2 write MoNe parameters a rerun resumes from."""
    from notebank.pipeline.train_mone import TrainMoneJobConfig
    p, _ = _run("jobs/train_mone.py", "--help")
    assert p.returncode == 0 and "train.mone.segment_len = 128" in p.stdout
    assert all(f"{k} = " in p.stdout for k, *_ in config_keys(TrainMoneJobConfig))
    p, _ = _run("jobs/train_mone.py", "--set", "action=evl")
    assert p.returncode == 2 and "action must be one of" in p.stderr
    p, _ = _run("jobs/train_mone.py", "--set", "train.lr=-1")      # refused before a model loads
    assert p.returncode == 2 and "need lr > 0 (got -1" in p.stderr and "Traceback" not in p.stderr
    p, _ = _run("jobs/train_mone.py", "--set", "action=diagnostics", "--set", f"out={tmp_path / 'none'}")
    assert p.returncode == 2 and "no MoNe parameters" in p.stderr
    p, _ = _run("jobs/train_mone.py", "--set", "action=eval")      # the serial eval loop is gone: the sweep job
    assert p.returncode == 2 and "jobs/evaluate.py -c configs/eval_mone.yaml" in p.stderr

    def train(steps: int, out: str, run: str, init: str = "") -> dict:
        extra = ["--set", f"train.init_adapters={tmp_path / init}"] if init else []
        p, _ = _run("jobs/train_mone.py", "-c", "configs/train_mone.yaml", "--set", f"train.max_steps={steps}",
                    "--set", f"out={tmp_path / out}", "--set", f"run_dir={tmp_path / run}",
                    "--set", "train.batch_size=1", "--set", "train.max_segments=2", *extra, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads((tmp_path / out / "mone_config.json").read_text())
    first = train(2, "mone", "run")
    assert (tmp_path / "mone" / "mone_adapters.safetensors").is_file()
    assert (tmp_path / "run").is_dir() and any((tmp_path / "run").iterdir())
    assert (first["steps"], first["steps_total"], first["parent"]) == (2, 2, None)
    # a continuation from those parameters records them as its parent, and the steps behind it
    second = train(1, "mone2", "run2", init="mone")
    assert (second["steps"], second["steps_total"]) == (1, 3) and second["parent"] == first
    # the init folder now holds the continuation's own export (shipped while it ran); resuming it
    # keeps the lineage it started from instead of re-reading the folder
    shutil.copytree(tmp_path / "mone2", tmp_path / "mone", dirs_exist_ok=True)
    third = train(2, "mone3", "run2", init="mone")
    assert (third["steps"], third["steps_total"]) == (2, 4) and third["parent"] == first


def test_relative_paths_are_made_absolute_for_an_existing_cluster():
    """ray.address set: the cluster's actors do not run in this folder, so local relative paths are
    resolved on the driver (one line says so); $RAY_ADDRESS alone (ray job submit --working-dir ships
    the folder) changes nothing. --print-config shows the paths as they would be shipped."""
    import os
    import yaml
    args = ["jobs/ingest.py", "--set", "model.path=models/tiny-gdn", "--set", "output=out/archive",
            "--set", "corpus=data/not-here.jsonl", "--print-config"]
    p, _ = _run(*args, "--set", "ray.address=10.0.0.1:6379")
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    assert cfg["model"]["path"] == str(REPO / "models/tiny-gdn") and cfg["output"] == str(REPO / "out/archive")
    assert cfg["corpus"] == "data/not-here.jsonl"          # not a local path here: left to the job's checks
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "ray.address=10.0.0.1:6379: local relative paths made absolute" in lines[0]
    assert f"model.path={REPO / 'models/tiny-gdn'}" in lines[0]
    env = dict(os.environ, RAY_ADDRESS="10.0.0.1:6379")
    p = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0 and p.stderr.strip() == "", p.stderr
    cfg = yaml.safe_load(p.stdout)
    assert cfg["model"]["path"] == "models/tiny-gdn" and cfg["output"] == "out/archive"
