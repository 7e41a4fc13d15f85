"""lab/train_base_transformer.py (the trainer of models/tiny-qwen2, the frozen MoNe base)."""
from __future__ import annotations

import json


def test_trains_a_few_steps_and_writes_a_loadable_base(tmp_path):
    """--max-steps stops the run (as the shipped base was stopped at step 1,051); the HF dir loads."""
    from transformers import AutoModelForCausalLM

    from lab import train_base_transformer as tbt
    out = tmp_path / "qwen2"
    assert tbt.main(["--out", str(out), "--run-dir", str(tmp_path / "run"), "--minutes", "5", "--max-steps", "2",
                     "--tokens-per-step", "256", "--threads", "1"]) == 0
    meta = json.loads((out / "train_meta.json").read_text())
    assert meta["steps"] == 2 and meta["script"] == "lab/train_base_transformer.py" and meta["max_steps"] == 2
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2"
