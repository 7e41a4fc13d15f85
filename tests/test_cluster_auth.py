"""The README's cluster start (`python jobs/cluster.py head`) runs Ray with token authentication on:
a client without the token is refused, one with it runs a task with the venv's python, and
`python jobs/cluster.py stop` stops that head and nothing else (an independent Ray survives).

Everything runs in a temporary HOME (the token is $HOME/.ray/auth_token, Ray's default path) and a
short temporary Ray temp dir, on free random ports (agent ports too: the defaults such as 52365
collide with any other Ray on the machine), so the user's ~/.ray and /tmp/ray are never touched.
"""
from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, str(REPO / "jobs" / "cluster.py")]
RAY = str(Path(sys.executable).parent / "ray")
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
REFUSED = ("Authentication token is missing or incorrect", "InvalidAuthToken", "Unauthenticated")

# A client: connect, run one remote task, print what the worker saw.
CLIENT = r"""
import json, os, shutil, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
@ray.remote(num_cpus=0)
def where():
    return {"python": sys.executable, "which_python": shutil.which("python"),
            "auth_mode": os.environ.get("RAY_AUTH_MODE"), "pid": os.getpid()}
print("TASK " + json.dumps(ray.get(where.remote(), timeout=90)), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ports_args() -> list[str]:
    lo = random.randrange(20000, 31000, 100)     # own worker-port range, below the ephemeral ports
    return ["--disable-usage-stats", f"--dashboard-agent-listen-port={_free_port()}",
            f"--dashboard-agent-grpc-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
            f"--metrics-export-port={_free_port()}", f"--ray-client-server-port={_free_port()}",
            f"--min-worker-port={lo}", f"--max-worker-port={lo + 99}"]


def _clean_env(home: Path, tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
    env.update(HOME=str(home), RAY_TMPDIR=str(tmp), TOKENIZERS_PARALLELISM="false")
    return env


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"    # a zombie has exited
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _with_marker(cid: str) -> list[int]:
    """Live processes whose environment carries this cluster's marker."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if f"NOTEBANK_CLUSTER_ID={cid}".encode() in f.read().split(b"\0") and _alive(int(d)):
                        out.append(int(d))
            except OSError:
                continue
    return out


