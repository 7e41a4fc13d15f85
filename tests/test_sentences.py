"""Sentence boundaries (nbcore.notebank.sentences): the rules of its module docstring, checked on
character positions and through real tokenizers shipped with the project:

- "byte": nbcore.testing.byte_tokenizer (1 token per UTF-8 byte: a CJK character or '…' is
  split over 3 tokens that share the character's offsets);
- "bpe": the project BPE of models/tiny-gdn, loaded as nbcore loads it
  (nbcore.tasks.tokenizer.load_tokenizer; every punctuation mark and '\\n' is its own token, a
  leading space is glued to the next piece, non-ASCII characters are single <unk> tokens).

With both, no token spans a boundary character, so "the last token starting at or before a
boundary character ends its sentence" puts every cut right after the boundary character: the
token-level sentences equal the character-level ones. A closing quote or bracket AFTER the
final mark is its own token and therefore opens the next sentence (the docstring's token rule;
the same for ASCII and full-width closers).
"""
import numpy as np
import pytest

from nbcore.notebank.sentences import boundary_chars, sentence_ids_from_offsets, tokenize_with_sentences
from nbcore.testing import byte_tokenizer

UUID = "3fa9c2d1-7b2e-4c1a-9f3e-0a1b2c3d4e5f"
FULLWIDTH_CLOSERS = "」』）］｝】〕〉》＂＇"

# text -> its sentences (concatenated they give the text back)
CASES = {
    # '.', '!', '?', '…' followed by whitespace or the end of the text
    "ascii finals": ("One. Two! Three? Four… Five", ["One.", " Two!", " Three?", " Four…", " Five"]),
    "end of text": ("It ends here.", ["It ends here."]),
    "tab and ideographic space": ("A.\tB!\u3000C", ["A.", "\tB!", "\u3000C"]),
    # ... or a closing quote / bracket (the closer itself is not a boundary: it opens the next sentence)
    "straight quotes": ('He said "Hi." Then \'no.\' End', ['He said "Hi.', '" Then \'no.', "' End"]),
    "curly quotes": ("She wrote “Done.” Then ’twas over!’ End", ["She wrote “Done.", "” Then ’twas over!", "’ End"]),
    "ascii brackets": ("A (see this.) B [why?] C {x…} D", ["A (see this.", ") B [why?", "] C {x…", "} D"]),
    # no split inside numbers, abbreviations glued to a word, uuids, dotted names, '?!' / '...'
    "no split": (f"Pi is 3.14 and e.g.x or {UUID} at v1.2.3 on www.example.com ok",
                 [f"Pi is 3.14 and e.g.x or {UUID} at v1.2.3 on www.example.com ok"]),
    "dots and marks in a row": ("Wait... what?! Really", ["Wait...", " what?!", " Really"]),
    "number at the end": ("The value is 3.14.", ["The value is 3.14."]),
    # CJK '。', '！', '？': always, whatever follows
    "cjk": ("今日は晴れ。明日は雨！本当？はい", ["今日は晴れ。", "明日は雨！", "本当？", "はい"]),
    "cjk before latin and digits": ("終わり。A次！1番？x", ["終わり。", "A次！", "1番？", "x"]),
    "cjk closing bracket": ("「はい。」と彼は言った。『本当？』", ["「はい。", "」と彼は言った。", "『本当？", "』"]),
    "full-width marks and brackets": ("Ｏｋ！（はい）。次？", ["Ｏｋ！", "（はい）。", "次？"]),
    # an ASCII final mark followed by a full-width closing bracket / quote (a closing bracket too)
    "ascii final before full-width closer": ("「OK.」次の文。（Really?）Yes『Wait…』終",
                                            ["「OK.", "」次の文。", "（Really?", "）Yes『Wait…", "』終"]),
    # newline: always
    "newline": ("no stop\nnext line\n\nlast", ["no stop\n", "next line\n", "\n", "last"]),
    "newline after a final mark": ("Wow!\nNext", ["Wow!", "\n", "Next"]),
}


