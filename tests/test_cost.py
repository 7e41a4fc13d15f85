"""Analytical FLOPs and storage accounting (paper App. C.6-C.7, Eqs. 11-21)."""
from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace

import pytest

from nbcore import cost
from nbcore.cost import (
    GDN_1_3B,
    MIB,
    AddedFlops,
    ExampleCounts,
    Linear,
    ModelShapes,
    added_flops,
    aggregate_flops,
    archive_bytes,
    attention_flops_per_key,
    backbone_flops_per_token,
    causal_key_count,
    conv_cache_bytes,
    conv_flops_per_token,
    linear_flops_per_token,
    lm_head_flops,
    mha_kv_cache_bytes,
    notebank_storage,
    plain_flops,
    recurrent_flops_per_token,
    recurrent_state_bytes,
    replay_attention_flops,
    route_flops,
    shapes_from_hf_config,
    storage_ratio,
    write_flops,
)

# Paper App. C.7, Eq. 18: means over 600 RULER examples at the 1M target length.
P_1M = 1_048_019
N_1M = 4092.3
U_1M = 232_514
HELPER = 0.402 * MIB
# Lengths for the Eq. 16 example. |Q| = 42 reproduces the paper's 1.09 GFLOPs routing cost at 1M
# (Fig. 7), |Y| = 128 is RULER's generation budget, |R| = 107 <= R*B = 128 (top-2, B = 64).
Q_1M, R_1M, Y_1M = 42, 107, 128


def _tiny_gdn(**kw) -> ModelShapes:
    """1 layer, 1 head, d_k = d_v = 2, D = 4: small enough to check by hand."""
    base = dict(
        name="tiny", hidden_size=4, vocab_size=10, num_layers=1,
        linears=(Linear("w", 4, 3), Linear("m", 3, 4, count=2)),
        recurrence="gdn", num_recurrent_layers=1, state_heads=1, address_heads=1,
        d_k=2, d_v=2, conv_kernel=4, conv_channels=6,
    )
    base.update(kw)
    return ModelShapes(**base)


# ------------------------------------------------------------------------ paper reproduction


def test_gdn_1_3b_backbone_flops_match_paper():
    f = backbone_flops_per_token(GDN_1_3B)
    assert f == 2_758_557_696
    assert f == pytest.approx(2.759e9, rel=1e-3)
    assert lm_head_flops(GDN_1_3B) == 131_072_000
    assert lm_head_flops(GDN_1_3B) == pytest.approx(1.311e8, rel=1e-3)


def test_gdn_1_3b_flops_components():
    # 24 layers x 2 x (5 * 2048^2 + 2 * 2048 * 8 + 3 * 2048 * 5632)
    assert linear_flops_per_token(GDN_1_3B) == 24 * 2 * (5 * 2048**2 + 2 * 2048 * 8 + 3 * 2048 * 5632)
    assert conv_flops_per_token(GDN_1_3B) == 2 * 4 * 192 * (2 * 256 + 256)  # Eq. 11, f_conv
    assert recurrent_flops_per_token(GDN_1_3B) == 192 * (7 * 256 * 256 + 256 + 2 * 256)  # Eq. 11, f_rec
    assert GDN_1_3B.channels == 192


@pytest.mark.parametrize(
    "drop, expected_rounded",
    [("attn.g_proj", 2.558e9), ("attn.a_proj", None)],
    ids=["without-g_proj", "without-a_proj-and-b_proj"],
)
def test_gdn_1_3b_other_matrix_sets_miss_the_paper(drop, expected_rounded):
    names = {drop} if drop == "attn.g_proj" else {"attn.a_proj", "attn.b_proj"}
    s = replace(GDN_1_3B, linears=tuple(m for m in GDN_1_3B.linears if m.name not in names))
    f = backbone_flops_per_token(s)
    assert round(f / 1e9, 3) != 2.759
    if expected_rounded is not None:
        assert f == pytest.approx(expected_rounded, rel=1e-3)


def test_storage_components_match_paper():
    st = notebank_storage(GDN_1_3B, num_notes=N_1M, archived_tokens=U_1M, helper_bytes=HELPER)
    mib = st.mib()
    assert mib["states"] == 48.0
    assert mib["conv"] == 1.125
    assert mib["archive"] == pytest.approx(24.959, rel=1e-3)
    assert mib["total"] == pytest.approx(74.49, rel=1e-3)


