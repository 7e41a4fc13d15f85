"""Ingest on a real 2-node Ray cluster, with the worker node lost mid-run.

The head is started the README's way (`python jobs/cluster.py head`: token authentication on), a
second node joins it with `python jobs/cluster.py worker` (its own ports, the same token), both on
this machine, in a temporary HOME and Ray temp dir. A driver process connects with `ray.address`
and ingests a small corpus with the shipped tiny GDN and two ingest actors, one per node (the head
offers 2 CPUs, the worker node 1, each actor takes 1, and Ray Data spreads its actors). At the
worker node's first committed group its raylet is SIGKILLed: the node, its actor and its objects
are gone. Ray Data redoes the lost batches on the head (its own actor, or the lost one restarted on
the head's spare CPU).
Every document must then be in the archive exactly once, and the notes, documents and state files
must be byte-identical to a single-node run of the same corpus (the archive is deterministic).
The cluster is stopped by its own processes (`jobs/cluster.py stop`), never by `ray stop`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.dataset as pds
import pytest

from conftest import REPO, TINY_NB, write_jsonl
from nbcore.testing import needle_text
from test_cluster_auth import CLI, _alive, _clean_env, _free_port, _ports_args, _with_marker
from test_pipeline_ingest import data_files

pytestmark = pytest.mark.slow

MODEL = {"path": str(REPO / "models" / "tiny-gdn-v5"), "device": "cpu"}   # absolute: workers run elsewhere
N_DOCS = 12
LOG_DIR = os.environ.get("NB_TEST_LOG_DIR")     # if set, the driver's output is kept there (driver.log)

# The driver: the project's ingest on an existing cluster, every row's record appended to a file as it
# arrives (with the pid of the actor that wrote it), then the reference run; before each run the live
# nodes (by node-manager port), after it the summary.
DRIVER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import ray, ray.data
from notebank.pipeline.config import build
from notebank.pipeline.ingest import IngestJobConfig, run_ingest
from notebank.pipeline.cli import init_ray
cfg = build(IngestJobConfig, json.loads(sys.argv[2])).validate()
init_ray(cfg.ray)
# Start ingesting only when every actor of the pool is up: on a busy machine one actor can take a
# minute longer to import torch than the other, and would then get no group at all.
ray.data.DataContext.get_current().wait_for_min_actors_s = 600
def alive():
    return sorted(n["NodeManagerPort"] for n in ray.nodes() if n["Alive"])
def ingest(cfg, records):
    print("NODES " + json.dumps(alive()), flush=True)
    with open(records, "a") as log:
        def on_commit(rec):
            log.write(json.dumps({"doc_id": rec["doc_id"], "group": rec["group"], "status": rec["status"],
                                  "pid": int(rec["pid"]), "t": time.time()}) + "\n")
            log.flush()
        summary = run_ingest(cfg, on_commit=on_commit)
    summary.pop("failures", None)
    print("SUMMARY " + json.dumps(summary), flush=True)
ingest(cfg, sys.argv[3])
# the reference: the same corpus into another output with one actor, on what is left of the cluster
ref = build(IngestJobConfig, {**json.loads(sys.argv[2]), "output": sys.argv[4],
                              "actors": {**json.loads(sys.argv[2])["actors"], "num_actors": 1}}).validate()
ingest(ref, sys.argv[5])
"""


def _docs() -> list[dict]:
    return [{"doc_id": f"m{i:02d}", "text": needle_text(1200 + 61 * i, 2, seed=100 + i)[0]} for i in range(N_DOCS)]


def _raylet(pids: list[int], node_manager_port: int | None = None) -> int:
    import psutil
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.name() == "raylet" and (node_manager_port is None or
                                         f"--node_manager_port={node_manager_port}" in p.cmdline()):
                return pid
        except psutil.Error:
            continue
    raise AssertionError(f"no raylet among {pids}")


def _descendants(pid: int) -> set[int]:
    import psutil
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _auth_mode(pid: int) -> str | None:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    v = env.get(b"RAY_AUTH_MODE")
    return v.decode() if v is not None else None


