"""A local Ray head for NoteBank with token authentication on, and a stop that stops only that head.

    python jobs/cluster.py token [--show]     # create the token if there is none (0600, dir 0700)
    python jobs/cluster.py head [--port 6379 --dashboard-port 8265 ...] [-- EXTRA RAY START ARGS]
    python jobs/cluster.py worker [--num-cpus 1 --node-manager-port P ...] [-- EXTRA RAY START ARGS]
    python jobs/cluster.py status
    python jobs/cluster.py stop

Token authentication in Ray 2.60 (read from ray/_private/authentication/ and ray/_raylet.so):
- ``RAY_AUTH_MODE=token`` in the environment of ``ray start`` turns it on for every process of the
  cluster (GCS, raylet, dashboard, workers, job drivers inherit it); clients need it too: without it
  ``ray.init(address=...)`` and ``ray job submit`` send no token and are refused.
- The token is looked up in this order: ``$RAY_AUTH_TOKEN`` (the value), ``$RAY_AUTH_TOKEN_PATH``
  (a file), else ``~/.ray/auth_token`` (``$HOME/.ray/auth_token``), whitespace stripped. ``ray start``
  never creates one ("no authentication token was found"); ``ray get-auth-token --generate`` does,
  with the umask's permissions (usually 0644). ``token`` here writes it 0600 in a 0700 directory.

``head`` refuses to run from an interpreter other than the project's ``.venv`` (``--any-python``
accepts another one that has the dependencies, e.g. in a cluster image), starts
``python -m ray.scripts.scripts start --head`` from that interpreter with RAY_AUTH_MODE=token, the
dashboard and job API bound to 127.0.0.1, the interpreter's bin directory first on PATH (so a job's
``python`` is the venv's) and a marker variable (NOTEBANK_CLUSTER_ID) that every process of this
cluster inherits. It records the address, session directory and processes in a state file
(``runs/cluster/head.json`` by default). ``stop`` signals only the processes that carry this
cluster's marker or descend from its recorded processes (SIGTERM, then SIGKILL after ``--grace``
seconds): never a bare ``ray stop``, which stops every Ray on the machine.

``worker`` adds a node to the recorded head on this machine (``ray start --address``, its own ports,
the same token and marker), e.g. a second node for a multi-node test on one host; its processes are
recorded in the same state file, so ``stop`` stops it with the head. Nodes on other machines join
the usual way (``RAY_AUTH_MODE=token ray start --address=...`` there, with the token installed).

Only the standard library is imported at module level (psutil, which comes with ray, is imported
by the commands that need it), so the environment check can run under any interpreter.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import shlex
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv"
DEFAULT_STATE = REPO / "runs" / "cluster" / "head.json"
MARKER = "NOTEBANK_CLUSTER_ID"
DASHBOARD_HOST = "127.0.0.1"
# What a job needs importable on the head (nbcore/pipeline come from the submitted working dir).
DEPS = ("ray", "torch", "transformers", "tokenizers", "pyarrow", "safetensors", "peft", "fsspec", "yaml",
        "psutil")
# `ray start` options this CLI sets itself (or that would defeat it): refused after `--`.
OWNED_RAY_OPTIONS = ("--head", "--address", "--block", "--dashboard-host", "--port", "--dashboard-port",
                     "--temp-dir", "--num-cpus", "--num-gpus", "--node-ip-address")
# ... and those `worker` sets itself.
WORKER_OWNED_RAY_OPTIONS = ("--head", "--address", "--block", "--temp-dir", "--num-cpus", "--num-gpus",
                            "--node-manager-port", "--object-manager-port", "--port", "--dashboard-port",
                            "--dashboard-host")
EXIT_OK, EXIT_NOT_RUNNING, EXIT_ERROR = 0, 1, 2


class ClusterError(Exception):
    """A user-facing failure: printed as one message, exit status 2."""


# ----------------------------------------------------------------------------------------------
# token


def token_location() -> tuple[str, Path | None]:
    """Where Ray (C++ AuthenticationTokenLoader) takes the token from, highest precedence first."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return "RAY_AUTH_TOKEN", None
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return "RAY_AUTH_TOKEN_PATH", Path(os.environ["RAY_AUTH_TOKEN_PATH"]).expanduser().absolute()
    return "default", Path.home() / ".ray" / "auth_token"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def ensure_token(create: bool = True) -> dict:
    """The token Ray will use; created (256 random bits, hex, like Ray's own generator) if missing.

    The file is made 0600 and, when this creates the directory or the directory is Ray's own
    ``~/.ray``, the directory 0700. Returns {"source", "path", "created", "notes"}."""
    source, path = token_location()
    notes: list[str] = []
    if path is None:
        return {"source": source, "path": None, "created": False, "notes": notes}
    default_dir = source == "default"
    parent = path.parent
    if not parent.exists():
        if not create:
            raise ClusterError(f"no token at {path}; create one with: python jobs/cluster.py token")
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(parent, 0o700)
    elif _mode(parent) & 0o077:
        if default_dir:                                     # Ray's own ~/.ray
            os.chmod(parent, 0o700)
            notes.append(f"made {parent} 0700 (was {oct(_mode(parent))})")
        elif _mode(parent) & 0o022 and not _mode(parent) & stat.S_ISVTX:
            raise ClusterError(f"{parent} is writable by others ({oct(_mode(parent))}): anyone could replace the "
                               "token there. Point RAY_AUTH_TOKEN_PATH into a private (0700) directory")
        else:
            notes.append(f"warning: {parent} is {oct(_mode(parent))}, not 0700 (the token file itself is 0600)")
    created = False
    if not path.exists():
        if not create:
            raise ClusterError(f"no token at {path}; create one with: python jobs/cluster.py token")
        tmp = parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)          # never replaces a token another process just wrote
                created = True
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
    if not path.is_file():
        raise ClusterError(f"{path} is not a regular file")
    st = path.stat()
    if st.st_uid != os.getuid():
        raise ClusterError(f"{path} belongs to uid {st.st_uid}, not to this user: refusing to use it")
    if stat.S_IMODE(st.st_mode) != 0o600:
        os.chmod(path, 0o600)
        notes.append(f"made {path} 0600 (was {oct(stat.S_IMODE(st.st_mode))})")
    if not path.read_text().strip():
        raise ClusterError(f"{path} is empty: delete it (a new token is then created) or write a token into it")
    return {"source": source, "path": str(path), "created": created, "notes": notes}


