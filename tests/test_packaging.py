"""What `pip install` puts on a user's machine: nbcore plus one `notebank` namespace (no generic
top-level `pipeline`, `jobs` or `schemas`), the console scripts, and the shipped data files."""
from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
MAPPED = {"pipeline": "notebank.pipeline", "jobs": "notebank.jobs", "schemas": "notebank.schemas"}
# Folders of shipped data inside a package: listed as packages too, or setuptools warns at every
# install ("Package 'nbcore.tasks.data' is absent from the `packages` configuration").
DATA_PACKAGES = {"nbcore.tasks.data"}


def _source_packages() -> set[str]:
    out = {"notebank", *DATA_PACKAGES}
    for top in ("nbcore", *MAPPED):
        for init in (REPO / top).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO).parts
            name = ".".join(rel)
            out.add(MAPPED[rel[0]] + name[len(rel[0]):] if rel[0] in MAPPED else name)
    return out


def test_data_packages_hold_data_only():
    for name in DATA_PACKAGES:
        folder = REPO.joinpath(*name.split("."))
        assert folder.is_dir() and not list(folder.glob("*.py")), folder


def test_package_list_matches_the_folders():
    setup = PYPROJECT["tool"]["setuptools"]
    assert set(setup["packages"]) == _source_packages()
    assert "package-dir" not in setup     # the folder links below carry the mapping
    for folder, name in MAPPED.items():
        link = REPO / name.replace(".", "/")
        assert link.is_symlink() and link.resolve() == REPO / folder, link


@pytest.mark.slow
def test_wheel_installs_one_namespace_and_console_scripts(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(REPO)], check=True, capture_output=True, timeout=300)
    whl = next((tmp_path / "dist").glob("notebank-*.whl"))
    names = zipfile.ZipFile(whl).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"nbcore", "notebank"}, tops
    assert "nbcore/tasks/data/prose.txt.gz" in names and "notebank/pipeline/dataplane.py" in names
    assert "nbcore/kernels/capture.c" in names            # the capture kernel's source, built on first use
    assert not any(n.startswith(("lab/", "bench/", "tests/")) for n in names)
    entry = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    for script in ("notebank-ingest", "notebank-query", "notebank-eval", "notebank-train-lora", "notebank-cluster"):
        assert script in entry
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(whl)],
                   check=True, capture_output=True, timeout=300)
    code = ("import importlib.util as u, notebank.pipeline.config as c, notebank.jobs.ingest, nbcore;"
            "assert c.__file__.startswith(%r), c.__file__;"
            "nbcore.open_archive;"
            "import nbcore.kernels.native as n; assert n.SOURCE.is_file(), n.SOURCE;"
            "print(u.find_spec('pipeline') is None and u.find_spec('jobs') is None)") % str(target)
    # outside the checkout, with the installed copy first on the path
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "True"
    r = subprocess.run([str(target / "bin" / "notebank-ingest"), "--help"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "notebank.chunk_size = 512" in r.stdout, r.stderr[-2000:]


def test_no_issue_numbers_in_product_code_configs_or_docs():
    import re
    pat = re.compile(r"\bissues? ?#?\d+\b|\(issue\b", re.I)
    paths = [p for top in ("nbcore", "pipeline", "schemas", "jobs", "configs", "models", "lab")
             for p in (REPO / top).rglob("*") if p.suffix in (".py", ".yaml", ".md")] + [REPO / "README.md"]
    bad = [f"{p.relative_to(REPO)}:{i + 1}" for p in paths
           for i, line in enumerate(p.read_text(errors="replace").splitlines()) if pat.search(line)]
    assert not bad, bad
