"""Held-out haystack prose: English paragraphs from CPython's own documentation text.

The phrased tasks (``nbcore.tasks.phrased``) test whether a model that learned to read needles in
one kind of prose still reads them in another. Their TRAIN haystack is the project prose
(``haystack.essay_text``: Debian's ``fortunes`` collection, which the tokenizer and every shipped
model were trained on); their HELD-OUT haystack is this text, which no shipped model has seen and
which is unlike it in register (technical reference prose instead of quotations and anecdotes).

Source: the CPython 3.11.7 standard library (``Lib/``), made once by ``build_docs_prose`` below and
shipped as ``nbcore/tasks/data/docs_prose.txt.gz`` (checked against ``DOCS_PROSE_SHA256`` on load):

* the Python Language Reference topics of ``Lib/pydoc_data/topics.py`` (the text ``help()`` shows,
  generated from CPython's ``Doc/`` tree), unindented paragraphs only (grammar and code are indented);
* docstrings (module, class, function) of the ``Lib/`` modules that carry no copyright or licence
  notice of their own (any file mentioning "copyright" or "licen[cs]e" is skipped, and so are the
  folders that incorporate third-party code: asyncio, json, tomllib, ctypes, importlib, sqlite3,
  xmlrpc, lib2to3, distutils, encodings, ensurepip, idlelib, turtledemo, the test suites), so every
  paragraph kept is covered by CPython's own licence.

Licence: the Python Software Foundation License Version 2, which covers CPython's software and
documentation and permits redistribution of derived works provided PSF's licence agreement and
copyright notice are retained: ``nbcore/tasks/data/DOCS-PROSE-LICENSE`` records the source and
carries CPython 3.11.7's ``LICENSE`` verbatim.

Cleaning: typographic quotes and dashes become ASCII; paragraphs are kept when they are ASCII,
at least 100 characters, at least two sentences, end a sentence, start with a capital letter, are
mostly letters, and have no code markers (``>>>``, ``::=``, braces, backslashes, URLs, runs of 5+
digits, tokens of 30+ characters); duplicates are dropped; paragraphs are joined by single spaces in
a fixed order (topics sorted by name, then files sorted by path) and cut at the last whole
paragraph under ``MAX_CHARS``. Rebuild (same bytes only from the same CPython release):
``python -m nbcore.tasks.docprose --rebuild /path/to/cpython-3.11.7/Lib``.
"""
from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import re
from pathlib import Path

from nbcore.tasks.haystack import HaystackUnavailable

DOCS_PROSE_FILE = Path(__file__).with_name("data") / "docs_prose.txt.gz"
DOCS_PROSE_SHA256 = "b70fa53d81829bbf429857a63c7b19253e25c07d21557eab101d524acfd58dc2"
SOURCE_RELEASE = "CPython 3.11.7"
MAX_CHARS = 300_000

#: Lib/ folders skipped whole: test suites, tools, generated tables, and packages that incorporate
#: third-party code under other licences.
SKIP_DIRS = frozenset({
    "test", "tests", "idlelib", "turtledemo", "site-packages", "lib2to3", "pydoc_data", "ensurepip",
    "asyncio", "xmlrpc", "json", "tomllib", "ctypes", "importlib", "sqlite3", "encodings", "distutils",
})
_NOTICE = re.compile(r"copyright|licen[cs]e", re.I)
_ASCII = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-",
                        "\u2014": "-", "\u2026": "..."})
_CODE = re.compile(r"\d{5}|::=|>>>|[{}\\|@#$%`~^]|\bhttps?:|www\.|:$|\S{30}")
_UNDERLINE = re.compile(r"[*=\-^~]+")


