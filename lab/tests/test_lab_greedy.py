"""lab.backbone.greedy (the trainer's evaluation decoder, a token-counting DynamicCache) on the
shipped tiny backbones: cached decoding equals re-reading the whole sequence every step, it reads
short needles, and it agrees with the product's decoder (nbcore Backbone.generate)."""
from __future__ import annotations

import pytest
import torch

BACKBONES = ("tiny-gdn", "tiny-gdn-v5", "tiny-mamba2-p5")


@pytest.mark.parametrize("name", BACKBONES)
def test_greedy_cached_equals_uncached_and_reads_needles(name, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lab.backbone import greedy
    from nbcore import load_backbone
    from nbcore.tasks import ruler

    d = model_dir(name)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    scores = []
    for i in range(3):
        ex = ruler.generate("niah_single_1", 256, i, tok)
        ids = tok(ex["context"] + ex["question"], add_special_tokens=False)["input_ids"]
        out = greedy(model, ids, 10, tok.eos_token_id)
        if i == 0:  # cached decoding (counting cache) == re-reading everything each step == nbcore's
            assert out == greedy(model, ids, 10, tok.eos_token_id, use_cache=False)
            bb = load_backbone(model, tokenizer=tok)
            state = bb.new_state()
            assert bb.generate(state, bb.forward(state, torch.tensor(ids)), 10) == out
        scores.append(ruler.score("niah_single_1", tok.decode(out), ex["answers"]))
    assert sum(scores) / len(scores) >= 60, scores
