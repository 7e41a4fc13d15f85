"""The shipped essay haystack: no system package needed, the exact text the shipped models saw."""
from __future__ import annotations

import gzip
import hashlib

import pytest

from nbcore.tasks import haystack as hs


def test_shipped_prose_is_the_recorded_text():
    text = hs.read_shipped_prose()
    assert hashlib.sha256(text.encode()).hexdigest() == hs.PROSE_SHA256
    assert text.isascii() and len(text.split(" ")) > 50_000
    assert hs.split_sentences(text[:2000])[0].endswith((".", "!", "?", '"', "'", ")"))


def test_essay_text_needs_no_system_package(monkeypatch):
    monkeypatch.delenv("FORTUNES_DIR", raising=False)
    hs.essay_text.cache_clear()
    try:
        assert hs.essay_text() == hs.read_shipped_prose()
    finally:
        hs.essay_text.cache_clear()


def test_damaged_prose_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "prose.txt.gz"
    bad.write_bytes(gzip.compress(b"not the prose"))
    with pytest.raises(hs.HaystackUnavailable, match="sha256"):
        hs.read_shipped_prose(bad)
    bad.write_bytes(b"\x1f\x8b truncated")
    with pytest.raises(hs.HaystackUnavailable, match="missing or damaged"):
        hs.read_shipped_prose(bad)


def test_build_prose_keeps_only_multi_sentence_prose(tmp_path):
    """The cleaning that made the shipped file, on a fortunes folder written here."""
    prose = ("The first sentence of a real paragraph is here. And then a second one follows it, "
             "long enough to keep.")
    entries = [
        prose + "\n\t\t-- Some Author",                                      # kept, attribution removed
        "A one-line quip with no second sentence at all, but it is quite long anyway.",  # one sentence
        "  Indented verse line one.\n  Indented verse line two. It rhymes. Sort of.",    # verse
        "Q: What is a question?\nA: This is a dialogue. It is dropped.",                 # dialogue
    ]
    (tmp_path / "wisdom").write_text("\n%\n".join(entries) + "\n")
    (tmp_path / "people").write_text("Another fine paragraph of plain prose starts here. It has two sentences, "
                                     "which is enough.\n")
    out = hs.build_prose(tmp_path)
    assert out == prose + " " + "Another fine paragraph of plain prose starts here. It has two sentences, which is enough."
    with pytest.raises(hs.HaystackUnavailable):
        hs.build_prose(tmp_path / "missing")


def test_rebuild_cli_writes_deterministic_bytes(tmp_path):
    (tmp_path / "wisdom").write_text("Plain prose for the rebuild test goes here, long enough to keep. A second sentence closes it off.\n")
    a, b = tmp_path / "a.gz", tmp_path / "b.gz"
    hs._main(["--rebuild", str(tmp_path), "--out", str(a)])
    hs._main(["--rebuild", str(tmp_path), "--out", str(b)])
    assert a.read_bytes() == b.read_bytes()
    assert gzip.decompress(a.read_bytes()).decode() == hs.build_prose(tmp_path)
