"""Tiny random-init backbones, a byte-level tokenizer and needle texts, for tests and examples.

Everything here builds locally (no download): real transformers model classes with tiny configs,
and a real `PreTrainedTokenizerFast` (byte-level, 256 byte tokens + specials, with offsets).
"""
from __future__ import annotations

import random

from nbcore.notebank.sentences import byte_level_alphabet

SPECIALS = ["<pad>", "<s>", "</s>"]


def byte_tokenizer():
    """Byte-level tokenizer without merges: any text, 1 token per byte, offsets supported."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in byte_level_alphabet():          # byte order: id = 3 + byte value, same in every process
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def tiny_gdn_config(vocab_size: int = 262, hybrid: bool = False, layers: int = 2, hidden: int = 64,
                    key_heads: int = 2, value_heads: int = 4, head_dim: int = 16, conv: int = 4):
    """transformers Qwen3.5 text config: all `linear_attention` (pure GDN) or 3:1 GDN/attention;
    ``conv`` = short-conv kernel size (models/tiny-gdn-v5 uses 8; the tests also run 10)."""
    from transformers import Qwen3_5TextConfig
    if hybrid:
        layers = max(layers, 4)
        types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    else:
        types = ["linear_attention"] * layers
    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        layer_types=types, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_conv_kernel_dim=conv,
        num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)


def tiny_mamba2_config(vocab_size: int = 262, layers: int = 2, hidden: int = 64, groups: int = 2, state: int = 16):
    from transformers import Mamba2Config
    return Mamba2Config(
        vocab_size=vocab_size, hidden_size=hidden, state_size=state, num_hidden_layers=layers, n_groups=groups,
        num_heads=8, head_dim=16, expand=2, conv_kernel=4, chunk_size=64, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)


FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def needle_text(n_chars: int, n_needles: int = 4, seed: int = 0) -> tuple[str, list[tuple[str, str]]]:
    """Noise haystack of ~n_chars with planted needle sentences at random sentence boundaries.
    -> (text, [(key, value), ...]). With the byte tokenizer, 1 char = 1 token."""
    rng = random.Random(seed)
    adjs = ["amber", "brisk", "calm", "dusty", "eager", "fuzzy", "gentle", "hollow", "icy", "jolly"]
    nouns = ["lantern", "meadow", "otter", "pebble", "quill", "river", "saddle", "tulip", "violin", "walnut"]
    reps = max(1, n_chars // len(FILLER))
    units = [FILLER] * reps
    needles = []
    pairs = rng.sample([f"{a}-{n}" for a in adjs for n in nouns], n_needles)   # distinct keys
    for key in pairs:
        val = str(rng.randint(1_000_000, 9_999_999))
        needles.append((key, val))
        pos = rng.randrange(len(units) + 1)
        units.insert(pos, f"One of the special magic numbers for {key} is: {val}. ")
    return "".join(units), needles


def sentence_text(n: int, seed: int = 0) -> str:
    """Sentences of random words ('.', '!' and line breaks end them); ASCII: 1 char = 1 token."""
    import numpy as np
    g = np.random.default_rng(seed)
    out = []
    while sum(map(len, out)) < n:
        words = ["".join(g.choice(list("abcdefghijklmnopqrstuvwxyz"), size=g.integers(2, 9)))
                 for _ in range(g.integers(3, 12))]
        out.append(" ".join(words) + str(g.choice([". ", "! ", ".\n"])))
    return "".join(out)[:n]
