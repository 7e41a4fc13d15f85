"""The shipped tiny backbones load with the Auto classes and run (skips if a dir is absent)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"tiny-gdn": "qwen3_5_text", "tiny-gdn-v2": "qwen3_5_text", "tiny-gdn-v3": "qwen3_5_text",
          "tiny-gdn-v4": "qwen3_5_text", "tiny-gdn-v5": "qwen3_5_text",
          "tiny-mamba2": "mamba2", "tiny-mamba2-v2": "mamba2", "tiny-mamba2-v3": "mamba2",
          "tiny-mamba2-v4": "mamba2"}


def _dir(name: str) -> Path:
    d = ROOT / "models" / name
    if not (d / "model.safetensors").is_file() or not (d / "tokenizer.json").is_file():
        pytest.skip(f"models/{name} not present yet")
    return d


@pytest.fixture(scope="module", autouse=True)
def _threads():
    old = torch.get_num_threads()
    torch.set_num_threads(min(old, 2))
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_loads_and_forwards(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = _dir(name)
    size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    assert size <= 20 * 2**20, f"{name} is {size} bytes"
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    assert model.config.model_type == MODELS[name]
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    enc = tok("The grass is green. The sky is blue.\nOne of the special magic numbers for "
              "calm-hammer is: 1234567.", return_offsets_mapping=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=enc["input_ids"], use_cache=False).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], len(tok))
    assert torch.isfinite(logits).all()
    assert (d / "README.md").is_file()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_recalls_a_needle_at_short_length(name):
    """Greedy on 3 short noise-haystack examples: the trained model should get most right."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbcore.tasks import ruler
    from nbcore.training.backbone import greedy

    d = _dir(name)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    scores = []
    for i in range(3):
        ex = ruler.generate("niah_single_1", 256, i, tok)
        ids = tok(ex["context"] + ex["question"], add_special_tokens=False)["input_ids"]
        out = greedy(model, ids, 10, tok.eos_token_id)
        if i == 0:  # cached decoding (counting cache) == re-reading everything each step
            assert out == greedy(model, ids, 10, tok.eos_token_id, use_cache=False)
        scores.append(ruler.score("niah_single_1", tok.decode(out), ex["answers"]))
    assert sum(scores) / len(scores) >= 60, scores
