"""The project tokenizer: a small BPE built with HF ``tokenizers`` and saved as a
``PreTrainedTokenizerFast`` directory (tokenizer.json + tokenizer_config.json).

Why small BPE and not word-level: the haystack is open prose, so a word-level vocabulary either
explodes (prose vocabulary) or maps many words to ``<unk>``, and ``<unk>`` destroys exact
round-tripping of uuids (hex strings like ``3fa9``) and of arbitrary text NoteBank archives. A
2,048-entry BPE over an explicit pre-tokenizer keeps the embedding table small (tiny models on
CPU: 2,048 x 128 = 262K parameters), never fails on an unknown word (it falls back to single
characters; only non-ASCII characters become ``<unk>``) and keeps the properties the project
needs:

* every digit is its own piece (``" ?[0-9]"``), so a 7-digit value is always 7 tokens and a model
  copies numbers digit by digit;
* each punctuation character is its own piece, so sentence-final ``.``, ``?``, ``!`` are single
  tokens (NoteBank finds sentence boundaries via offsets);
* ``\\n`` is its own token;
* a leading space is glued to the following word/digit/punctuation piece (GPT-style), which makes
  decoding a plain concatenation (``decoders.Fuse``) and offsets exact.

Training text: the essay haystack, RULER's noise sentences, every template variant, the
adjective/noun key words and seeded numbers and uuids. Training is deterministic (single corpus
order; HF BPE breaks ties deterministically), so ``build_tokenizer`` reproduces the shipped one.
"""
from __future__ import annotations

import random
import string
import uuid
from pathlib import Path

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
PRETOKEN_REGEX = r"\n| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]|[^\S\n]+"
DEFAULT_VOCAB = 2048
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO_ROOT / "models" / "tiny-gdn"


def _training_corpus(seed: int = 0) -> list[str]:
    """Texts the BPE merges are learned from (deterministic)."""
    from nbcore.tasks import haystack, ruler

    rng = random.Random(seed)
    texts: list[str] = []
    try:
        texts.append(haystack.essay_text())
    except haystack.HaystackUnavailable:
        pass
    texts += [haystack.NOISE] * 200
    for tmpl in ruler.template_strings():
        texts += [tmpl] * 50
    words = ruler.ADJECTIVES + ruler.NOUNS
    texts += [" ".join(words)] * 20
    texts += [" ".join(ruler.all_keys())]
    digits = " ".join(str(rng.randint(10**6, 10**7 - 1)) for _ in range(5000))
    uuids = " ".join(str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(3000))
    texts += [digits, uuids]
    return texts


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB, seed: int = 0):
    """Train the BPE and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIALS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PRETOKEN_REGEX), behavior="isolated")
    tok.decoder = decoders.Fuse()
    alphabet = list(string.printable)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIALS[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")],
        initial_alphabet=alphabet,
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False, model_max_length=1 << 21,
        **SPECIALS)
    return fast


def save_tokenizer(tokenizer, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    return out


def load_tokenizer(path: str | Path | None = None):
    """Load the project tokenizer from ``path`` (default: the shipped tiny-gdn dir), else build it.
    ``path`` may also be a GGUF source (a .gguf file or ``pkg:<package>/<file>.gguf``): its tokenizer."""
    from transformers import AutoTokenizer

    if path is not None:
        from nbcore.backbones.gguf import resolve_checkpoint
        path = resolve_checkpoint(path)          # a GGUF source -> its cached checkpoint; else unchanged
    p = Path(path) if path is not None else DEFAULT_DIR
    if (p / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(p)
    return build_tokenizer()