def test_storage_ratio_matches_paper():
    m_mha = mha_kv_cache_bytes(24, 2048, P_1M)
    assert m_mha / MIB == pytest.approx(196_503.5, rel=1e-5)
    r = storage_ratio(GDN_1_3B, input_len=P_1M, num_notes=N_1M, archived_tokens=U_1M, helper_bytes=HELPER)
    assert 1 / r == pytest.approx(2638, rel=1e-3)


def test_eq16_example_matches_paper():
    ex = ExampleCounts(context_len=P_1M - Q_1M, question_len=Q_1M, answer_len=Y_1M, replay_len=R_1M, num_notes=N_1M)
    agg = aggregate_flops(GDN_1_3B, [ex, ex])
    assert agg.n == 2
    assert agg.mean_plain / 1e12 == pytest.approx(2891.4, rel=1e-4)
    assert agg.mean_added / 1e12 == pytest.approx(0.722, rel=2e-3)
    assert agg.ratio_percent == pytest.approx(0.025, abs=5e-4)
    parts = added_flops(GDN_1_3B, context_len=P_1M - Q_1M, question_len=Q_1M, replay_len=R_1M,
                        answer_len=Y_1M, num_notes=N_1M)
    assert parts.route / 1e9 == pytest.approx(1.09, abs=0.01)  # Fig. 7 annotation for GDN


# ------------------------------------------------------------------------ hand-checkable cases


def test_tiny_backbone_by_hand():
    s = _tiny_gdn()
    assert linear_flops_per_token(s) == 2 * 4 * 3 + 2 * (2 * 3 * 4)  # 24 + 48
    assert conv_flops_per_token(s) == 2 * 4 * 1 * 6  # 48 = 2 c_conv J (2 d_k + d_v)
    assert recurrent_flops_per_token(s) == 7 * 4 + 2 + 4  # 34
    assert backbone_flops_per_token(s) == 72 + 48 + 34
    assert lm_head_flops(s) == 2 * 4 * 10


def test_mamba2_recurrent_term_by_hand():
    s = _tiny_gdn(recurrence="mamba2", state_heads=3, d_k=4, d_v=2)
    assert recurrent_flops_per_token(s) == 3 * (5 * 4 * 2 + 3 * 2)


@pytest.mark.parametrize(
    "T, Q, Y, expected",
    [(10, 2, 1, 12 * 154 + 80), (10, 2, 3, 14 * 154 + 3 * 80), (0, 1, 1, 154 + 80)],
    ids=["one-answer-token", "three-answer-tokens", "empty-context"],
)
def test_plain_flops_eq12(T, Q, Y, expected):
    assert plain_flops(_tiny_gdn(), context_len=T, question_len=Q, answer_len=Y) == expected


def test_plain_flops_rejects_empty_answer():
    with pytest.raises(ValueError, match="answer_len"):
        plain_flops(_tiny_gdn(), context_len=1, question_len=1, answer_len=0)


@pytest.mark.parametrize(
    "T, C, tail, expected",
    [
        (1024, 512, 32, 6 * 1024 * 3 * 4 + 4 * 2 * 3 * 4 + 2 * 1024 * 3 + 6 * 544 * 2),
        (1000, 512, 32, 6 * 1000 * 3 * 4 + 4 * 2 * 3 * 4 + 2 * 1000 * 3 + 6 * 544 * 1),
        (100, 512, 32, 6 * 100 * 3 * 4 + 4 * 1 * 3 * 4 + 2 * 100 * 3 + 0),
        (0, 512, 32, 0),
    ],
    ids=["two-full-chunks", "partial-last-chunk", "no-complete-chunk", "empty"],
)
def test_write_flops_eq14(T, C, tail, expected):
    assert write_flops(T, channels=3, d_k=4, chunk_size=C, tail=tail) == expected


@pytest.mark.parametrize(
    "Q, N, expected",
    [(5, 7, 2 * 5 * 7 * 3 * 16 + 3 * 12 * 3 * 16), (1, 1, 2 * 48 + 3 * 2 * 48), (5, 0, 0.0)],
    ids=["five-by-seven", "one-by-one", "empty-archive"],
)
def test_route_flops_eq15(Q, N, expected):
    assert route_flops(Q, N, channels=3, addr_dim=16) == expected