def _http(url: str, token: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


# ------------------------------------------------------------------------------------------------
# fast checks (no Ray started)


def test_token_file_is_private_and_reused(tmp_path, monkeypatch):
    from notebank.pipeline import cluster
    for v in AUTH_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    tok = cluster.ensure_token()
    path = tmp_path / ".ray" / "auth_token"
    assert tok["path"] == str(path) and tok["created"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0          # 256 random bits, hex (like Ray's generator)
    os.chmod(path, 0o644)
    os.chmod(path.parent, 0o755)
    again = cluster.ensure_token()
    assert not again["created"] and path.read_text() == token   # an existing token is kept ...
    assert stat.S_IMODE(path.stat().st_mode) == 0o600           # ... and made private again
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    # $RAY_AUTH_TOKEN_PATH is where Ray reads the token when it is set
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "private" / "tok"))
    assert cluster.ensure_token()["path"] == str(tmp_path / "private" / "tok")
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o700
    # the CLI: `token` prints the path, `token --show` the token
    env = _clean_env(tmp_path, tmp_path)
    r = subprocess.run(CLI + ["token", "--show"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == token, r.stderr


def test_head_refuses_a_python_outside_the_project_venv(tmp_path):
    base = Path(getattr(sys, "_base_executable", "") or "")
    if not base.is_file() or Path(sys.prefix).resolve() == Path(sys.base_prefix).resolve():
        pytest.skip("no base interpreter outside the venv to try")
    env = _clean_env(tmp_path, tmp_path)
    env.pop("VIRTUAL_ENV", None)
    r = subprocess.run([str(base), str(REPO / "jobs" / "cluster.py"), "head", "--state", str(tmp_path / "s.json")],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "not the project's environment" in r.stderr and "source .venv/bin/activate" in r.stderr
    assert not (tmp_path / ".ray").exists() and not (tmp_path / "s.json").exists()   # refused before anything


def test_worker_refuses_without_a_running_head_and_options_it_sets(tmp_path):
    """`worker` joins only a head recorded in --state that is running, and refuses `ray start` options
    it sets itself, before starting anything."""
    env = _clean_env(tmp_path, tmp_path)
    state = tmp_path / "head.json"
    base = CLI + ["worker", "--state", str(state), "--node-manager-port", "1", "--object-manager-port", "2",
                  "--any-python"]
    r = subprocess.run(base + ["--", "--head"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "'--head' after '--'" in r.stderr, r.stderr
    r = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"no head recorded in {state}" in r.stderr, r.stderr
    state.write_text(json.dumps({"cluster_id": secrets.token_hex(8), "address": "127.0.0.1:1",
                                 "processes": [{"pid": 1, "create_time": 0.0}]}))
    r = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "is not running" in r.stderr and "stop --state" in r.stderr, r.stderr
    assert not (tmp_path / ".ray").exists()              # refused before the token was even looked at


def test_cluster_yaml_distributes_the_token():
    """ray_cluster.yaml: the launching machine's ~/.ray/auth_token goes to every node (file_mounts reach
    the head on `ray up` and each worker through the head's autoscaler), is installed there as
    ~/.ray/auth_token 0600 in a 0700 ~/.ray before `RAY_AUTH_MODE=token ray start` (Ray's schema
    check is tests/test_configs.py)."""
    cfg = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    staged = [remote for remote, local in cfg["file_mounts"].items() if local == "~/.ray/auth_token"]
    assert staged, "file_mounts must carry the token"
    assert any("RAY_AUTH_MODE=token" in o for o in cfg["docker"]["run_options"])
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        cmds = cfg[key]
        start = [i for i, c in enumerate(cmds) if "ray start" in c]
        install = [i for i, c in enumerate(cmds) if staged[0] in c and "~/.ray/auth_token" in c]
        assert start and all("RAY_AUTH_MODE=token" in cmds[i] for i in start), key
        assert install and install[0] < start[0], f"{key}: the token must be installed before ray start"
        assert "chmod 700 ~/.ray" in cmds[install[0]] and "-m 600" in cmds[install[0]]


# ------------------------------------------------------------------------------------------------
# a real head, started the README's way


@pytest.fixture(scope="module")
def head():
    from notebank.pipeline import cluster
    tmp = Path(tempfile.mkdtemp(prefix="nbca-", dir="/tmp"))   # short: Ray's unix socket paths must fit
    home = tmp / "home"
    home.mkdir()
    env = _clean_env(home, tmp)
    state = tmp / "head.json"
    port, dash = _free_port(), _free_port()
    cmd = CLI + ["head", "--port", str(port), "--dashboard-port", str(dash), "--num-cpus", "1",
                 "--temp-dir", str(tmp / "r"), "--state", str(state)]
    if not cluster.in_project_venv():     # tests run from another venv (VENV=... make test)
        cmd.append("--any-python")
    cmd += ["--"] + _ports_args()
    t0 = time.time()
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    info = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    try:
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
        info.update(tmp=tmp, home=home, env=env, state=state, dash=dash, start_s=time.time() - t0,
                    stderr=r.stderr)
        yield info
    finally:
        if state.exists():     # a test failed before `stop`: stop it now, by the same command
            subprocess.run(CLI + ["stop", "--state", str(state), "--grace", "3"], env=env,
                           capture_output=True, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_head_starts_with_token_auth_and_private_dashboard(head):
    token_path = head["home"] / ".ray" / "auth_token"
    assert head["token"] == str(token_path)
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_path.parent.stat().st_mode) == 0o700
    assert head["session_dir"].startswith(str(head["tmp"] / "r"))          # the temp session dir
    st = json.loads(head["state"].read_text())
    assert st["address"] == head["address"] and st["session_dir"] == head["session_dir"] and st["processes"]
    assert "--dashboard-host=127.0.0.1" in st["command"] and st["python"] == sys.executable
    token = token_path.read_text().strip()
    url = head["dashboard_url"]
    assert url == f"http://127.0.0.1:{head['dash']}"
    assert _http(f"{url}/api/version") == 401                       # no token
    assert _http(f"{url}/api/version", secrets.token_hex(32)) == 403  # a wrong token
    assert _http(f"{url}/api/version", token) == 200
    # the dashboard listens on 127.0.0.1 only
    ip = head["address"].rsplit(":", 1)[0]
    if ip != "127.0.0.1":
        with socket.socket() as s:
            s.settimeout(5)
            assert s.connect_ex((ip, head["dash"])) != 0, "the dashboard must not listen on the node IP"
    # a second head with the same state file is refused while this one runs
    r = subprocess.run(CLI + ["head", "--state", str(head["state"])], env=head["env"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "is running" in r.stderr, r.stderr


@pytest.mark.slow
def test_client_without_the_token_is_refused_and_with_it_runs_a_task(head):
    addr, env = head["address"], head["env"]
    other_home = head["tmp"] / "intruder"
    other_home.mkdir(exist_ok=True)
    script = head["tmp"] / "client.py"
    script.write_text(CLIENT)
    fast = {"RAY_py_gcs_connect_timeout_s": "15"}   # how long a refused client keeps retrying (default 20)
    clients = {
        # no RAY_AUTH_MODE and no token anywhere: sends no token
        "no_token": dict(env, HOME=str(other_home), **fast),
        # token mode with a made-up token
        "wrong_token": dict(env, HOME=str(other_home), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
                            **fast),
        # the submitting user's setup: RAY_AUTH_MODE=token and the token in ~/.ray/auth_token
        "with_token": dict(env, RAY_AUTH_MODE="token"),
    }
    procs = {k: subprocess.Popen([sys.executable, str(script), addr], env=e, cwd=str(head["tmp"]),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k, e in clients.items()}
    out = {}
    for k, p in procs.items():
        try:
            out[k] = (p.communicate(timeout=180)[0], p.returncode)
        except subprocess.TimeoutExpired:
            p.kill()
            out[k] = (p.communicate()[0], "timeout")
    for k in ("no_token", "wrong_token"):
        text, rc = out[k]
        assert rc != 0 and "TASK " not in text, f"{k}: a client without the token ran a task:\n{text[-3000:]}"
        assert any(s in text for s in REFUSED), f"{k}: not refused for authentication:\n{text[-3000:]}"
    text, rc = out["with_token"]
    assert rc == 0, text[-3000:]
    task = json.loads(text.split("TASK ", 1)[1].splitlines()[0])
    venv_bin = str(Path(sys.executable).parent)
    assert task["auth_mode"] == "token"
    assert task["python"].startswith(venv_bin) and task["which_python"].startswith(venv_bin), task


@pytest.mark.slow
def test_stop_stops_this_head_only(head):
    """Last in this file: stops the module's head. Another Ray (plain `ray start --block`) survives."""
    tmp, env = head["tmp"], head["env"]
    other_tmp = Path(tempfile.mkdtemp(prefix="nbco-", dir="/tmp"))
    other_port, other_dash = _free_port(), _free_port()
    other_env = dict(env, RAY_TMPDIR=str(other_tmp), RAY_AUTH_MODE="token")
    log = open(other_tmp / "other.log", "w")
    other = subprocess.Popen([RAY, "start", "--head", "--block", f"--port={other_port}",
                              f"--dashboard-port={other_dash}", "--dashboard-host=127.0.0.1", "--num-cpus=1"]
                             + _ports_args(), env=other_env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        deadline = time.time() + 180
        while _http_ok(f"http://127.0.0.1:{other_dash}/api/authentication_mode") is False:
            assert other.poll() is None, (other_tmp / "other.log").read_text()[-3000:]
            assert time.time() < deadline, "the other Ray did not come up"
            time.sleep(0.5)
        other_pids = _descendants(other.pid)
        assert len(other_pids) > 3
        ours = [p["pid"] for p in json.loads(head["state"].read_text())["processes"]]
        assert not set(ours) & set(other_pids)

        assert all(_alive(p) for p in ours)
        t0 = time.time()
        r = subprocess.run(CLI + ["stop", "--state", str(head["state"]), "--grace", "5"], env=env,
                           capture_output=True, text=True, timeout=120)
        stop_s = time.time() - t0
        assert r.returncode == 0, r.stderr
        summary = json.loads(r.stdout.strip().splitlines()[-1])
        assert summary["running"] and summary["terminated"] + summary["killed"] >= len(ours)
        assert [p for p in ours if _alive(p)] == [], "processes of the stopped head are still running"
        assert _with_marker(head["cluster_id"]) == []
        assert not head["state"].exists()
        with socket.socket() as s:
            s.settimeout(5)
            assert s.connect_ex(("127.0.0.1", head["dash"])) != 0, "the stopped head's dashboard still answers"
        # the independent Ray is untouched and still answers
        assert other.poll() is None and all(_alive(p) for p in other_pids)
        assert _http_ok(f"http://127.0.0.1:{other_dash}/api/authentication_mode")
        # status / a second stop: not running
        r = subprocess.run(CLI + ["status", "--state", str(head["state"])], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1
        r = subprocess.run(CLI + ["stop", "--state", str(head["state"])], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and "nothing to stop" in r.stderr
        print(f"head start {head['start_s']:.1f} s, stop {stop_s:.1f} s")
    finally:
        pids = _descendants(other.pid)
        try:
            os.killpg(other.pid, signal.SIGTERM)     # its own process group (start_new_session)
            other.wait(15)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(other.pid, signal.SIGKILL)     # what did not exit on SIGTERM (the GCS can hang)
        except OSError:
            pass
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        other.wait(30)
        log.close()
        shutil.rmtree(other_tmp, ignore_errors=True)


def _http_ok(url: str) -> bool:
    try:
        return _http(url) == 200
    except (urllib.error.URLError, OSError):
        return False


def _descendants(pid: int) -> list[int]:
    import psutil
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []
