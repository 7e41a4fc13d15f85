"""Every job on a Ray with ONE CPU (`--set ray.num_cpus=1`, its own local Ray, as a user runs it):
ingest, query (archive and one-pass) and evaluate finish (exit 0) instead of waiting forever for a
CPU an actor holds; an actor that fits no node is refused at once, with what it needs."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import REPO, TINY_MODEL, TINY_NB, write_jsonl
from nbcore.testing import needle_text

pytestmark = pytest.mark.slow

LIMIT_S = 300
ONE_CPU = ["--set", "ray.num_cpus=1", "--set", "progress=false"]


def run_job(*args, timeout=LIMIT_S):
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, *args, "--json"], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return p, time.perf_counter() - t0


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-cpu")
    docs, questions = [], []
    for i in range(2):
        text, needles = needle_text(1200, 1, seed=40 + i)
        docs.append({"doc_id": f"doc{i}", "text": text})
        questions.append({"question_id": f"q{i}", "doc_id": f"doc{i}", "answers": needles[0][1],
                          "question": f"What is the special magic number for {needles[0][0]}?"})
    write_jsonl(root / "corpus.jsonl", docs)
    write_jsonl(root / "questions.jsonl", questions)
    return root


def model_args():
    return ["--set", f"model={json.dumps(TINY_MODEL)}"]


def test_ingest_and_query_finish_on_one_cpu(inputs, tmp_path):
    archive, answers, onepass = tmp_path / "archive", tmp_path / "answers", tmp_path / "onepass"
    p, wall = run_job("jobs/ingest.py", "--set", f"corpus={inputs / 'corpus.jsonl'}", "--set", f"output={archive}",
                      "--set", f"notebank={json.dumps(TINY_NB)}", "--set", "block_size=512", *model_args(), *ONE_CPU)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["docs_ok"] == 2 and wall < LIMIT_S
    query = ["--set", f"questions={inputs / 'questions.jsonl'}", "--set", "methods=[plain, notebank]",
             "--set", "read.max_new_tokens=4", *model_args(), *ONE_CPU]
    p, wall = run_job("jobs/query.py", "--set", f"archive={archive}", "--set", f"output={answers}", *query)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["questions_ok"] == 2 and s["rows"] == 4 and wall < LIMIT_S
    p, wall = run_job("jobs/query.py", "--set", f"corpus={inputs / 'corpus.jsonl'}", "--set", f"output={onepass}",
                      "--set", f"notebank={json.dumps(TINY_NB)}", "--set", "block_size=512", *query)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["questions_ok"] == 2 and wall < LIMIT_S


def test_evaluate_finishes_on_one_cpu(tmp_path):
    p, wall = run_job("jobs/evaluate.py", "--set", f"output={tmp_path}",
                      "--set", f"backbones=[{{name: rand, model: {json.dumps(TINY_MODEL)}, notebank: {{chunk_size: 256}}}}]",
                      "--set", "tasks=[niah_single_1]", "--set", "lengths=[1K]", "--set", "n_examples=2",
                      "--set", "methods=[plain, nb-tf-top2]", "--set", "max_new_tokens=4", *ONE_CPU)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["cells"] == 2 and s["cells_failed"] == 0 and wall < LIMIT_S
    assert (tmp_path / "results.parquet").exists()


def test_actor_larger_than_every_node_is_refused_at_once(inputs, tmp_path):
    p, wall = run_job("jobs/ingest.py", "--set", f"corpus={inputs / 'corpus.jsonl'}", "--set",
                      f"output={tmp_path / 'a'}", "--set", "actors.num_cpus=2", *model_args(), *ONE_CPU, timeout=120)
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-3000:])
    assert "each actor needs 2 CPUs" in p.stderr and "ray.num_cpus" in p.stderr
    assert wall < 120


def test_a_niced_job_keeps_its_niceness_on_its_local_ray_workers():
    """A job run under `nice` starts its local Ray with workers at the job's own niceness (Ray's
    default puts them 15 levels lower, so a niced job starved beside other niced work)."""
    code = ("import os, ray\n"
            "from notebank.pipeline.cli import init_ray\n"
            "from notebank.pipeline.config import RaySpec\n"
            "init_ray(RaySpec(num_cpus=1))\n"
            "print('NICE', os.nice(0), ray.get(ray.remote(lambda: os.nice(0)).remote()))\n"
            "ray.shutdown()\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RAY_worker_niceness", "RAY_ADDRESS")}
    p = subprocess.run(["nice", "-n", "2", sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=LIMIT_S)
    assert p.returncode == 0, p.stderr[-2000:]
    driver, worker = map(int, p.stdout.split("NICE")[1].split())
    assert worker == driver