def _paragraphs(text: str) -> list[str]:
    """Plain-prose paragraphs of one documentation text (blank-line separated blocks)."""
    out = []
    for block in re.split(r"\n\s*\n", text.translate(_ASCII)):
        lines = block.split("\n")
        if any(_UNDERLINE.fullmatch(ln.strip()) for ln in lines):  # a heading
            continue
        para = re.sub(r"\s+", " ", " ".join(ln.strip() for ln in lines)).strip()
        if not para or not para.isascii() or len(para) < 100 or not re.search(r"[.!?][\"')]?$", para):
            continue
        if sum(c.isalpha() for c in para) < 0.7 * len(para) or len(re.findall(r"[.!?](?:\s|$)", para)) < 2:
            continue
        if _CODE.search(para) or not re.match(r"[A-Z]", para) or re.match(r"\w+:", para):
            continue
        out.append(para)
    return out


def _topic_paragraphs(topics: dict) -> list[str]:
    out = []
    for name in sorted(topics):  # indented blocks are grammar productions and code
        blocks = [b for b in re.split(r"\n\s*\n", topics[name])
                  if not any(ln.startswith((" ", "\t")) for ln in b.split("\n"))]
        out += _paragraphs("\n\n".join(blocks))
    return out


def _docstring_paragraphs(lib: Path) -> list[str]:
    out = []
    for path in sorted(lib.rglob("*.py")):
        if set(path.relative_to(lib).parts[:-1]) & SKIP_DIRS:
            continue
        src = path.read_text(encoding="utf-8", errors="replace")
        if _NOTICE.search(src):  # a file with its own notice: not taken
            continue
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    out += _paragraphs(doc)
    return out


def build_docs_prose(lib_dir: str | Path) -> str:
    """A CPython ``Lib/`` folder -> the held-out prose (how ``data/docs_prose.txt.gz`` was made)."""
    lib = Path(lib_dir)
    topics_py = lib / "pydoc_data" / "topics.py"
    if not topics_py.is_file():
        raise HaystackUnavailable(f"{lib}: not a CPython Lib/ folder (no pydoc_data/topics.py)")
    scope: dict = {}
    exec(compile(topics_py.read_text(encoding="utf-8"), str(topics_py), "exec"), scope)  # a dict literal
    seen, paras, size = set(), [], 0
    for para in _topic_paragraphs(scope["topics"]) + _docstring_paragraphs(lib):
        if para in seen:
            continue
        if size + len(para) + 1 > MAX_CHARS:
            break
        seen.add(para)
        paras.append(para)
        size += len(para) + 1
    return " ".join(paras)


def read_docs_prose(path: Path = DOCS_PROSE_FILE) -> str:
    try:
        text = gzip.decompress(path.read_bytes()).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise HaystackUnavailable(f"{path}: the shipped held-out prose is missing or damaged ({e}); "
                                  "reinstall the package") from e
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != DOCS_PROSE_SHA256:
        raise HaystackUnavailable(f"{path}: sha256 {digest} is not the shipped held-out prose's {DOCS_PROSE_SHA256}")
    return text


@functools.lru_cache(maxsize=1)
def docs_text() -> str:
    return read_docs_prose()


@functools.lru_cache(maxsize=1)
def docs_words() -> tuple[str, ...]:
    return tuple(docs_text().split(" "))


def _main(argv=None) -> None:
    import argparse
    import sysconfig
    ap = argparse.ArgumentParser(description="Rebuild nbcore/tasks/data/docs_prose.txt.gz from a CPython Lib/ folder")
    ap.add_argument("--rebuild", metavar="LIB", nargs="?", const=sysconfig.get_paths()["stdlib"],
                    required=True, help=f"the Lib/ folder ({SOURCE_RELEASE} gives the shipped text; "
                                        "default: this interpreter's)")
    ap.add_argument("--out", default=str(DOCS_PROSE_FILE), help="output .gz (default: the shipped file)")
    args = ap.parse_args(argv)
    text = build_docs_prose(args.rebuild)
    with open(args.out, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as g:
        g.write(text.encode("utf-8"))  # mtime 0, no name: the same text gives the same bytes
    print(f"{args.out}: {len(text)} characters, {len(text.split())} words, "
          f"sha256 {hashlib.sha256(text.encode()).hexdigest()}")


if __name__ == "__main__":
    _main()
