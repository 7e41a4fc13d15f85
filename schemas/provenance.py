"""Provenance of a result or an archive: the git commit, library versions, date, and the job's model
and config. Extra fields beside what a record is checked by (an archive's fingerprint, a result's
config hash), so adding them never invalidates existing archives or results."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata

PACKAGES = ("notebank", "torch", "transformers", "ray", "numpy", "pandas", "pyarrow")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The running job's model and config (pipeline/cli.py sets them once the config is checked).
JOB: dict = {}


def set_job(model: dict | None = None, config: dict | None = None, job: str | None = None) -> None:
    JOB.clear()
    JOB.update({k: v for k, v in (("job", job), ("model", model), ("config", config)) if v is not None})


def git_commit(repo: str = REPO) -> dict:
    """{"commit": sha or None, "dirty": bool or None} of the checkout the code runs from (None when
    it is not a git checkout, e.g. an installed wheel)."""
    try:
        sha = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip() or None
        dirty = None
        if sha:
            st = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10).stdout
            dirty = bool(st.strip())
    except (OSError, subprocess.SubprocessError):
        sha, dirty = None, None
    return {"commit": sha, "dirty": dirty}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def provenance(**extra) -> dict:
    """{"git": {...}, "versions": {...}, "date": UTC ISO time, "host": ..., + the job's model/config}."""
    return {"git": git_commit(), "versions": versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host": platform.node(), **JOB, **extra}
