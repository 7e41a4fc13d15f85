"""Model loading from a ModelSpec-shaped dict: the tokenizer, the frozen backbone, fingerprints.

    from nbcore.backbones.loading import build_backbone
    bb = build_backbone({"path": "models/tiny-gdn", "device": "cpu"})
    bb = build_backbone({"hf_config": {"model_type": "qwen3_5_text", ...}, "seed": 0})   # random init

Keys: path | hf_config (+ seed), tokenizer ("byte", "project", a directory, or the checkpoint's own),
gguf_file and cache_dir (GGUF sources: nbcore.backbones.gguf; path may also be a .gguf file or pkg:...),
dtype (float32 | bfloat16 | float16), device (auto | cpu | cuda), adapter (an NB-LoRA read adapter),
streaming ({sinks, window}: Llama-architecture checkpoints, nbcore.backbones.streaming).
The pipeline's actors and the bench scripts all load models through this module.
"""
from __future__ import annotations

import json

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_tokenizer(spec):
    if spec is None:
        return None
    if spec == "byte":
        return byte_tokenizer()
    if spec == "project":
        from nbcore.tasks.tokenizer import load_tokenizer
        return load_tokenizer()
    from transformers import AutoTokenizer

    from nbcore.backbones.gguf import resolve_checkpoint
    return AutoTokenizer.from_pretrained(resolve_checkpoint(spec))


def byte_tokenizer():
    """Byte-level tokenizer, ids = 3 + byte value (after <pad>, <s>, </s>): 262 entries, any text.

    Same layout as nbcore.testing.byte_tokenizer, but with a FIXED id order: `ByteLevel.alphabet()`
    comes back in a different order in every process, which would make archives differ run to run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    # GPT-2 byte -> printable unicode map (the one ByteLevel uses), in byte order.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_to_char = dict(zip(bs, map(chr, cs)))
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[byte_to_char[b]] = len(vocab)
    assert set(vocab) - set(specials) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def build_backbone(model: dict):
    """ModelSpec (as a dict) -> nbcore Backbone."""
    from transformers import AutoConfig

    from nbcore import load_backbone
    device = model.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES.get(model.get("dtype")) if model.get("dtype") else None
    tok = build_tokenizer(model.get("tokenizer"))
    if model.get("path"):
        target = model["path"]
    else:
        kw = dict(model["hf_config"])
        target = AutoConfig.for_model(kw.pop("model_type"), **kw)
    bb = load_backbone(target, tokenizer=tok, device=device, dtype=dtype, seed=int(model.get("seed", 0)),
                       gguf_file=model.get("gguf_file"), cache_dir=model.get("cache_dir"),
                       streaming=model.get("streaming"))
    if model.get("adapter"):
        from nbcore.lora import load_adapter
        load_adapter(bb, model["adapter"])
    bb.model.eval()
    for p in bb.model.parameters():
        p.requires_grad_(False)
    return bb


def tokenizer_fingerprint(tok) -> str | None:
    """Hash of the tokenizer's vocabulary and specials (archives store token ids: they depend on it)."""
    if tok is None:
        return None
    import hashlib
    blob = json.dumps({"vocab": sorted(tok.get_vocab().items()), "specials": tok.special_tokens_map,
                       "class": type(tok).__name__}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]