def char_sentences(text: str) -> list[str]:
    """Cut right after every boundary character."""
    cuts = [0] + [int(b) + 1 for b in boundary_chars(text)]
    if cuts[-1] != len(text):
        cuts.append(len(text))
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("name", list(CASES))
def test_boundary_characters(name):
    text, want = CASES[name]
    assert "".join(want) == text
    assert char_sentences(text) == want


def _cp(c):
    return f"U+{ord(c):04X}"


@pytest.mark.parametrize("closer", list(FULLWIDTH_CLOSERS) + list('"\'”’)]}'), ids=_cp)
@pytest.mark.parametrize("mark", list(".!?…"), ids=_cp)
def test_final_mark_before_any_closer_splits(mark, closer):
    text = f"Yes{mark}{closer}Next"
    assert char_sentences(text) == [f"Yes{mark}", f"{closer}Next"]
    assert char_sentences(f"Yes{mark}x{closer}") == [f"Yes{mark}x{closer}"]    # not followed by it: no split


def test_end_of_text_is_a_boundary():
    # invisible in sentence ids (no token follows), so checked on the positions themselves
    for text in ("It ends here.", "Done!", "Why?", "Wait…", "The value is 3.14."):
        assert boundary_chars(text).tolist() == [len(text) - 1]
    assert boundary_chars("No final mark").tolist() == []
    assert boundary_chars("A. B").tolist() == [1]


def test_full_width_marks_split_always():
    for mark in "。！？":
        assert char_sentences(f"a{mark}b{mark}1{mark}") == [f"a{mark}", f"b{mark}", f"1{mark}"]


# ---- through real tokenizers --------------------------------------------------------------------
@pytest.fixture(scope="module", params=["byte", "bpe"])
def named_tok(request):
    if request.param == "byte":
        return "byte", byte_tokenizer()
    from nbcore.tasks.tokenizer import DEFAULT_DIR, load_tokenizer
    assert (DEFAULT_DIR / "tokenizer.json").is_file()           # the shipped one, not a rebuilt one
    return "bpe", load_tokenizer()


def token_sentences(tok, text):
    """-> (sentence texts cut at the first token of each sentence, ids, sentence ids)."""
    ids, sid = tokenize_with_sentences(tok, text, add_special_tokens=False)
    off = np.asarray(tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]).reshape(-1, 2)
    assert ids.dtype == sid.dtype == np.int64 and len(ids) == len(sid) == len(off)
    assert sid[0] == 0 and set(np.diff(sid).tolist()) <= {0, 1}  # 0, 1, 2, ... in token order
    cuts = [0] + [int(off[i, 0]) for i in range(1, len(sid)) if sid[i] != sid[i - 1]] + [len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:])], ids, sid


@pytest.mark.parametrize("name", list(CASES))
def test_sentences_through_tokenizers(named_tok, name):
    kind, tok = named_tok
    text, want = CASES[name]
    got, ids, sid = token_sentences(tok, text)
    assert got == want
    if kind == "byte":                                         # exact round trip per sentence:
        pieces = [tok.decode(ids[sid == s].tolist()) for s in range(int(sid[-1]) + 1)]
        assert pieces == want                                  # no multi-byte character split over two sentences


def test_multibyte_marks_end_after_their_last_byte():
    tok = byte_tokenizer()
    text = "晴れ。雨！Wait… ok"
    ids, sid = tokenize_with_sentences(tok, text, add_special_tokens=False)
    assert len(ids) == len(text.encode())
    ends = np.flatnonzero(np.diff(sid)) + 1                    # first token of each new sentence
    cut_bytes = [len(p.encode()) for p in ["晴れ。", "晴れ。雨！", "晴れ。雨！Wait…"]]
    assert ends.tolist() == cut_bytes


