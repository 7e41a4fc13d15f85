"""Every first-party import in the installed code resolves for a static tool (an IDE's go-to-definition).

jedi reads the source as an editor would: nothing is imported or run. An import of `notebank.*` or
`nbcore.*` (or a relative one) counts as resolved when jedi lands in a file of this repository.
The `notebank` package maps pipeline/, jobs/ and schemas/ through real folder links
(notebank/pipeline -> ../pipeline, ...), not a run-time `__path__` change, so there is one copy of
each module and no `notebank.nbcore`, `notebank.tests` or `notebank.lab`.
"""
from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("pipeline", "jobs", "schemas", "nbcore", "notebank")
FIRST_PARTY = ("notebank", "nbcore")


def first_party_imports(path: Path) -> list[tuple[int, int, str]]:
    """(line, column, dotted name) of each first-party name imported in `path`; the column points at
    the imported name (or the module's last part for `import a.b`), where go-to-definition is asked."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = path.read_text().splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 0 and mod.split(".")[0] not in FIRST_PARTY:
                continue
            for alias in node.names:
                if alias.name == "*":
                    continue
                # find the alias on the statement's lines (it may span several)
                for ln in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                    col = _word_col(lines[ln - 1], alias.name)
                    if col is not None:
                        out.append((ln, col, "." * node.level + mod + ":" + alias.name))
                        break
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FIRST_PARTY:
                    last = alias.name.split(".")[-1]
                    col = _word_col(lines[node.lineno - 1], last)
                    if col is not None:
                        out.append((node.lineno, col, alias.name))
    return out


def _word_col(line: str, word: str) -> int | None:
    import re
    m = re.search(r"\b%s\b" % re.escape(word), line.split("#")[0])
    return m.start() if m else None


def unresolved_imports(folders=FOLDERS) -> tuple[int, list[str]]:
    import jedi
    project = jedi.Project(str(REPO), smart_sys_path=False, added_sys_path=[str(REPO)])
    n, bad = 0, []
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):   # rglob does not enter the folder links
            imports = first_party_imports(path)
            if not imports:
                continue
            script = jedi.Script(path=str(path), project=project)
            for line, col, what in imports:
                n += 1
                try:
                    names = script.goto(line, col, follow_imports=True)
                except Exception as e:  # noqa: BLE001 - jedi's own failures count as unresolved
                    names = []
                    what += f" ({type(e).__name__})"
                ok = any(d.module_path is not None and Path(d.module_path).resolve().is_relative_to(REPO)
                         for d in names)
                if not ok:
                    bad.append(f"{path.relative_to(REPO)}:{line}: {what}")
    return n, bad


@pytest.mark.slow
def test_every_first_party_import_resolves_statically():
    pytest.importorskip("jedi")
    n, bad = unresolved_imports()
    assert n > 200, n   # the check saw the imports (a walk that finds none must not pass)
    assert not bad, f"{len(bad)} of {n} imports unresolved:\n" + "\n".join(bad[:40])


def test_the_check_catches_an_unresolvable_import():
    pytest.importorskip("jedi")
    # one bad import in a throwaway module: the checker must flag exactly that one
    mod = REPO / "nbcore" / "_imports_probe_tmp.py"
    mod.write_text("from notebank.pipeline.config import ReadConfig\nfrom notebank.pipeline.no_such_module import x\n")
    try:
        _, bad = unresolved_imports(folders=("nbcore",))
    finally:
        mod.unlink()
    assert [b for b in bad if "_imports_probe_tmp" in b] == ["nbcore/_imports_probe_tmp.py:2: notebank.pipeline.no_such_module:x"]


def test_one_copy_of_each_module_and_no_stray_namespace():
    code = ("import importlib.util as u, nbcore.config as a, notebank.pipeline.config as p;"
            "import notebank.pipeline.config as q; assert p is q;"
            "print([u.find_spec(m) is None for m in ('notebank.nbcore', 'notebank.tests', 'notebank.lab')])")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[True, True, True]"
    assert importlib.util.find_spec("notebank") is not None