def test_added_flops_eq13_by_hand():
    s = _tiny_gdn()
    got = added_flops(s, context_len=1024, question_len=5, replay_len=9, answer_len=4, num_notes=7,
                      chunk_size=512, tail=32, addr_dim=16)
    assert got.write == write_flops(1024, channels=1, d_k=2, chunk_size=512, tail=32)
    assert got.route == 2 * 5 * 7 * 16 + 3 * 12 * 16
    assert got.question_match == 5 * 154
    assert got.replay == 9 * 154
    assert got.attention == 0.0
    assert got.total == got.write + got.route + (5 + 9) * 154


def test_added_flops_empty_archive_has_no_match_route_or_replay():
    got = added_flops(_tiny_gdn(), context_len=100, question_len=5, replay_len=0, answer_len=4, num_notes=0)
    assert (got.route, got.question_match, got.replay, got.attention) == (0.0, 0.0, 0.0, 0.0)
    assert got.total == got.write > 0
    with pytest.raises(ValueError, match="empty archive"):
        added_flops(_tiny_gdn(), context_len=100, question_len=5, replay_len=3, answer_len=4, num_notes=0)


def test_aggregate_ratio_is_ratio_of_sums_not_mean_of_ratios():
    s = _tiny_gdn()
    a = dict(context_len=10, question_len=2, answer_len=1, replay_len=1, num_notes=1)
    b = dict(context_len=1000, question_len=2, answer_len=1, replay_len=1, num_notes=1)
    agg = aggregate_flops(s, [a, b])
    pa = plain_flops(s, context_len=10, question_len=2, answer_len=1)
    pb = plain_flops(s, context_len=1000, question_len=2, answer_len=1)
    da = added_flops(s, replay_len=1, num_notes=1, context_len=10, question_len=2, answer_len=1).total
    db = added_flops(s, replay_len=1, num_notes=1, context_len=1000, question_len=2, answer_len=1).total
    assert agg.ratio_percent == pytest.approx(100 * (da + db) / (pa + pb))
    assert cost.added_flops_ratio(s, [a, b]) == agg.ratio_percent
    with pytest.raises(ValueError):
        aggregate_flops(s, [])


@pytest.mark.parametrize(
    "N, U, J, dr, expected",
    [(1, 64, 192, 16, 2 * 192 * 16 + 4 * 64 + 24), (10, 0, 1, 1, 20 + 240), (0, 0, 192, 16, 0)],
    ids=["one-note", "addresses-and-metadata-only", "empty"],
)
def test_archive_bytes_eq19(N, U, J, dr, expected):
    assert archive_bytes(N, U, channels=J, addr_dim=dr) == expected


def test_storage_eq17_and_eq20_by_hand():
    s = _tiny_gdn()
    assert mha_kv_cache_bytes(3, 8, 5) == 4 * 3 * 8 * 5
    assert recurrent_state_bytes(s) == 4 * 1 * 2 * 2
    assert conv_cache_bytes(s) == 2 * 4 * 1 * 6
    st = notebank_storage(s, num_notes=2, archived_tokens=10, addr_dim=4, helper_bytes=7)
    assert st.archive == 2 * 2 * 1 * 4 + 40 + 48
    assert st.total == st.archive + 16 + 48 + 7


# ------------------------------------------------------------------------ hybrids


def _hybrid() -> ModelShapes:
    return _tiny_gdn(num_layers=2, num_attention_layers=1, attention_heads=2, attention_kv_heads=1,
                     attention_head_dim=3)


def test_attention_flops_per_key():
    assert attention_flops_per_key(_tiny_gdn()) == 0
    assert attention_flops_per_key(_hybrid()) == 4 * 1 * 2 * 3


@pytest.mark.parametrize("T, Q, R, Y", [(5, 2, 3, 4), (0, 1, 1, 1), (17, 4, 0, 2)],
                         ids=["small", "minimal", "no-replay"])
def test_replay_attention_equals_brute_force_position_count(T, Q, R, Y):
    """NB-TF minus Plain attention keys, counted position by position (position p sees p+1 keys)."""
    plain = sum(p + 1 for p in range(T + Q + Y - 1))
    nb = sum(p + 1 for p in range(T))                      # context
    nb += sum(p + 1 for p in range(T, T + Q))              # question match from a copy of S_T
    nb += sum(p + 1 for p in range(T, T + R + Q + Y - 1))  # replay, question, answer from S_T
    a = attention_flops_per_key(_hybrid())
    got = replay_attention_flops(_hybrid(), context_len=T, question_len=Q, replay_len=R, answer_len=Y)
    assert got == a * (nb - plain)
    assert causal_key_count(T, Q) == sum(p + 1 for p in range(T, T + Q))


