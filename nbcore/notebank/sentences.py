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
import json
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


def tokenize_with_sentences(tokenizer, text: str, add_special_tokens: bool = True, fast: bool = True):
    """-> (ids [T] int64, sentence ids [T] int64). Needs a fast tokenizer (offset mapping).

    fast=True: offsets from the token strings when they provably concatenate to `text` (see
    `_fast_offsets`); the same result as fast=False, which always asks the tokenizer for them."""
    tab = _table(tokenizer) if fast else None
    if tab is not None and tab.tries < 4 + 4 * tab.hits:        # stop trying where it keeps failing
        tab.tries += 1
        ids = np.asarray(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"], dtype=np.int64)
        off = _fast_offsets(tokenizer, text, ids, add_special_tokens)
        if off is not None:
            tab.hits += 1
            return ids, sentence_ids_from_offsets(text, off)
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    om = enc["offset_mapping"]
    # fromiter over the flattened pairs: ~2x faster than np.asarray on a list of tuples
    offsets = np.fromiter(itertools.chain.from_iterable(om), dtype=np.int64, count=2 * len(om)).reshape(-1, 2)
    return ids, sentence_ids_from_offsets(text, offsets)


# ---- fast path: token offsets from a table of token strings --------------------------------------
# Asking the tokenizer for offsets costs ~15% more than ids alone on a long document (offsets are
# built and turned into Python tuples per token). For a tokenizer whose tokens concatenate back to
# the text (no normalizer, nothing dropped: most BPE vocabularies on ordinary text), each token's
# offsets are the running sum of its string lengths. `_fast_offsets` checks that per document,
# unit by unit (it rebuilds the text from the table and compares), and otherwise returns None: the
# caller then asks the tokenizer, the reference path. Tested equal to it (tests/test_sentences.py).


class _TokenTable:
    """A tokenizer's token strings as one flat code array: unit "char" (code points) or "byte"
    (UTF-8 bytes, byte-level vocabularies). codes[start[i]:start[i + 1]] is token i's text."""

    def __init__(self, codes: np.ndarray, start: np.ndarray, unit: str, prefix: list[int], suffix: list[int]):
        self.codes, self.start, self.unit = codes, start, unit
        self.lens = np.diff(start)
        self.prefix, self.suffix = prefix, suffix     # ids the post-processor adds around the text
        self.tries = self.hits = 0                    # documents tried / read through the table


_TABLES: dict = {}


def byte_level_alphabet() -> list[str]:
    """The printable stand-in character of each byte 0..255 (GPT-2's byte-level mapping), in
    byte order. (ByteLevel.alphabet() is a set: its iteration order changes between processes.)"""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


def _walk(node):
    """Every dict inside a tokenizer.json component (Sequence members included)."""
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _build_table(tokenizer) -> _TokenTable | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    if spec.get("normalizer") is not None or spec.get("model", {}).get("byte_fallback"):
        return None
    # offsets trimmed of surrounding whitespace no longer follow the token strings
    if any(n.get("trim_offsets") for n in _walk(spec.get("post_processor"))):
        return None
    byte_level = any(n.get("type") == "ByteLevel" for n in _walk([spec.get("pre_tokenizer"), spec.get("decoder")]))
    vocab = backend.get_vocab(with_added_tokens=True)                   # str -> id
    V = max(vocab.values()) + 1
    inv = {ch: b for b, ch in enumerate(byte_level_alphabet())} if byte_level else None   # char -> byte
    added = {t.content for t in backend.get_added_tokens_decoder().values()}   # matched in the raw text
    pieces: list = [b"" if byte_level else ""] * V
    for s, i in vocab.items():
        if byte_level and s not in added:
            if any(ch not in inv for ch in s):
                return None
            pieces[i] = bytes(inv[ch] for ch in s)
        else:
            pieces[i] = s.encode() if byte_level else s
    if byte_level:
        codes = np.frombuffer(b"".join(pieces), dtype=np.uint8).astype(np.uint32)
    else:
        codes = np.frombuffer("".join(pieces).encode("utf-32-le"), dtype=np.uint32)
    lens = [len(p) for p in pieces]
    start = np.zeros(V + 1, np.int64)
    np.cumsum(lens, out=start[1:])
    # what the post-processor adds around a text: compare a probe with and without special tokens
    probe = "a"
    bare = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe, add_special_tokens=True)["input_ids"]
    k = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
    if k is None:
        return None
    return _TokenTable(codes, start, "byte" if byte_level else "char", full[:k], full[k + len(bare):])


def _table(tokenizer) -> _TokenTable | None:
    key = id(tokenizer)
    hit = _TABLES.get(key)
    if hit is None or hit[0] is not tokenizer:
        if len(_TABLES) > 8:
            _TABLES.clear()
        try:
            tab = _build_table(tokenizer)
        except Exception:   # noqa: BLE001 - any unexpected tokenizer layout: use the reference path
            tab = None
        hit = _TABLES[key] = (tokenizer, tab)
    return hit[1]


def _fast_offsets(tokenizer, text: str, ids: np.ndarray, add_special_tokens: bool) -> np.ndarray | None:
    """[T, 2] character offsets of `ids` (the tokenizer's ids of `text`) as the tokenizer reports
    them, derived from the token strings; None when they cannot be shown to concatenate to text."""
    tab = _table(tokenizer)
    if tab is None:
        return None
    pre, suf = (tab.prefix, tab.suffix) if add_special_tokens else ([], [])
    T = len(ids)
    if T < len(pre) + len(suf) or ids[:len(pre)].tolist() != pre or \
            (suf and ids[T - len(suf):].tolist() != suf):
        return None
    body = ids[len(pre):T - len(suf)]
    if len(body) and (body.min() < 0 or body.max() >= len(tab.lens)):
        return None
    if tab.unit == "char":
        units = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    else:
        units = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    lens = tab.lens[body]
    if int(lens.sum()) != len(units) or (len(body) and lens.min() == 0):
        return None
    ends = np.cumsum(lens)
    starts = ends - lens
    # the text rebuilt from the table, unit by unit: position p of token i reads codes[start[ids[i]] + p - starts[i]]
    src = np.repeat(tab.start[body] - starts, lens) + np.arange(len(units))
    if not np.array_equal(tab.codes[src], units):
        return None
    if tab.unit == "byte" and not text.isascii():
        # byte -> character index (a piece of a multi-byte character starts at that character)
        char_of = np.cumsum((units & 0xC0) != 0x80) - 1
        starts, ends = char_of[starts], char_of[ends - 1] + 1
    off = np.zeros((T, 2), np.int64)                 # added specials: (0, 0), as tokenizers reports them
    off[len(pre):T - len(suf), 0] = starts
    off[len(pre):T - len(suf), 1] = ends
    return off