def read_token() -> str:
    source, path = token_location()
    return os.environ["RAY_AUTH_TOKEN"].strip() if path is None else path.read_text().strip()


# ----------------------------------------------------------------------------------------------
# environment


def in_project_venv() -> bool:
    try:
        return Path(sys.prefix).resolve() == VENV.resolve()
    except OSError:
        return False


def check_environment(any_python: bool = False) -> None:
    """Refuse an interpreter that is not the project's .venv (unless any_python) or lacks the deps."""
    activate = ("source .venv/bin/activate   # (create it first with `make venv`)\n"
                "  python jobs/cluster.py head ...\n"
                "or run it as .venv/bin/python jobs/cluster.py head ...")
    if not any_python and not in_project_venv():
        where = "does not exist yet" if not VENV.exists() else "is not the running interpreter"
        raise ClusterError(
            f"{sys.executable} (prefix {sys.prefix}) is not the project's environment: {VENV} {where}. "
            f"The head's python is the one every job runs with, so start it from the project's venv:\n  {activate}\n"
            "(--any-python accepts this interpreter if it has the project's dependencies, e.g. a cluster image.)")
    missing = [m for m in DEPS if importlib.util.find_spec(m) is None]
    if missing:
        raise ClusterError(f"{sys.executable} lacks the project's dependencies {missing}: a job started on this "
                           f"head could not run. Install them (make venv, or pip install -e .), then:\n  {activate}")


