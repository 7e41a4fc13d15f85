"""Haystack text for the RULER generators: RULER's noise sentences and an essay-like prose corpus.

Why this source: RULER's essay haystack is Paul Graham's essays, which RULER downloads at run
time and which are not redistributable. NoteBank must build its benchmarks offline from
installed packages only, so the prose comes from Debian's ``fortunes`` package (data files
``/usr/share/games/fortunes/*``; ``apt-get install fortunes``, Debian 1:1.99.1-7.3; quotations,
essay fragments and anecdotes collected by the BSD fortune project, shipped as plain text). Only
multi-sentence English prose entries are kept: poems, dialogues, code, definitions and ASCII art
are dropped, attribution lines (``-- Author``) are removed, whitespace is collapsed. The result
(about 55K words, 300 KB, ~70K project tokens) is joined in a fixed order and repeated as needed,
exactly as RULER repeats its essays. ``FORTUNES_DIR`` can point elsewhere.

Do not change the selection or cleaning without rebuilding the tokenizer and the shipped models:
the project tokenizer's merges were learned on this text.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

#: RULER's noise haystack sentence block (scripts/data/synthetic/niah.py, type_haystack=noise).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

FORTUNES_DIR = Path(os.environ.get("FORTUNES_DIR", "/usr/share/games/fortunes"))
#: Prose-heavy collections, in the fixed order they are concatenated.
PROSE_FILES = (
    "wisdom", "people", "work", "politics", "science", "art", "education", "law", "literature",
    "love", "medicine", "men-women", "miscellaneous", "humorists", "pets", "food", "sports",
    "platitudes", "fortunes", "goedel", "magic", "paradoxum", "kids", "news", "drugs",
)

_SENT_END = re.compile(r"[.!?][\"')]?$")
_BAD_LINE = re.compile(r"^\s*(--|\(\d|\d+[.)]|[A-Z][A-Za-z .]{0,20}:\s)")


class HaystackUnavailable(RuntimeError):
    """Raised when the prose package is not installed."""


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


@functools.lru_cache(maxsize=1)
def essay_text() -> str:
    """The whole prose corpus as one string (paragraphs joined by single spaces)."""
    if not FORTUNES_DIR.is_dir():
        raise HaystackUnavailable(
            f"{FORTUNES_DIR} missing: the essay haystack needs Debian's 'fortunes' package "
            "(apt-get install fortunes)")
    paras: list[str] = []
    for name in PROSE_FILES:
        path = FORTUNES_DIR / name
        if not path.is_file():
            continue
        raw = path.read_text(encoding="utf-8", errors="replace")
        for entry in raw.split("\n%\n"):
            para = _clean_entry(entry)
            if para:
                paras.append(para)
    if not paras:
        raise HaystackUnavailable(f"no prose found under {FORTUNES_DIR}")
    return " ".join(paras)


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
    words = essay_words()
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
