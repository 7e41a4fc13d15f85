"""Haystack text for the RULER generators: RULER's noise sentences and an essay-like prose corpus.

Why this source: RULER's essay haystack is Paul Graham's essays, which RULER downloads at run
time and which are not redistributable. NoteBank must build its benchmarks offline, so the prose is
shipped inside the package: ``nbcore/tasks/data/prose.txt.gz`` (120 KB gzip, 300 KB of text, about
55K words, ~70K project tokens). It was made once from Debian's ``fortunes`` package (Debian
1:1.99.1-7.3, data files ``/usr/share/games/fortunes/*``: quotations, essay fragments and anecdotes
collected by the BSD fortune project) by ``build_prose`` below. Only multi-sentence English prose
entries are kept: poems, dialogues, code, definitions and ASCII art are dropped, attribution lines
(``-- Author``) are removed, whitespace is collapsed, and the paragraphs are joined in a fixed order.
It is repeated as needed, exactly as RULER repeats its essays. The collection is distributed under
the BSD licence of fortune-mod; ``nbcore/tasks/data/PROSE-COPYRIGHT`` is Debian's copyright file for
it. No system package is needed at run time. ``FORTUNES_DIR=/usr/share/games/fortunes`` rebuilds
the text from an installed ``fortunes`` instead (it must hash to ``PROSE_SHA256``); rebuild the
shipped file with ``python -m nbcore.tasks.haystack --rebuild DIR``.

Do not change the selection or cleaning without rebuilding the tokenizer and the shipped models:
the project tokenizer's merges were learned on this text.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import os
import re
from pathlib import Path

#: RULER's noise haystack sentence block (scripts/data/synthetic/niah.py, type_haystack=noise).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

#: The shipped prose and its sha256 (the text every shipped tokenizer/model and result was made on).
PROSE_FILE = Path(__file__).with_name("data") / "prose.txt.gz"
PROSE_SHA256 = "d83acc9a10ca9a9071e81650175a99381e83bc57ce622a75df2c11a1c3227b08"
#: Prose-heavy collections, in the fixed order they are concatenated.
PROSE_FILES = (
    "wisdom", "people", "work", "politics", "science", "art", "education", "law", "literature",
    "love", "medicine", "men-women", "miscellaneous", "humorists", "pets", "food", "sports",
    "platitudes", "fortunes", "goedel", "magic", "paradoxum", "kids", "news", "drugs",
)

_SENT_END = re.compile(r"[.!?][\"')]?$")
_BAD_LINE = re.compile(r"^\s*(--|\(\d|\d+[.)]|[A-Z][A-Za-z .]{0,20}:\s)")


class HaystackUnavailable(RuntimeError):
    """Raised when the prose text cannot be read (a damaged install, or a bad ``FORTUNES_DIR``)."""


def _clean_entry(entry: str) -> str | None:
    """One fortune -> one prose paragraph, or None when it is not plain prose."""
    lines = [ln for ln in entry.split("\n") if ln.strip()]
    body = []
    for ln in lines:
        if ln.lstrip().startswith("--"):  # attribution: ends the prose part
            break
        if ln.startswith(("\t", "  ")) or _BAD_LINE.match(ln):  # verse, dialogue, lists, code
            return None
        body.append(ln.strip())
    text = re.sub(r"\s+", " ", " ".join(body)).strip()
    if not text or not text.isascii() or len(text) < 80 or not _SENT_END.search(text):
        return None
    if sum(c.isalpha() for c in text) < 0.7 * len(text):
        return None
    if len(re.findall(r"[.!?](?:\s|$)", text)) < 2:  # want at least two sentences
        return None
    return text


def build_prose(fortunes_dir: str | Path) -> str:
    """Debian ``fortunes`` data files under ``fortunes_dir`` -> the prose corpus (paragraphs joined
    by single spaces). This is how ``data/prose.txt.gz`` was made."""
    fortunes_dir = Path(fortunes_dir)
    if not fortunes_dir.is_dir():
        raise HaystackUnavailable(f"{fortunes_dir}: no such folder (expected Debian's fortunes data files)")
    paras: list[str] = []
    for name in PROSE_FILES:
        path = fortunes_dir / name
        if not path.is_file():
            continue
        raw = path.read_text(encoding="utf-8", errors="replace")
        for entry in raw.split("\n%\n"):
            para = _clean_entry(entry)
            if para:
                paras.append(para)
    if not paras:
        raise HaystackUnavailable(f"no prose found under {fortunes_dir}")
    return " ".join(paras)


def read_shipped_prose(path: Path = PROSE_FILE) -> str:
    """The shipped prose, checked against ``PROSE_SHA256``."""
    try:
        text = gzip.decompress(path.read_bytes()).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise HaystackUnavailable(f"{path}: the shipped haystack prose is missing or damaged ({e}); "
                                  "reinstall the package") from e
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != PROSE_SHA256:
        raise HaystackUnavailable(f"{path}: sha256 {digest} is not the shipped prose's {PROSE_SHA256}")
    return text


@functools.lru_cache(maxsize=1)
def essay_text() -> str:
    """The whole prose corpus as one string: the shipped file, or rebuilt from ``$FORTUNES_DIR``."""
    src = os.environ.get("FORTUNES_DIR")
    if not src:
        return read_shipped_prose()
    text = build_prose(src)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != PROSE_SHA256:
        raise HaystackUnavailable(
            f"FORTUNES_DIR={src} gives prose with sha256 {digest}, not the shipped {PROSE_SHA256}: another "
            "fortunes release; unset FORTUNES_DIR to use the shipped text")
    return text


def essay_available() -> bool:
    try:
        essay_text()
        return True
    except HaystackUnavailable:
        return False


@functools.lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """Whitespace-split words of the corpus (RULER slices its essay haystack by words)."""
    return tuple(essay_text().split(" "))


def essay_slice(n_words: int, start: int = 0) -> str:
    """``n_words`` words of the corpus from word ``start``, cycling through it as needed."""
    return cycle_slice(essay_words(), n_words, start)


def cycle_slice(words, n_words: int, start: int = 0) -> str:
    """``n_words`` of ``words`` from index ``start``, cycling through them as needed, space-joined."""
    n = len(words)
    start %= n
    out: list[str] = []
    while len(out) < n_words:
        take = min(n - start, n_words - len(out))
        out.extend(words[start:start + take])
        start = 0
    return " ".join(out)


_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[\"'(A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Rule-based sentence split (stands in for nltk's ``sent_tokenize`` used by RULER)."""
    return [s for s in _SPLIT.split(text.strip()) if s]


def _main(argv=None) -> None:
    import argparse
    ap = argparse.ArgumentParser(description="Rebuild nbcore/tasks/data/prose.txt.gz from Debian's fortunes files")
    ap.add_argument("--rebuild", metavar="DIR", required=True, help="fortunes data folder, e.g. /usr/share/games/fortunes")
    ap.add_argument("--out", default=str(PROSE_FILE), help="output .gz (default: the shipped file)")
    args = ap.parse_args(argv)
    text = build_prose(args.rebuild)
    with open(args.out, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as g:
        g.write(text.encode("utf-8"))  # mtime 0, no name: the same text gives the same bytes
    print(f"{args.out}: {len(text)} characters, sha256 {hashlib.sha256(text.encode()).hexdigest()}")


if __name__ == "__main__":
    _main()