# ----------------------------------------------------------------------------------------------
# state and processes


def load_state(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot read the state file {path}: {e}")


def _write_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, path)


def _alive(p) -> bool:
    import psutil
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _self_and_ancestors() -> set[int]:
    import psutil
    me = psutil.Process()
    return {me.pid, *(a.pid for a in me.parents())}


def cluster_processes(state: dict) -> list:
    """Live processes of the recorded cluster: those whose environment carries its marker, the
    recorded ones (same pid and start time) and every descendant of either."""
    import psutil
    cid, uid, skip = state["cluster_id"], os.getuid(), _self_and_ancestors()
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["uids"]):
        try:
            if p.pid in skip or p.info["uids"] is None or p.info["uids"].real != uid:
                continue
            if p.environ().get(MARKER) == cid:
                found[p.pid] = p
        except (psutil.Error, OSError):
            continue
    for rec in state.get("processes", []):
        try:
            p = psutil.Process(rec["pid"])
            if abs(p.create_time() - rec["create_time"]) < 0.5 and p.pid not in skip:
                found.setdefault(p.pid, p)
        except psutil.Error:
            continue
    for p in list(found.values()):
        try:
            for c in p.children(recursive=True):
                if c.pid not in skip:
                    found.setdefault(c.pid, c)
        except psutil.Error:
            continue
    return sorted((p for p in found.values() if _alive(p)), key=lambda p: p.pid)


def _describe(procs) -> list[dict]:
    import psutil
    out = []
    for p in procs:
        try:
            out.append({"pid": p.pid, "pgid": os.getpgid(p.pid), "name": p.name(), "create_time": p.create_time()})
        except (psutil.Error, OSError):
            continue
    return out


def _terminate(procs, grace: float) -> tuple[int, int]:
    """SIGTERM, wait up to `grace` s, SIGKILL what is left. Returns (terminated, killed)."""
    import psutil
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    deadline = time.time() + grace
    alive = list(procs)
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _alive(p)]
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    deadline = time.time() + 10
    left = list(alive)
    while left and time.time() < deadline:
        time.sleep(0.1)
        left = [p for p in left if _alive(p)]
    if left:
        raise ClusterError(f"processes {[p.pid for p in left]} survived SIGKILL")
    return len(procs) - len(alive), len(alive)


def _gcs_info(procs) -> dict:
    import psutil
    for p in procs:
        try:
            if p.name() != "gcs_server":
                continue
            args = dict(a[2:].split("=", 1) for a in p.cmdline()[1:] if a.startswith("--") and "=" in a)
            return {"session_dir": args.get("session-dir"), "node_ip": args.get("node-ip-address"),
                    "gcs_port": int(args["gcs_server_port"]) if args.get("gcs_server_port") else None}
        except (psutil.Error, ValueError):
            continue
    return {}


# ----------------------------------------------------------------------------------------------
# dashboard checks


def _http(url: str, token: str | None = None, timeout: float = 5.0) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _wait_dashboard(url: str, token: str, timeout: float, proc_alive) -> str:
    """Wait until the dashboard answers; check that it enforces the token. Returns its auth mode."""
    deadline = time.time() + timeout
    while True:
        try:
            code, body = _http(f"{url}/api/authentication_mode")
            if code == 200:
                mode = json.loads(body).get("authentication_mode")
                if mode != "token":
                    raise ClusterError(f"the dashboard at {url} reports authentication mode {mode!r}, not 'token'")
                no_token, _ = _http(f"{url}/api/version")
                with_token, _ = _http(f"{url}/api/version", token)
                if no_token != 401 or with_token != 200:
                    raise ClusterError(f"the dashboard at {url} answered {no_token} without the token and "
                                       f"{with_token} with it (expected 401 / 200)")
                return mode
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.time() > deadline:
            raise ClusterError(f"the dashboard at {url} did not answer within {timeout:.0f} s")
        if not proc_alive():
            raise ClusterError("the Ray head's processes exited while waiting for the dashboard")
        time.sleep(0.5)


