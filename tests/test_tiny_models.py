"""The shipped tiny checkpoints (models/): each has a model card, loads with the Auto classes and
runs, and the trained backbones read a needle through nbcore (skips if a dir is absent). The lab
trainer's own decoding (lab.backbone.greedy) is checked in lab/tests/test_lab_greedy.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BACKBONES = {"tiny-gdn": "qwen3_5_text", "tiny-gdn-v5": "qwen3_5_text", "tiny-mamba2-p5": "mamba2"}
MODELS = {**BACKBONES, "tiny-qwen2": "qwen2"}      # tiny-qwen2: the frozen MoNe base (reads no needle)
SHIPPED = {*MODELS, "tiny-gdn-lora", "smollm2-135m-mone"}   # + adapters: NB-LoRA of tiny-gdn, MoNe of SmolLM2


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


def test_models_dir_holds_only_the_cards_checkpoints():
    """models/ ships what the product and docs use (at most 6 entries), each with a model card that
    names no issue number; intermediates live in git history."""
    import re
    names = {d.name for d in (ROOT / "models").iterdir() if d.is_dir()}
    assert names == SHIPPED and len(names) <= 6
    for name in names:
        card = (ROOT / "models" / name / "README.md").read_text()
        assert card.startswith(f"# {name}"), name
        assert not re.search(r"\bissue\s*#?\d", card, re.I), name


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


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_recalls_a_needle_at_short_length(name):
    """Greedy through nbcore's Backbone (the product's read path) on 3 short noise-haystack
    examples: the trained model should get most right."""
    from nbcore import load_backbone
    from nbcore.tasks import ruler

    bb = load_backbone(str(_dir(name)))
    tok = bb.tokenizer
    scores = []
    for i in range(3):
        ex = ruler.generate("niah_single_1", 256, i, tok)
        ids = torch.tensor(tok(ex["context"] + ex["question"], add_special_tokens=False)["input_ids"])
        state = bb.new_state()
        out = bb.generate(state, bb.forward(state, ids), 10)
        scores.append(ruler.score("niah_single_1", tok.decode(out), ex["answers"]))
    assert sum(scores) / len(scores) >= 60, scores
