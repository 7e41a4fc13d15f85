"""`ray job submit --working-dir . -- python jobs/ingest.py ...` against a real `ray start --head`.

Ray 2.60 has token authentication on by default: a plain `ray job submit` fails with
"Missing authentication token". What works (and is tested here):
    RAY_AUTH_MODE=token RAY_API_SERVER_ADDRESS=http://127.0.0.1:<dashboard port> \\
        ray job submit --working-dir . -- python jobs/ingest.py ...
with the head started from the project's virtualenv (`python` on the head's PATH must have the
project's dependencies) and the token in ~/.ray/auth_token (created by Ray on first use).

The head is isolated from other Ray users on the machine: its own ports (agent ports too) and RAY_TMPDIR (so it does
not become "the latest cluster" that a bare ray.init() would join); it is stopped by signalling the
`ray start --block` process we started (never `ray stop`, which would stop every Ray on the host).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, TINY_MODEL, TINY_NB, write_jsonl
from nbcore.testing import needle_text

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    tmp = tempfile.mkdtemp(prefix="nbrj-", dir="/tmp")   # short: Ray's unix socket paths must fit
    gcs, dash = _free_port(), _free_port()
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env.update(RAY_TMPDIR=tmp, PATH=venv_bin + os.pathsep + env.get("PATH", ""), RAY_AUTH_MODE="token")
    log = open(os.path.join(tmp, "head.log"), "w")
    head = subprocess.Popen(
        [os.path.join(venv_bin, "ray"), "start", "--head", "--block", f"--port={gcs}", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1", "--num-cpus=1", "--disable-usage-stats",
         # own agent ports: the defaults (e.g. 52365) collide with any other Ray on the host (such as
         # this test session's), and the job API then answers "No available agent to submit job"
         f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
         f"--runtime-env-agent-port={_free_port()}", f"--metrics-export-port={_free_port()}",
         f"--ray-client-server-port={_free_port()}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2)
            break
        except urllib.error.HTTPError:   # 401 without a token: the job API is up
            break
        except Exception:
            if head.poll() is not None:
                pytest.fail(f"ray start exited: {open(os.path.join(tmp, 'head.log')).read()[-2000:]}")
            time.sleep(0.5)
    else:
        head.send_signal(signal.SIGTERM)
        pytest.fail("the Ray head did not come up in 180 s")
    try:
        yield env, url, tmp
    finally:
        head.send_signal(signal.SIGTERM)       # `ray start --block` stops the processes it started
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        log.close()


def test_ray_job_submit_ingest(ray_head, tmp_path):
    env, url, tmp = ray_head
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"doc_id": f"d{i}", "text": needle_text(1500, 1, seed=i)[0]}
                                                 for i in range(3)])
    out = tmp_path / "out"
    sub_env = dict(env, RAY_AUTH_MODE="token", RAY_API_SERVER_ADDRESS=url)
    cmd = ["ray", "job", "submit", "--working-dir", ".", "--", "python", "jobs/ingest.py",
           "-c", "configs/ingest.yaml", "--set", f"corpus={corpus}", "--set", f"output={out}",
           "--set", f"model={json.dumps(TINY_MODEL)}", "--set", f"notebank={json.dumps(TINY_NB)}",
           "--set", "progress=false", "--json"]
    for _ in range(10):   # the job API answers a little before the head's job agent is ready
        r = subprocess.run(cmd, cwd=REPO, env=sub_env, capture_output=True, text=True, timeout=300)
        if r.returncode == 0 or "No available agent" not in r.stdout + r.stderr:
            break
        time.sleep(2)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    summary = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{\"docs_ok\"")]
    assert summary and summary[-1]["docs_ok"] == 3 and summary[-1]["docs_failed"] == 0
    import pyarrow.dataset as pds
    docs = pds.dataset(str(out / "documents"), format="parquet").to_table()
    assert sorted(docs.column("doc_id").to_pylist()) == ["d0", "d1", "d2"]
    # without the token settings the same submission is refused by the cluster
    bare = {k: v for k, v in env.items() if k not in ("RAY_AUTH_MODE",)}
    bare["RAY_ADDRESS"] = url
    r = subprocess.run(["ray", "job", "list"], cwd=REPO, env=bare, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "authentication token" in (r.stdout + r.stderr).lower()