# ----------------------------------------------------------------------------------------------
# commands


def _token_line(tok: dict) -> str:
    if tok["path"] is None:
        return "token      from $RAY_AUTH_TOKEN (every process of the cluster inherits it)"
    p = Path(tok["path"])
    return f"token      {p} ({oct(_mode(p))}, directory {p.parent} {oct(_mode(p.parent))})"


def cmd_token(args) -> int:
    tok = ensure_token(create=not args.no_create)
    for n in tok["notes"]:
        print(n, file=sys.stderr)
    if args.show:
        print(read_token())
    else:
        print(_token_line(tok).split(None, 1)[1] + (" [created]" if tok["created"] else ""))
    return EXIT_OK


def _node_env(cid: str, tok: dict) -> dict:
    """The environment of `ray start` for a node of cluster `cid`: token auth on, the marker, this
    interpreter's bin first on PATH (a job's `python`), the token's file if it is not the default."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update({"RAY_AUTH_MODE": "token", MARKER: cid})
    bindir = str(Path(sys.executable).parent)           # not resolved: the venv's bin, not the base python's
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    if in_project_venv():
        env["VIRTUAL_ENV"] = sys.prefix
        env.pop("PYTHONHOME", None)
    if tok["source"] == "RAY_AUTH_TOKEN_PATH":
        env["RAY_AUTH_TOKEN_PATH"] = tok["path"]
    return env


def start_head(args) -> dict:
    check_environment(args.any_python)
    state_path = Path(args.state).absolute()
    old = load_state(state_path)
    if old and cluster_processes(old):
        raise ClusterError(f"the head recorded in {state_path} is running (address {old.get('address')}); "
                           f"stop it first: python jobs/cluster.py stop" +
                           ("" if state_path == DEFAULT_STATE else f" --state {state_path}") +
                           ", or start another one with its own --state, ports and --temp-dir")
    for a in args.ray_args:
        if a.split("=", 1)[0] in OWNED_RAY_OPTIONS:
            raise ClusterError(f"{a!r} after '--': this command sets that itself "
                               "(see --help; the dashboard always binds to 127.0.0.1)")
    tok = ensure_token(create=True)
    token = read_token()

    cid = secrets.token_hex(8)
    env = _node_env(cid, tok)
    temp_dir = str(Path(args.temp_dir).absolute()) if args.temp_dir else None
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={args.port}",
           f"--dashboard-host={DASHBOARD_HOST}", f"--dashboard-port={args.dashboard_port}"]
    if args.num_cpus is not None:
        cmd.append(f"--num-cpus={args.num_cpus}")
    if args.num_gpus is not None:
        cmd.append(f"--num-gpus={args.num_gpus}")
    if temp_dir:
        cmd.append(f"--temp-dir={temp_dir}")
    if args.node_ip_address:
        cmd.append(f"--node-ip-address={args.node_ip_address}")
    cmd += args.ray_args

    state_path.parent.mkdir(parents=True, exist_ok=True)
    log_path = state_path.with_suffix(".log")
    state = {"cluster_id": cid, "state_file": str(state_path), "log": str(log_path), "command": cmd,
             "python": sys.executable, "token": tok["path"] or "$RAY_AUTH_TOKEN", "processes": [],
             "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _write_state(state_path, state)     # before the start: a failed start can still be stopped
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    state["pgid"] = proc.pid

    def fail(msg: str):
        try:
            _terminate(cluster_processes(state), 5)
        finally:
            state_path.unlink(missing_ok=True)
        tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
        raise ClusterError(f"{msg}\n--- {log_path} (last lines) ---\n{tail}")

    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        fail(f"`ray start --head` did not finish within {args.timeout:.0f} s")
    if rc != 0:
        fail(f"`ray start --head` exited with status {rc}")
    procs = cluster_processes(state)
    info = _gcs_info(procs)
    if not info.get("session_dir"):
        fail("`ray start --head` returned but no GCS process of this cluster is running")
    url = f"http://{DASHBOARD_HOST}:{args.dashboard_port}"
    dashboard = not any(a.replace(" ", "") in ("--include-dashboard=false", "--include-dashboard=False")
                        for a in args.ray_args)
    try:
        auth_mode = _wait_dashboard(url, token, args.timeout, lambda: bool(cluster_processes(state))) \
            if dashboard else "token"
    except ClusterError as e:
        fail(str(e))
    address = f"{info['node_ip']}:{info['gcs_port'] or args.port}"
    if temp_dir is None:
        env_tmp = env.get("RAY_TMPDIR") or (env.get("TMPDIR") if sys.platform.startswith("linux") else None) or "/tmp"
        temp_dir = os.path.join(env_tmp, "ray")
    state.update(address=address, node_ip=info["node_ip"], gcs_port=info["gcs_port"] or args.port,
                 dashboard_url=url if dashboard else None, session_dir=info["session_dir"], temp_dir=temp_dir,
                 auth_mode=auth_mode, processes=_describe(cluster_processes(state)))
    _write_state(state_path, state)
    return {"state": state, "token": tok}


def _stop_hint(state_path: Path) -> str:
    return "python jobs/cluster.py stop" + ("" if state_path == DEFAULT_STATE else f" --state {shlex.quote(str(state_path))}")


def cmd_head(args) -> int:
    out = start_head(args)
    state, tok = out["state"], out["token"]
    for n in tok["notes"]:
        print(n, file=sys.stderr)
    state_path = Path(state["state_file"])
    api = state["dashboard_url"] or "(no dashboard)"
    print("\n".join([
        "Ray head started with token authentication (RAY_AUTH_MODE=token)",
        f"  address    {state['address']}",
        f"  dashboard  {api}  (job API; bound to 127.0.0.1 only: use an SSH tunnel from elsewhere)",
        "  " + _token_line(tok) + (" [created]" if tok["created"] else ""),
        f"  python     {state['python']}  (first on the head's PATH: jobs run with it)",
        f"  session    {state['session_dir']}",
        f"  processes  {len(state['processes'])} (process group {state['pgid']})",
        f"  state      {state_path}",
        "Submit a job:",
        f"  RAY_AUTH_MODE=token RAY_API_SERVER_ADDRESS={api} ray job submit --working-dir . -- python jobs/...",
        "Connect from Python: RAY_AUTH_MODE=token RAY_ADDRESS=" + state["address"] + " python ...",
        f"Stop this head only: {_stop_hint(state_path)}",
    ]), file=sys.stderr)
    print(json.dumps({"address": state["address"], "dashboard_url": state["dashboard_url"],
                      "session_dir": state["session_dir"], "token": state["token"], "state": str(state_path),
                      "cluster_id": state["cluster_id"], "pids": [p["pid"] for p in state["processes"]]}), flush=True)
    return EXIT_OK


def _node_manager_port(proc) -> int | None:
    for a in proc.cmdline()[1:]:
        if a.startswith("--node_manager_port="):
            return int(a.split("=", 1)[1])
    return None


def _alive_node_ports(dashboard_url: str, token: str) -> set[int]:
    """Node-manager ports of the nodes the head's dashboard lists as alive."""
    code, body = _http(f"{dashboard_url}/nodes?view=summary", token)
    if code != 200:
        return set()
    return {int(n["raylet"]["nodeManagerPort"]) for n in json.loads(body)["data"]["summary"]
            if n.get("raylet", {}).get("state") == "ALIVE" and n["raylet"].get("nodeManagerPort")}


