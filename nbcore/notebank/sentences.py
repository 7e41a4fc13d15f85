"""Sentence boundaries in token space, found through the tokenizer's character offsets.

App. B.2 splits "the observed text at sentence-final punctuation and line breaks". Choices the
paper leaves open (documented here, tested in tests/test_sentences.py):
- Sentence-final characters: '.', '!', '?', '…' when followed by whitespace, end of text or a
  closing quote/bracket (so "3.14", "e.g.x" and uuids do not split); CJK '。', '！', '？' always;
  every line break '\n' always. Closing quotes/brackets: " ' ” ’ ) ] } and their full-width/CJK
  forms 」 』 ） ］ ｝ 】 〕 〉 》 ＂ ＇ (e.g. 「OK.」 splits after the '.'). A closer is not itself a
  boundary: where it is its own token it opens the next sentence (next rule).
- The last token starting at or before a boundary character ends its sentence; the next token
  starts a new sentence.
"""
from __future__ import annotations

import itertools
import re

import numpy as np

_FINAL = re.compile(r"[.!?…](?=[\s\"'”’)\]}」』）］｝】〕〉》＂＇]|$)|[。！？]|\n")


def boundary_chars(text: str) -> np.ndarray:
    """Sorted character positions that end a sentence."""
    return np.fromiter((m.start() for m in _FINAL.finditer(text)), dtype=np.int64)


def sentence_ids_from_offsets(text: str, offsets: np.ndarray) -> np.ndarray:
    """offsets: [T, 2] (char start, end) per token -> sentence id per token [T] (int64, non-decreasing)."""
    T = len(offsets)
    if T == 0:
        return np.zeros(0, np.int64)
    offsets = np.asarray(offsets, dtype=np.int64).reshape(T, 2)
    b = boundary_chars(text)
    starts, ends = offsets[:, 0], offsets[:, 1]
    # Tokens without characters (specials) take the running position so starts stay sorted.
    starts = np.maximum.accumulate(np.where(ends > starts, starts, 0))
    # Each boundary char ends the sentence at the LAST token starting at or before it (a
    # multi-byte char split over several byte tokens ends after its last piece; a boundary char
    # the tokenizer dropped, e.g. a newline, still ends the sentence at the preceding token).
    last = np.searchsorted(starts, b, side="right") - 1
    ends_sentence = np.zeros(T, bool)
    ends_sentence[last[last >= 0]] = True
    sid = np.zeros(T, np.int64)
    sid[1:] = np.cumsum(ends_sentence[:-1])
    return sid


def tokenize_with_sentences(tokenizer, text: str, add_special_tokens: bool = True):
    """-> (ids [T] int64, sentence ids [T] int64). Needs a fast tokenizer (offset mapping)."""
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    om = enc["offset_mapping"]
    # fromiter over the flattened pairs: ~2x faster than np.asarray on a list of tuples
    offsets = np.fromiter(itertools.chain.from_iterable(om), dtype=np.int64, count=2 * len(om)).reshape(-1, 2)
    return ids, sentence_ids_from_offsets(text, offsets)