def test_hybrid_plain_and_added_include_attention():
    h = _hybrid()
    f, a = backbone_flops_per_token(h), attention_flops_per_key(h)
    n = 5 + 2 + 4 - 1
    expected = n * f + 4 * lm_head_flops(h) + a * n * (n + 1) / 2
    assert plain_flops(h, context_len=5, question_len=2, answer_len=4) == expected
    got = added_flops(h, context_len=5, question_len=2, replay_len=3, answer_len=4, num_notes=1)
    assert isinstance(got, AddedFlops) and got.attention > 0
    st = notebank_storage(h, num_notes=1, archived_tokens=3, input_len=100)
    assert st.attention_kv == 2 * 2 * 1 * 1 * 3 * 100
    with pytest.raises(ValueError, match="input_len"):
        notebank_storage(h, num_notes=1, archived_tokens=3)


# ------------------------------------------------------------------------ transformers configs


def _linear_param_flops(model) -> int:
    """2 x (weights of every nn.Linear except the LM head), read from an instantiated model."""
    import torch.nn as nn

    return sum(2 * m.weight.numel() for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and not n.endswith("lm_head"))


def test_qwen3_5_shapes_match_instantiated_model():
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=8, linear_value_head_dim=6, vocab_size=50)
    s = shapes_from_hf_config(cfg)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg)
    assert linear_flops_per_token(s) == _linear_param_flops(model)
    assert (s.num_recurrent_layers, s.num_attention_layers, s.num_layers) == (3, 1, 4)
    assert s.channels == 3 * 2 and s.total_state_heads == 3 * 4
    gdn = next(m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet")
    assert s.conv_channels == gdn.conv1d.in_channels and s.conv_kernel == gdn.conv1d.kernel_size[0]
    assert attention_flops_per_key(s) == 4 * 1 * 4 * 8
    assert lm_head_flops(s) == 2 * 32 * 50


def test_qwen3_5_9b_default_config():
    from transformers import Qwen3_5TextConfig

    s = shapes_from_hf_config(Qwen3_5TextConfig())  # defaults are the Qwen3.5-9B text tower
    assert (s.num_recurrent_layers, s.num_attention_layers) == (24, 8)
    assert s.channels == 384  # paper App. C.1


def test_qwen3_next_moe_counts_active_experts():
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=8, linear_value_head_dim=6, vocab_size=50, num_experts=6,
                          num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=16,
                          mlp_only_layers=[1])
    s = shapes_from_hf_config(cfg)
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(cfg)
    expected = _linear_param_flops(model)
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):  # router (a bare parameter)
            expected += 2 * p.numel()
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # only top-k experts run
            expected += 2 * p.numel() * cfg.num_experts_per_tok // cfg.num_experts
    assert linear_flops_per_token(s) == expected
    names = {m.name for m in s.linears}
    assert {"linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "mlp.gate_proj"} <= names


def test_mamba2_shapes_match_instantiated_model():
    import torch
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, state_size=16, n_groups=2,
                       expand=2, conv_kernel=4, vocab_size=50)
    s = shapes_from_hf_config(cfg)
    torch.manual_seed(0)
    model = Mamba2ForCausalLM(cfg)
    assert linear_flops_per_token(s) == _linear_param_flops(model)
    mixer = model.backbone.layers[0].mixer
    assert s.conv_channels == mixer.conv1d.in_channels == 64 + 2 * 2 * 16
    assert s.channels == 2 * 2 and s.total_state_heads == 2 * 8
    assert recurrent_flops_per_token(s) == 16 * (5 * 16 * 8 + 3 * 8)
    assert conv_flops_per_token(s) == 2 * 4 * 2 * 128


def test_unsupported_config_is_rejected():
    class Cfg:
        model_type = "llama"
        hidden_size = 8

    with pytest.raises(ValueError, match="unsupported config"):
        shapes_from_hf_config(Cfg())


def test_module_import_is_light():
    """cost.py imports only the standard library; transformers and ray stay unloaded."""
    import ast

    tree = ast.parse(open(cost.__file__).read())
    roots = {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    roots |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert roots <= {"__future__", "math", "dataclasses", "typing"}
    code = "import sys, nbcore.cost; print(any(m in sys.modules for m in ('transformers', 'ray')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_invalid_shapes_rejected():
    with pytest.raises(ValueError, match="recurrence"):
        _tiny_gdn(recurrence="lstm")
    assert math.isclose(causal_key_count(3, 0), 0.0)
