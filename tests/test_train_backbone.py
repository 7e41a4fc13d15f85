"""Initialisation of the tiny backbones (nbcore/training/backbone.py)."""
from __future__ import annotations

import pytest
import torch

from nbcore.tasks.tokenizer import build_tokenizer
from nbcore.training.backbone import ModelConfig, build_model


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _taps(model, layer=0):
    m = model.model.layers[layer].linear_attn
    return m.conv1d.weight[:, 0].detach(), m.key_dim, m.key_dim // m.num_k_heads   # [C, K]


@pytest.mark.parametrize("bigram", [0, 1, 4], ids=["unigram", "bigram1", "bigram-all"])
def test_induction_taps(tok, bigram):
    """q reads t (and t-1 in bigram heads); k reads t-1 (and t-2); v reads t. Index K-1 = token t."""
    w, kd, hd = _taps(build_model(ModelConfig(heads=4, bigram_heads=bigram), tok))
    K = w.shape[1]
    lag = lambda *ls: torch.tensor([1.0 if K - 1 - j in ls else 0.0 for j in range(K)])  # noqa: E731
    lo = kd - bigram * hd
    for c in range(kd):
        assert torch.equal(w[c], lag(0, 1) if c >= lo else lag(0)), c
        assert torch.equal(w[kd + c], lag(1, 2) if c >= lo else lag(1)), c
    assert torch.equal(w[2 * kd], lag(0))


def test_bigram_heads_out_of_range(tok):
    with pytest.raises(ValueError, match="bigram_heads"):
        build_model(ModelConfig(heads=4, bigram_heads=5), tok)


def test_train_checkpoints_and_resumes(tok, tmp_path):
    """A short run leaves a complete checkpoint (no temp file) and an HF dir; a rerun resumes it."""
    from nbcore.training.backbone import TrainConfig, train
    mc = ModelConfig(hidden=32, layers=1, heads=1, mlp=64, bigram_heads=1)
    tc = TrainConfig(minutes=0.05, tokens_per_step=256, threads=1)
    _, meta = train(mc, tc, tmp_path / "model", tmp_path / "run", tok, log=lambda s: None)
    ck = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)
    assert ck["step"] == meta["steps"] >= 1 and not (tmp_path / "run" / "ckpt.pt.tmp").exists()
    assert (tmp_path / "model" / "model.safetensors").is_file()
    _, meta2 = train(mc, TrainConfig(minutes=0.1, tokens_per_step=256, threads=1), tmp_path / "model",
                     tmp_path / "run", tok, log=lambda s: None)
    assert meta2["steps"] > meta["steps"]
    from nbcore.training.backbone import write_readme
    meta2["limits"] = "multi-key recall needs key binding"
    write_readme(tmp_path / "model", meta2, [{"length": 64, "n": 1, "scores": {"niah_single_1": 0.0}}])
    text = (tmp_path / "model" / "README.md").read_text()
    assert "| 64 | niah_single_1 | 1 | 0.0 |" in text and text.endswith("needs key binding\n")
