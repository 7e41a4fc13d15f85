"""The installed library (nbcore, pipeline, schemas, jobs) and the product benchmarks (bench/) never
import the tiny-model research in lab/, which is not installed."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("top", ["nbcore", "pipeline", "schemas", "jobs", "bench"])
def test_no_imports_of_lab(top):
    bad = []
    for path in sorted((REPO / top).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            bad += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "lab"]
    assert not bad, bad


def test_lab_is_not_packaged():
    import tomllib
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = cfg["tool"]["setuptools"]["packages"]          # an explicit list (tests/test_packaging.py)
    assert not any(p.split(".")[0] == "lab" or ".lab" in p for p in packages), packages
    assert not (REPO / "nbcore" / "training" / "backbone.py").exists()   # moved to lab/backbone.py