def test_specials_and_dropped_characters_from_offsets():
    # <s> Hi . ␣Yo </s>: characterless specials take the running position
    text = "Hi. Yo"
    off = np.array([[0, 0], [0, 1], [1, 2], [2, 3], [3, 6], [0, 0]])
    assert sentence_ids_from_offsets(text, off).tolist() == [0, 0, 0, 0, 1, 1]
    # a tokenizer that dropped the newline: the sentence still ends at the preceding token
    assert sentence_ids_from_offsets("ab\ncd", np.array([[0, 1], [1, 2], [3, 4], [4, 5]])).tolist() == [0, 0, 1, 1]
    # a token holding the boundary character and more ends the sentence after itself
    assert sentence_ids_from_offsets("ab.\ncd", np.array([[0, 2], [2, 4], [4, 6]])).tolist() == [0, 0, 1]
    assert sentence_ids_from_offsets("", np.zeros((0, 2))).shape == (0,)


# ---- fast path: offsets from the token strings (sentences._fast_offsets) ------------------------
def _trained_byte_bpe(template: bool, trim: bool = False):
    """A byte-level BPE with merges (GPT-2 style: multi-byte characters split or merged, a leading
    space glued to words), trained here in milliseconds; template=True adds <s> ... </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [t for t, _ in CASES.values()] * 20 + ["The quick brown fox. Jumps over the lazy dog!"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if template:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                           special_tokens=[("<s>", 0), ("</s>", 1)])
    if trim:
        tok.post_processor = processors.ByteLevel(trim_offsets=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _fast_cases():
    rng = np.random.default_rng(0)
    alphabet = list("abc XYZ.!?…\n\t\"')]}」』。！？晴れ雨 3.14 e.g. “”’") + ["  ", "...", "\n\n"]
    texts = [t for t, _ in CASES.values()]
    texts += ["".join(rng.choice(alphabet, size=int(rng.integers(1, 80)))) for _ in range(60)]
    return texts


@pytest.mark.parametrize("kind", ["byte", "bpe", "byte-bpe", "byte-bpe-template"])
def test_fast_offsets_equal_the_tokenizers(kind):
    from nbcore.notebank import sentences
    if kind == "byte":
        tok = byte_tokenizer()
    elif kind == "bpe":
        from nbcore.tasks.tokenizer import load_tokenizer
        tok = load_tokenizer()
    else:
        tok = _trained_byte_bpe(template=kind.endswith("template"))
    fast_used = 0
    for text in _fast_cases():
        for specials in (False, True):
            enc = tok(text, add_special_tokens=specials, return_offsets_mapping=True)
            ids = np.asarray(enc["input_ids"], dtype=np.int64)
            off = sentences._fast_offsets(tok, text, ids, specials)
            if off is not None:                       # where it answers, it answers what the tokenizer says
                fast_used += 1
                assert off.tolist() == [list(p) for p in enc["offset_mapping"]], text
            got = sentences.tokenize_with_sentences(tok, text, specials, fast=True)
            want = sentences.tokenize_with_sentences(tok, text, specials, fast=False)
            assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist(), text
    # the fast path is taken wherever the tokens spell the text: everywhere for the byte-level
    # vocabularies; for the tiny BPE (non-ASCII characters -> <unk>) on the ASCII texts
    texts = _fast_cases()
    assert fast_used == 2 * (sum(t.isascii() for t in texts) if kind == "bpe" else len(texts))


def test_fast_offsets_decline_what_they_cannot_follow():
    from tokenizers import normalizers
    from nbcore.notebank import sentences
    trimmed = _trained_byte_bpe(template=False, trim=True)       # offsets trimmed of their spaces
    assert sentences._table(trimmed) is None
    lower = byte_tokenizer()
    lower.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert sentences._table(lower) is None
    tok = byte_tokenizer()
    ids = np.asarray(tok("Hi. Yo")["input_ids"], dtype=np.int64)
    assert sentences._fast_offsets(tok, "Hi. Yo", ids, True) is not None
    assert sentences._fast_offsets(tok, "Hi! Yo", ids, True) is None       # ids of another text
    assert sentences._fast_offsets(tok, "Hi. Yo", ids[:-1], True) is None
