"""fla GatedDeltaNet adapter: what runs without triton here, and the GPU invariants when a CUDA
device and flash-linear-attention are present (skipped otherwise)."""
import importlib.util
import json

import pytest
import torch

from nbcore.backbones import load_backbone
from nbcore.backbones.fla import fla_gdn_channels

GDN_1_3B = {  # m-a-p/1.3B-100B-GatedDeltaNet-pure (fla layout)
    "model_type": "gated_deltanet", "hidden_size": 2048, "num_hidden_layers": 24, "num_heads": 8,
    "head_dim": 256, "expand_v": 1, "intermediate_size": 5632, "vocab_size": 32000, "conv_size": 4,
}


def test_gdn_1_3b_has_192_channels():
    assert fla_gdn_channels(GDN_1_3B) == (192, 8, 256)
    hybrid = {**GDN_1_3B, "attn": {"layers": [5, 11, 17, 23]}}
    assert fla_gdn_channels(hybrid)[0] == 20 * 8


def test_fla_checkpoint_without_fla_gives_clear_error(tmp_path):
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("fla installed")
    (tmp_path / "config.json").write_text(json.dumps(GDN_1_3B))
    with pytest.raises(ImportError, match="flash-linear-attention"):
        load_backbone(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="needs a CUDA GPU and flash-linear-attention")
def test_fla_gdn_chunked_equals_full_and_copy_independent():  # pragma: no cover - GPU only
    import fla  # noqa: F401
    from transformers import AutoConfig
    cfg = AutoConfig.for_model("gated_deltanet", hidden_size=256, num_hidden_layers=2, num_heads=2,
                               head_dim=64, vocab_size=1000, intermediate_size=512)
    bb = load_backbone(cfg, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 1000, (300,))
    s1, s2 = bb.new_state(), bb.new_state()
    l1 = bb.forward(s1, ids)
    bb.forward(s2, ids[:128])
    l2 = bb.forward(s2, ids[128:])
    assert torch.allclose(l1, l2, atol=5e-2)
    c = bb.copy_state(s1)
    bb.forward(c, ids[:10])
    t1, t2 = bb.state_to_tensors(s1), bb.state_to_tensors(s2)
    for k in t1:
        assert torch.allclose(t1[k].float(), t2[k].float(), atol=5e-2), k