def _start(args: list[str], env: dict) -> dict:
    """`jobs/cluster.py head|worker ARGS`, once more if Ray's fixed 30 s wait for the new raylet to register
    ran out (a loaded machine; the failed start was cleaned up by the command). Returns its JSON line."""
    for attempt in (1, 2):
        r = subprocess.run(CLI + args, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        if r.returncode == 0 or attempt == 2 or "timed out during startup" not in r.stderr:
            break
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_nodes():
    """A token-auth head (2 CPUs) and a worker node (1 CPU) on free ports, stopped by their own pids."""
    from notebank.pipeline import cluster
    tmp = Path(tempfile.mkdtemp(prefix="nbmn-", dir="/tmp"))   # short: Ray's unix socket paths must fit
    home = tmp / "home"
    home.mkdir()
    # PYTHONPATH: the cluster's workers import this checkout (not whatever the venv's editable install maps)
    env = dict(_clean_env(home, tmp), PYTHONPATH=str(REPO))
    # The GCS declares a node dead after this many failed health checks this far apart (Ray's defaults,
    # 5 x 3 s, took ~35 s on a busy machine). A SIGKILLed raylet refuses the check at once; a live but
    # slow one still has the default 10 s per check to answer.
    env.update(RAY_health_check_period_ms="2000", RAY_health_check_failure_threshold="5")
    # Ray renices its workers by +15 (to 19 under a `nice -n 10` test run): on a loaded machine they then
    # starve (minutes to import torch). Here they run at the test's own priority.
    env["RAY_worker_niceness"] = "0"
    state = tmp / "head.json"
    any_python = [] if cluster.in_project_venv() else ["--any-python"]
    t0 = time.time()
    head_ports = _ports_args()
    worker_ports = head_ports
    while worker_ports[-2] == head_ports[-2]:         # each node its own worker-port range
        worker_ports = [a for a in _ports_args() if not a.startswith("--ray-client-server-port")]   # head only
    try:
        # every node on loopback: the test's traffic (and the raylet it kills) never leaves 127.0.0.1
        head = _start(["head", "--port", str(_free_port()), "--dashboard-port", str(_free_port()), "--num-cpus", "2",
                       "--node-ip-address", "127.0.0.1",
                       "--temp-dir", str(tmp / "r"), "--state", str(state)] + any_python + ["--"] + head_ports, env)
        nm_port = _free_port()
        worker = _start(["worker", "--state", str(state), "--num-cpus", "1", "--node-manager-port", str(nm_port),
                         "--object-manager-port", str(_free_port())] + any_python
                        + ["--", "--node-ip-address=127.0.0.1"] + worker_ports, env)
        yield dict(head=head, worker=worker, env=env, tmp=tmp, state=state, nm_port=nm_port,
                   start_s=time.time() - t0)
    finally:
        # both nodes by their own processes (the state file records the worker node's too), never `ray stop`
        cid = json.loads(state.read_text())["cluster_id"] if state.exists() else None
        if cid:
            r = subprocess.run(CLI + ["stop", "--state", str(state), "--grace", "3"], env=env, capture_output=True,
                               text=True, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)
        if cid:
            assert r.returncode == 0, r.stderr
            assert _with_marker(cid) == [], "processes of the stopped cluster are still running"


def _tagged(out: str, tag: str) -> list:
    return [json.loads(ln[len(tag) + 1:]) for ln in out.splitlines() if ln.startswith(tag + " ")]


def test_worker_node_lost_mid_ingest_every_document_once_and_identical(two_nodes):
    cl, t_test = two_nodes, time.time()
    tmp = cl["tmp"]
    head_raylet, worker_raylet = _raylet(cl["head"]["pids"]), _raylet(cl["worker"]["pids"], cl["nm_port"])
    # token authentication is on for both nodes (their raylets and every process they start)
    assert _auth_mode(head_raylet) == "token" and _auth_mode(worker_raylet) == "token"
    assert cl["worker"]["address"] == cl["head"]["address"]

    docs = _docs()
    corpus = write_jsonl(tmp / "corpus" / "c.jsonl", docs)
    out, ref = tmp / "out", tmp / "ref"
    cfg = {"corpus": str(corpus), "output": str(out), "model": MODEL, "notebank": TINY_NB, "block_size": 512,
           "docs_per_group": 1, "progress": False, "ray": {"address": cl["head"]["address"]},
           "actors": {"num_actors": 2, "num_cpus": 1, "torch_threads": 1}}
    records = tmp / "records.jsonl"
    script = tmp / "driver.py"
    script.write_text(DRIVER)
    # a driver process outside the repository (paths are absolute), connected with ray.address
    proc = subprocess.Popen([sys.executable, str(script), str(REPO), json.dumps(cfg), str(records), str(ref),
                             str(tmp / "ref.jsonl")], env=dict(cl["env"], RAY_AUTH_MODE="token"), cwd=str(tmp),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # node_of: pid -> the node whose raylet started it. The process trees are sampled as the run goes: an
    # actor lives from its start (model load) to the end of the run, so it is seen before its records.
    seen, node_of, kill_at = 0, {}, None
    deadline = time.time() + 480
    try:
        while proc.poll() is None and time.time() < deadline:
            for node, raylet in (("head", head_raylet), ("worker", worker_raylet)):
                for pid in _descendants(raylet):
                    if pid not in node_of:
                        node_of[pid] = node
            lines = records.read_text().splitlines() if records.exists() else []
            for ln in lines[seen:]:
                rec = json.loads(ln)
                if kill_at is None and node_of.get(rec["pid"]) == "worker" and rec["status"] == "ok":
                    os.kill(worker_raylet, signal.SIGKILL)      # the worker node fails mid-run
                    kill_at = {"t": time.time(), "records": len(lines),
                               "commits": len(list((out / "manifest" / "commits").glob("*.json")))}
            seen = len(lines)
            time.sleep(0.1)
        text = proc.communicate(timeout=max(1, deadline - time.time()))[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        text = proc.communicate()[0]
        pytest.fail(f"the driver did not finish within 480 s:\n{text[-4000:]}")
    t_end = time.time()
    if LOG_DIR:
        Path(LOG_DIR, "driver.log").write_text(text)
    assert proc.returncode == 0, text[-4000:]
    assert kill_at is not None, f"no record from the worker node's actor: {node_of}\n{text[-3000:]}"
    assert kill_at["commits"] < N_DOCS, "the worker node must be lost mid-run"
    nodes, summaries = _tagged(text, "NODES"), _tagged(text, "SUMMARY")
    assert len(nodes) == len(summaries) == 2, text[-4000:]
    assert len(nodes[0]) == 2 and cl["nm_port"] in nodes[0]   # both nodes alive at the start ...
    assert nodes[1] == [p for p in nodes[0] if p != cl["nm_port"]]   # ... the reference ran on the head alone
    assert summaries[0]["docs_failed"] == 0 and summaries[0]["docs_ok"] >= N_DOCS, summaries[0]
    assert summaries[1]["docs_ok"] == N_DOCS and summaries[1]["docs_failed"] == 0, summaries[1]

    recs = [json.loads(ln) for ln in records.read_text().splitlines()]
    after = [r for r in recs if r["t"] > kill_at["t"]]
    # Both nodes wrote, and the head went on after the loss (the worker node's actor may still deliver
    # the group it was finishing: its result goes straight to the driver, not through the raylet).
    writers = {r["pid"]: node_of.get(r["pid"]) for r in recs}
    assert set(writers.values()) == {"head", "worker"}, writers
    assert "head" in {writers[r["pid"]] for r in after}, (after, writers)
    # Every group not yet recorded at the loss was done after it, on the head: by the head's own actor or by
    # the lost actor restarted on the head's spare CPU (which of the two is Ray's scheduling, not ours; a CI
    # run saw the head's actor take them all).
    before = {r["doc_id"] for r in recs if r["t"] <= kill_at["t"]}
    late_from_worker = {r["doc_id"] for r in after if writers[r["pid"]] == "worker"}
    assert {d["doc_id"] for d in docs} - before - late_from_worker <= {
        r["doc_id"] for r in after if writers[r["pid"]] == "head"}
    assert {r["doc_id"] for r in recs} == {d["doc_id"] for d in docs}
    worker_pids = {pid for pid, n in writers.items() if n == "worker"}
    assert not [pid for pid in worker_pids if _alive(pid)], "the worker node's actor outlived its raylet"
    # every document exactly once, committed; no temporaries left
    rows = pds.dataset(str(out / "documents"), format="parquet").to_table().to_pylist()
    assert sorted(r["doc_id"] for r in rows) == [d["doc_id"] for d in docs]
    assert {r["status"] for r in rows} == {"ok"}
    assert len(list((out / "manifest" / "commits").glob("*.json"))) == N_DOCS
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    # the same bytes as the single-node run
    got, want = data_files(out), data_files(ref)
    assert sorted(got) == sorted(want) and len(got) > 2 * N_DOCS
    assert [k for k in got if got[k] != want[k]] == []
    by_pid = {f"{writers[pid]} {pid}": sorted(r["group"][-2:] for r in recs if r["pid"] == pid) for pid in writers}
    retried = text.count("will be retried")       # Ray's line for each actor task resubmitted after the loss
    t_rec = [r["t"] for r in recs]
    print(f"\nphases: first record {t_rec[0] - t_test:.1f} s, kill {kill_at['t'] - t_test:.1f} s, last record "
          f"{t_rec[-1] - t_test:.1f} s, driver done (reference included) {t_end - t_test:.1f} s")
    print(f"cluster start {cl['start_s']:.1f} s, test {time.time() - t_test:.1f} s; worker node lost after "
          f"{kill_at['commits']} of {N_DOCS} commits; groups by writer {by_pid}; {len(after)} records after the loss; "
          f"{retried} task retries logged")