def start_worker(args) -> dict:
    """Add a node on this machine to the head recorded in args.state; record its processes there."""
    import psutil
    check_environment(args.any_python)
    for a in args.ray_args:
        if a.split("=", 1)[0] in WORKER_OWNED_RAY_OPTIONS:
            raise ClusterError(f"{a!r} after '--': this command sets that itself (see --help)")
    state_path = Path(args.state).absolute()
    state = load_state(state_path)
    if state is None or not state.get("address"):
        raise ClusterError(f"no head recorded in {state_path}: start one first: python jobs/cluster.py head"
                           + ("" if state_path == DEFAULT_STATE else f" --state {shlex.quote(str(state_path))}"))
    before = cluster_processes(state)
    if not before:
        raise ClusterError(f"the head recorded in {state_path} is not running (stale state: "
                           f"{_stop_hint(state_path)} removes it)")
    tok = ensure_token(create=False)             # the head's token: a node without it is refused
    token = read_token()
    env = _node_env(state["cluster_id"], tok)
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", f"--address={state['address']}",
           f"--node-manager-port={args.node_manager_port}", f"--object-manager-port={args.object_manager_port}"]
    if args.num_cpus is not None:
        cmd.append(f"--num-cpus={args.num_cpus}")
    if args.num_gpus is not None:
        cmd.append(f"--num-gpus={args.num_gpus}")
    temp_dir = args.temp_dir or state.get("temp_dir")
    if temp_dir:
        cmd.append(f"--temp-dir={Path(temp_dir).absolute()}")
    cmd += args.ray_args
    n = len(state.get("workers", []))
    log_path = state_path.with_suffix(f".worker-{n}.log")
    old = {p.pid for p in before}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def new_procs():
        """This node's processes: the cluster's new ones, less those the head's processes started meanwhile."""
        out = []
        for p in cluster_processes(state):
            try:
                if p.pid not in old and p.pid != proc.pid and not {a.pid for a in p.parents()} & old:
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def fail(msg: str):
        try:
            _terminate(new_procs(), 5)
        finally:
            tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
        raise ClusterError(f"{msg}\n--- {log_path} (last lines) ---\n{tail}")

    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        fail(f"`ray start --address={state['address']}` did not finish within {args.timeout:.0f} s")
    if rc != 0:
        fail(f"`ray start --address={state['address']}` exited with status {rc}")
    raylets = []
    for p in new_procs():
        try:
            if p.name() == "raylet" and _node_manager_port(p) == args.node_manager_port:
                raylets.append(p)
        except psutil.Error:
            continue
    if not raylets:
        fail("`ray start --address` returned but no raylet of the new node is running")
    if state.get("dashboard_url"):           # the head lists the node as alive: it joined (with the token)
        deadline = time.time() + args.timeout
        while args.node_manager_port not in _alive_node_ports(state["dashboard_url"], token):
            if time.time() > deadline:
                fail(f"the head at {state['address']} does not list the node on port {args.node_manager_port} "
                     f"as alive after {args.timeout:.0f} s")
            if not _alive(raylets[0]):
                fail("the new node's raylet exited")
            time.sleep(0.5)
    procs = _describe(new_procs())
    worker = {"node_manager_port": args.node_manager_port, "object_manager_port": args.object_manager_port,
              "command": cmd, "log": str(log_path), "processes": procs,
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    state = load_state(state_path) or state
    state.setdefault("workers", []).append(worker)
    state["processes"] = state.get("processes", []) + procs    # `stop` finds them even without the marker
    _write_state(state_path, state)
    return {"address": state["address"], "node_manager_port": args.node_manager_port, "state": str(state_path),
            "log": str(log_path), "pids": [p["pid"] for p in procs]}


def cmd_worker(args) -> int:
    out = start_worker(args)
    print(f"worker node joined {out['address']} (node manager port {out['node_manager_port']}, "
          f"{len(out['pids'])} processes); {_stop_hint(Path(out['state']))} stops it with the head", file=sys.stderr)
    print(json.dumps(out), flush=True)
    return EXIT_OK


def stop_head(state_path: Path, grace: float) -> dict:
    state = load_state(state_path)
    if state is None:
        return {"state": str(state_path), "running": False, "terminated": 0, "killed": 0}
    procs = cluster_processes(state)
    terminated, killed = _terminate(procs, grace) if procs else (0, 0)
    late = cluster_processes(state)           # anything spawned while stopping (a restarted worker)
    if late:
        t2, k2 = _terminate(late, 2)
        terminated, killed = terminated + t2, killed + k2
    # the "latest cluster" file that a bare ray.init() / `ray status` would follow, if it points here
    if state.get("temp_dir") and state.get("address"):
        current = Path(state["temp_dir"]) / "ray_current_cluster"
        try:
            if current.read_text().strip() == state["address"]:
                current.unlink()
        except OSError:
            pass
    state_path.unlink(missing_ok=True)
    return {"state": str(state_path), "running": bool(procs), "address": state.get("address"),
            "terminated": terminated, "killed": killed, "pids": [p.pid for p in procs]}


def cmd_stop(args) -> int:
    state_path = Path(args.state).absolute()
    if not state_path.exists():
        print(f"no head recorded in {state_path}: nothing to stop (other Ray clusters on this machine are "
              "never touched by this command)", file=sys.stderr)
        print(json.dumps({"state": str(state_path), "running": False, "terminated": 0, "killed": 0}))
        return EXIT_NOT_RUNNING
    out = stop_head(state_path, args.grace)
    if out["running"]:
        print(f"stopped the head at {out['address']}: {out['terminated']} processes exited on SIGTERM, "
              f"{out['killed']} were killed after {args.grace:g} s", file=sys.stderr)
    else:
        print(f"the head recorded in {state_path} was not running; state removed", file=sys.stderr)
    print(json.dumps(out), flush=True)
    return EXIT_OK


def cmd_status(args) -> int:
    state_path = Path(args.state).absolute()
    state = load_state(state_path)
    if state is None:
        print(f"no head recorded in {state_path}", file=sys.stderr)
        print(json.dumps({"state": str(state_path), "running": False}))
        return EXIT_NOT_RUNNING
    procs = cluster_processes(state)
    out = {"state": str(state_path), "running": bool(procs), "address": state.get("address"),
           "dashboard_url": state.get("dashboard_url"), "session_dir": state.get("session_dir"),
           "token": state.get("token"), "python": state.get("python"), "pids": [p.pid for p in procs]}
    if procs and state.get("dashboard_url"):
        try:
            code, body = _http(f"{state['dashboard_url']}/api/authentication_mode", timeout=3)
            out["auth_mode"] = json.loads(body).get("authentication_mode") if code == 200 else f"HTTP {code}"
        except (urllib.error.URLError, OSError, ValueError) as e:
            out["auth_mode"] = f"unreachable ({e})"
    print(json.dumps(out), flush=True)
    if procs:
        print(f"running: {state.get('address')}, {len(procs)} processes; submit with RAY_AUTH_MODE=token "
              f"RAY_API_SERVER_ADDRESS={state.get('dashboard_url')} ray job submit ...", file=sys.stderr)
    else:
        print(f"not running (stale state {state_path}; `stop` removes it)", file=sys.stderr)
    return EXIT_OK if procs else EXIT_NOT_RUNNING


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python jobs/cluster.py",
        description="Start, inspect and stop a NoteBank Ray head with token authentication on.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The token lives where Ray reads it: $RAY_AUTH_TOKEN_PATH if set, else ~/.ray/auth_token\n"
               "(file 0600, directory 0700). Clients need RAY_AUTH_MODE=token and that token:\n"
               "  RAY_AUTH_MODE=token RAY_API_SERVER_ADDRESS=http://127.0.0.1:8265 ray job submit ...\n"
               "Exit status: 0 ok, 1 not running (status/stop), 2 refused or failed.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{head,worker,stop,status,token}")

    def state_arg(sp):
        sp.add_argument("--state", default=str(DEFAULT_STATE),
                        help="file recording what `head` started (default: %(default)s)")

    h = sub.add_parser("head", help="create the token if missing and start a Ray head with token auth",
                       usage="python jobs/cluster.py head [options] [-- RAY_START_ARGS ...]",
                       description="Create the token if missing, then start a Ray head with RAY_AUTH_MODE=token, "
                                   "the dashboard/job API on 127.0.0.1, and this venv's python for jobs. "
                                   "Arguments after '--' go to `ray start` unchanged.")
    h.add_argument("--port", type=int, default=6379, help="GCS port (default %(default)s)")
    h.add_argument("--dashboard-port", type=int, default=8265,
                   help="dashboard + job API port on 127.0.0.1 (default %(default)s)")
    h.add_argument("--num-cpus", type=int, default=None, help="CPUs the head offers (default: all)")
    h.add_argument("--num-gpus", type=int, default=None, help="GPUs the head offers (default: detected)")
    h.add_argument("--temp-dir", default=None, help="Ray's temp/session root (default: $RAY_TMPDIR/ray or /tmp/ray)")
    h.add_argument("--node-ip-address", default=None, help="the IP other nodes reach this head on")
    h.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the head (default %(default)s)")
    h.add_argument("--any-python", action="store_true",
                   help="accept an interpreter other than the project's .venv if it has the dependencies")
    state_arg(h)
    h.set_defaults(func=cmd_head)

    w = sub.add_parser("worker", help="add a node on this machine to the recorded head (stopped with it)",
                       usage="python jobs/cluster.py worker [options] [-- RAY_START_ARGS ...]",
                       description="Start `ray start --address=<the recorded head>` with RAY_AUTH_MODE=token, the "
                                   "head's token and marker, on its own ports: a second node on one machine. Its "
                                   "processes go into the state file; `stop` stops them with the head. Pass the "
                                   "other per-node ports (--min-worker-port, --dashboard-agent-listen-port, ...) "
                                   "after '--' when another Ray runs on this machine.")
    w.add_argument("--num-cpus", type=int, default=None, help="CPUs the node offers (default: all)")
    w.add_argument("--num-gpus", type=int, default=None, help="GPUs the node offers (default: detected)")
    w.add_argument("--node-manager-port", type=int, required=True, help="the node's raylet port")
    w.add_argument("--object-manager-port", type=int, required=True, help="the node's object manager port")
    w.add_argument("--temp-dir", default=None, help="Ray's temp root for this node (default: the head's)")
    w.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the node (default %(default)s)")
    w.add_argument("--any-python", action="store_true",
                   help="accept an interpreter other than the project's .venv if it has the dependencies")
    state_arg(w)
    w.set_defaults(func=cmd_worker)

    s = sub.add_parser("stop", help="stop the head recorded in --state (only that one)")
    s.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default %(default)s)")
    state_arg(s)
    s.set_defaults(func=cmd_stop)

    st = sub.add_parser("status", help="is the recorded head running? (exit 0 yes, 1 no)")
    state_arg(st)
    st.set_defaults(func=cmd_status)

    t = sub.add_parser("token", help="create the token if missing (0600, dir 0700) and print its path")
    t.add_argument("--show", action="store_true", help="print the token itself (to copy it to a submitting machine)")
    t.add_argument("--no-create", action="store_true", help="fail instead of creating a missing token")
    t.set_defaults(func=cmd_token)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ray_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, ray_args = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    if ray_args and args.command not in ("head", "worker"):
        build_parser().error("arguments after '--' are for `head` and `worker` only")
    args.ray_args = ray_args
    try:
        return args.func(args)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
