"""The README is for users: short, with the data schemas and a local walkthrough that runs as written
(this test runs its blocks in order, in a scratch folder that links to the checkout)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
LINKED = ("jobs", "configs", "models", "nbcore", "notebank", "pipeline", "schemas", ".venv")


def walkthrough_blocks() -> list[tuple[str, str]]:
    """[(language, code)] of the fenced blocks right after a `<!-- walkthrough` comment."""
    pat = re.compile(r"<!-- walkthrough[^>]*-->\s*\n```(\w+)\n(.*?)\n```", re.S)
    return [(m.group(1), m.group(2)) for m in pat.finditer(README)]


def test_readme_is_short_and_has_what_a_user_needs():
    assert len(README.splitlines()) <= 200
    for needle in ("make run", "make test", "`doc_id`", "`text`", "`question_id`", "`question`", "`answers`",
                   "jobs/query.py -c configs/query.yaml", "bench/results/ruler/headline-tiny-gdn-v5.png"):
        assert needle in README, needle
    assert README.count("```bash\nmake run") == 1
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" not in link:
            assert (REPO / link).exists(), link
    kinds = [k for k, _ in walkthrough_blocks()]
    assert kinds == ["bash", "python"], kinds


@pytest.mark.slow
def test_walkthrough_runs_as_written(tmp_path):
    for name in LINKED:
        if (REPO / name).exists():
            os.symlink(REPO / name, tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if not (tmp_path / ".venv").exists():                       # an installed environment: use this python
        (tmp_path / ".venv" / "bin").mkdir(parents=True)
        os.symlink(sys.executable, tmp_path / ".venv" / "bin" / "python")
    for kind, code in walkthrough_blocks():
        cmd = ["bash", "-euo", "pipefail", "-c", code] if kind == "bash" else [str(tmp_path / ".venv/bin/python"), "-c", code]
        p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
        assert p.returncode == 0, (kind, p.stdout[-3000:], p.stderr[-3000:])
        if kind == "bash":
            assert "2 documents archived" in p.stdout and "method" in p.stdout and "95% CI" in p.stdout, p.stdout
        else:
            assert p.stdout.splitlines()[0].startswith("report-1 "), p.stdout
    assert (tmp_path / "out" / "archive" / "manifest" / "_run.json").exists()
    assert list((tmp_path / "out" / "answers").glob("part-*.parquet"))
