"""Analytical FLOPs (paper App. C.6, Eqs. 11-16) and persistent storage (App. C.7, Eqs. 17-21).

The RULER report puts these beside the measured times and archive sizes (pipeline/reporting/cost.py:
``shapes_from_hf_config`` of each backbone, then ``plain_flops``/``added_flops``/``archive_bytes``/
``notebank_storage`` terms on the counts every example records).

Everything here is a pure function of *shapes* and recorded *counts*; nothing runs a model and
nothing imports torch, transformers or ray at import time (transformers configs are duck-typed).

Conventions (paper App. C.6):

* one multiply-add = 2 FLOPs; a ``d_in -> d_out`` matrix applied to one token costs ``2 d_in d_out``;
* ``f_phi`` = backbone FLOPs per token *without* the LM head: the sum of ``2 d_in d_out`` over all
  projection and MLP matrices (from checkpoint shapes), plus the depthwise short-convolution cost
  ``f_conv`` and the recurrent-equivalent cost ``f_rec`` (Eq. 11);
* ``h_phi = 2 D V`` is the LM-head cost of one prediction;
* pointwise operations (norms, activations, gates, softmax), embedding look-ups, sorting, indexing
  and data movement are not counted, as in the paper.

Reproducing the paper's GDN-1.3B numbers (``GDN_1_3B``, fla layout, m-a-p/1.3B-100B-GatedDeltaNet-pure:
D = 2048, 24 layers, 8 heads, d_k = d_v = 256, intermediate 5632, vocab 32000). Per layer the fla
``GatedDeltaNet`` layer has ``q_proj``, ``k_proj``, ``v_proj`` (2048 -> 2048 each), ``g_proj``
(2048 -> 2048, output gate, ``use_gate=True``), ``a_proj`` and ``b_proj`` (2048 -> 8 each) and
``o_proj`` (2048 -> 2048); the MLP has ``gate_proj``/``up_proj`` (2048 -> 5632) and ``down_proj``
(5632 -> 2048). Hence per layer

    2 * (5 * 2048 * 2048 + 2 * 2048 * 8 + 3 * 2048 * 5632) = 111,214,592 FLOPs,

times 24 layers = 2,669,150,208; plus f_conv = 2 * 4 * 192 * (2*256 + 256) = 1,179,648 and
f_rec = 192 * (7 * 256 * 256 + 256 + 2 * 256) = 88,227,840, giving
**f_phi = 2,758,557,696 ~ 2.759e9** FLOPs/token; h_phi = 2 * 2048 * 32000 = 131,072,000 ~ 1.311e8.
Dropping ``a_proj``/``b_proj`` would give 2.75698e9 (rounds to 2.757e9) and dropping ``g_proj``
2.558e9, so the paper's 2.759e9 is reproduced exactly by the full set of matrices above.

Symbols: ``T`` context tokens, ``|Q|`` question tokens, ``|Y|`` answer tokens (the Plain answer
length is used for both methods), ``|R|`` replay tokens (<= R*B), ``N`` notes, ``U`` archived
tokens, ``J`` indexed layer-head channels, ``d_rho`` address width, ``C`` write chunk size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

__all__ = [
    "MIB",
    "Linear",
    "ModelShapes",
    "GDN_1_3B",
    "shapes_from_hf_config",
    "linear_flops_per_token",
    "conv_flops_per_token",
    "recurrent_flops_per_token",
    "backbone_flops_per_token",
    "lm_head_flops",
    "attention_flops_per_key",
    "causal_key_count",
    "plain_flops",
    "write_flops",
    "route_flops",
    "replay_attention_flops",
    "AddedFlops",
    "added_flops",
    "ExampleCounts",
    "FlopsAggregate",
    "aggregate_flops",
    "added_flops_ratio",
    "mha_kv_cache_bytes",
    "archive_bytes",
    "recurrent_state_bytes",
    "conv_cache_bytes",
    "attention_kv_bytes",
    "StorageBreakdown",
    "notebank_storage",
    "storage_ratio",
]

MIB = 2**20  # the paper's 1 MiB = 2^20 bytes (App. C.7)

RECURRENCES = ("gdn", "mamba2")


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Linear:
    """A dense matrix ``d_in -> d_out`` applied ``count`` times per token.

    ``count`` is the number of layers holding that matrix times, for mixture-of-experts, the number
    of experts active per token (``num_experts_per_tok``).
    """

    name: str
    d_in: int
    d_out: int
    count: int = 1

    @property
    def flops(self) -> int:
        """``2 d_in d_out`` per application (one multiply-add = 2 FLOPs), times ``count``."""
        return 2 * self.d_in * self.d_out * self.count


@dataclass(frozen=True)
class ModelShapes:
    """Checkpoint shapes needed by the cost model.

    Attributes:
        name: label for reports.
        hidden_size: D (also the MHA reference width of Eq. 17).
        vocab_size: V (LM head, ``h_phi = 2 D V``).
        num_layers: |L| of the whole model (all blocks; Eq. 17).
        linears: every projection/MLP matrix applied per token (see :class:`Linear`).
        recurrence: ``"gdn"`` (Gated DeltaNet, Eq. 11) or ``"mamba2"`` (see
            :func:`recurrent_flops_per_token`).
        num_recurrent_layers: recurrent (linear-attention / SSM) blocks.
        state_heads: recurrent state heads per recurrent block (GDN: value heads, each holding a
            ``d_k x d_v`` state; Mamba-2: SSM heads, each holding ``head_dim x d_state``).
        address_heads: NoteBank layer-head channels per recurrent block (GDN: key/query heads;
            Mamba-2: B/C groups). ``J = num_recurrent_layers * address_heads`` (paper: 192 for
            GDN-1.3B, 48 for Mamba-2-1.3B, 384 for Qwen3.5-9B).
        d_k: per-head key width (Mamba-2: ``d_state``).
        d_v: per-head value width (Mamba-2: ``head_dim``).
        conv_kernel: ``c_conv`` of the depthwise short convolution (4 in all evaluated models).
        conv_channels: depthwise conv channels per recurrent block (GDN: ``2 key_dim + value_dim``;
            Mamba-2: ``d_inner + 2 n_groups d_state``).
        num_attention_layers, attention_heads, attention_kv_heads, attention_head_dim: softmax
            attention blocks of a hybrid (0 for pure recurrent models).
    """

    name: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    linears: tuple[Linear, ...]
    recurrence: str
    num_recurrent_layers: int
    state_heads: int
    address_heads: int
    d_k: int
    d_v: int
    conv_kernel: int = 4
    conv_channels: int = 0
    num_attention_layers: int = 0
    attention_heads: int = 0
    attention_kv_heads: int = 0
    attention_head_dim: int = 0
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.recurrence not in RECURRENCES:
            raise ValueError(f"ModelShapes.recurrence must be one of {RECURRENCES}, got {self.recurrence!r}")
        for k in ("hidden_size", "vocab_size", "num_layers", "d_k", "d_v"):
            if int(getattr(self, k)) <= 0:
                raise ValueError(f"ModelShapes.{k} must be positive, got {getattr(self, k)!r}")

    @property
    def channels(self) -> int:
        """J = |L x H|: indexed layer-head channels (Eqs. 14, 15, 19)."""
        return self.num_recurrent_layers * self.address_heads

    @property
    def total_state_heads(self) -> int:
        """Recurrent states held by the model (Eq. 20's ``J`` in ``4 J d_k d_v``)."""
        return self.num_recurrent_layers * self.state_heads

    @property
    def is_hybrid(self) -> bool:
        return self.num_attention_layers > 0


def _gdn_1_3b() -> ModelShapes:
    D, L, H, dk, dv, inter, V = 2048, 24, 8, 256, 256, 5632, 32000
    kd, vd = H * dk, H * dv
    return ModelShapes(
        name="GDN-1.3B (m-a-p/1.3B-100B-GatedDeltaNet-pure, fla layout)",
        hidden_size=D,
        vocab_size=V,
        num_layers=L,
        linears=(
            Linear("attn.q_proj", D, kd, L),
            Linear("attn.k_proj", D, kd, L),
            Linear("attn.v_proj", D, vd, L),
            Linear("attn.g_proj", D, vd, L),
            Linear("attn.a_proj", D, H, L),
            Linear("attn.b_proj", D, H, L),
            Linear("attn.o_proj", vd, D, L),
            Linear("mlp.gate_proj", D, inter, L),
            Linear("mlp.up_proj", D, inter, L),
            Linear("mlp.down_proj", inter, D, L),
        ),
        recurrence="gdn",
        num_recurrent_layers=L,
        state_heads=H,
        address_heads=H,
        d_k=dk,
        d_v=dv,
        conv_kernel=4,
        conv_channels=2 * kd + vd,
        notes="f_phi = 2,758,557,696 (paper: 2.759e9); h_phi = 131,072,000 (paper: 1.311e8)",
    )


GDN_1_3B: ModelShapes = _gdn_1_3b()


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    v = getattr(config, name, default)
    return default if v is None else v


def _mlp_linears(config: Any, layer_ids: list[int], prefix: str = "mlp") -> list[Linear]:
    """Dense SwiGLU MLP or Qwen-style sparse MoE block (active experts only)."""
    D = int(config.hidden_size)
    n = len(layer_ids)
    num_experts = int(_cfg(config, "num_experts", 0) or 0)
    if num_experts <= 0:
        inter = int(config.intermediate_size)
        return [
            Linear(f"{prefix}.gate_proj", D, inter, n),
            Linear(f"{prefix}.up_proj", D, inter, n),
            Linear(f"{prefix}.down_proj", inter, D, n),
        ]
    # Qwen3-Next / Qwen3.5-MoE: layer i is sparse iff i not in mlp_only_layers and
    # (i + 1) % decoder_sparse_step == 0; otherwise a dense MLP of intermediate_size.
    mlp_only = set(_cfg(config, "mlp_only_layers", []) or [])
    step = int(_cfg(config, "decoder_sparse_step", 1) or 1)
    sparse = [i for i in layer_ids if i not in mlp_only and (i + 1) % step == 0]
    dense = n - len(sparse)
    out: list[Linear] = []
    if dense:
        inter = int(config.intermediate_size)
        out += [
            Linear(f"{prefix}.gate_proj", D, inter, dense),
            Linear(f"{prefix}.up_proj", D, inter, dense),
            Linear(f"{prefix}.down_proj", inter, D, dense),
        ]
    if sparse:
        s = len(sparse)
        k = int(config.num_experts_per_tok)
        mi = int(config.moe_intermediate_size)
        out += [
            Linear(f"{prefix}.router", D, num_experts, s),
            Linear(f"{prefix}.experts.gate_up_proj", D, 2 * mi, s * k),
            Linear(f"{prefix}.experts.down_proj", mi, D, s * k),
        ]
        si = int(_cfg(config, "shared_expert_intermediate_size", 0) or 0)
        if si > 0:
            out += [
                Linear(f"{prefix}.shared_expert.gate_proj", D, si, s),
                Linear(f"{prefix}.shared_expert.up_proj", D, si, s),
                Linear(f"{prefix}.shared_expert.down_proj", si, D, s),
                Linear(f"{prefix}.shared_expert_gate", D, 1, s),
            ]
    return out


def _qwen_gdn_hybrid(config: Any) -> ModelShapes:
    D = int(config.hidden_size)
    L = int(config.num_hidden_layers)
    layer_types = list(_cfg(config, "layer_types", None) or [])
    if not layer_types:
        interval = int(_cfg(config, "full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(L)]
    lin = [i for i, t in enumerate(layer_types) if t == "linear_attention"]
    att = [i for i, t in enumerate(layer_types) if t != "linear_attention"]
    hk, hv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    dk, dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
    kd, vd = hk * dk, hv * dv
    nl, na = len(lin), len(att)
    model_type = str(_cfg(config, "model_type", ""))
    linears: list[Linear] = []
    if nl:
        if model_type.startswith("qwen3_next"):
            # fused in_proj_qkvz (D -> 2 kd + 2 vd) and in_proj_ba (D -> 2 hv)
            linears += [
                Linear("linear_attn.in_proj_qkvz", D, 2 * kd + 2 * vd, nl),
                Linear("linear_attn.in_proj_ba", D, 2 * hv, nl),
            ]
        else:
            linears += [
                Linear("linear_attn.in_proj_qkv", D, 2 * kd + vd, nl),
                Linear("linear_attn.in_proj_z", D, vd, nl),
                Linear("linear_attn.in_proj_b", D, hv, nl),
                Linear("linear_attn.in_proj_a", D, hv, nl),
            ]
        linears.append(Linear("linear_attn.out_proj", vd, D, nl))
    nh = int(config.num_attention_heads)
    nkv = int(_cfg(config, "num_key_value_heads", nh))
    hd = int(_cfg(config, "head_dim", D // nh))
    if na:
        linears += [
            # q_proj emits the query and its output gate (2 * heads * head_dim) in Qwen3-Next/3.5
            Linear("self_attn.q_proj", D, 2 * nh * hd, na),
            Linear("self_attn.k_proj", D, nkv * hd, na),
            Linear("self_attn.v_proj", D, nkv * hd, na),
            Linear("self_attn.o_proj", nh * hd, D, na),
        ]
    linears += _mlp_linears(config, list(range(L)))
    return ModelShapes(
        name=f"{model_type or 'qwen-gdn-hybrid'} D={D} L={L} ({nl} GDN + {na} attention)",
        hidden_size=D,
        vocab_size=int(config.vocab_size),
        num_layers=L,
        linears=tuple(linears),
        recurrence="gdn",
        num_recurrent_layers=nl,
        state_heads=hv,
        address_heads=hk,
        d_k=dk,
        d_v=dv,
        conv_kernel=int(_cfg(config, "linear_conv_kernel_dim", 4)),
        conv_channels=2 * kd + vd,
        num_attention_layers=na,
        attention_heads=nh if na else 0,
        attention_kv_heads=nkv if na else 0,
        attention_head_dim=hd if na else 0,
    )


def _mamba2(config: Any) -> ModelShapes:
    D = int(config.hidden_size)
    L = int(config.num_hidden_layers)
    d_inner = int(float(config.expand) * D)
    H = int(config.num_heads)
    P = int(config.head_dim)
    N = int(config.state_size)
    G = int(config.n_groups)
    conv_dim = d_inner + 2 * G * N
    return ModelShapes(
        name=f"mamba2 D={D} L={L}",
        hidden_size=D,
        vocab_size=int(config.vocab_size),
        num_layers=L,
        linears=(
            # in_proj: D -> z (d_inner) | x,B,C (conv_dim) | dt (num_heads)
            Linear("mixer.in_proj", D, d_inner + conv_dim + H, L),
            Linear("mixer.out_proj", d_inner, D, L),
        ),
        recurrence="mamba2",
        num_recurrent_layers=L,
        state_heads=H,
        address_heads=G,
        d_k=N,
        d_v=P,
        conv_kernel=int(config.conv_kernel),
        conv_channels=conv_dim,
    )


def shapes_from_hf_config(config: Any) -> ModelShapes:
    """Build :class:`ModelShapes` from a transformers config (duck-typed; nothing is imported).

    Supported: ``Qwen3_5TextConfig`` (and a ``Qwen3_5Config`` via its ``text_config``),
    ``Qwen3_5MoeTextConfig``, ``Qwen3NextConfig`` (GDN blocks: ``in_proj_qkv``/``in_proj_z``/
    ``in_proj_b``/``in_proj_a`` or fused ``in_proj_qkvz``/``in_proj_ba``, then ``out_proj``;
    attention blocks: ``q_proj`` (query + output gate), ``k_proj``, ``v_proj``, ``o_proj``; MLP
    ``gate/up/down_proj`` or the MoE router, ``num_experts_per_tok`` active experts, shared expert
    and its gate), and ``Mamba2Config`` (``in_proj``, ``out_proj``).
    """
    text = getattr(config, "text_config", None)
    if text is not None and not hasattr(config, "linear_num_key_heads"):
        config = text
    if hasattr(config, "linear_num_key_heads"):
        return _qwen_gdn_hybrid(config)
    if hasattr(config, "state_size") and hasattr(config, "n_groups") and hasattr(config, "head_dim"):
        return _mamba2(config)
    raise ValueError(
        f"shapes_from_hf_config: unsupported config {type(config).__name__} "
        f"(model_type={getattr(config, 'model_type', None)!r}); expected Qwen3_5TextConfig, "
        "Qwen3NextConfig, Qwen3_5MoeTextConfig or Mamba2Config"
    )


# --------------------------------------------------------------------------------------------
# Per-token backbone cost (Eq. 11)
# --------------------------------------------------------------------------------------------


def linear_flops_per_token(shapes: ModelShapes) -> int:
    """Sum of ``2 d_in d_out`` over projection and MLP matrices (App. C.6)."""
    return sum(m.flops for m in shapes.linears)


def conv_flops_per_token(shapes: ModelShapes) -> int:
    """f_conv (Eq. 11): ``2 c_conv`` per depthwise-conv channel and recurrent block.

    For GDN with equal key/value heads this is ``2 c_conv J (2 d_k + d_v)``; in general it is
    ``2 c_conv L_rec (2 key_dim + value_dim)``. For Mamba-2 the convolution runs over x, B and C:
    ``2 c_conv L (d_inner + 2 n_groups d_state)``.
    """
    return 2 * shapes.conv_kernel * shapes.num_recurrent_layers * shapes.conv_channels


def recurrent_flops_per_token(shapes: ModelShapes) -> int:
    """f_rec, the recurrent-equivalent cost per token (Eq. 11 for GDN).

    GDN (per state head, state ``S`` of ``d_k x d_v``): decay ``d_k d_v``, key readout ``S k``
    ``2 d_k d_v``, rank-one update ``2 d_k d_v``, query readout ``2 d_k d_v``, vector scaling
    ``d_k + 2 d_v`` -> ``J (7 d_k d_v + d_k + 2 d_v)`` (Eq. 11).

    Mamba-2 (derivation, same conventions; per SSM head with state ``h`` of ``d_state x head_dim``,
    scalar decay ``a_t = exp(dt_t A)``): ``h <- a_t h`` (``d_k d_v``), ``h += (dt_t x_t) B_t^T``
    (rank-one update, ``2 d_k d_v``; the ``dt_t x_t`` scaling ``d_v``), readout ``y = h C_t``
    (``2 d_k d_v``), skip ``y += D x_t`` (``2 d_v``) -> ``J_state (5 d_k d_v + 3 d_v)`` with
    ``d_k = d_state``, ``d_v = head_dim``, ``J_state = layers x heads``. B and C are shared by the
    heads of a group, so no per-head key readout exists (unlike the delta rule).
    """
    J, dk, dv = shapes.total_state_heads, shapes.d_k, shapes.d_v
    if shapes.recurrence == "gdn":
        return J * (7 * dk * dv + dk + 2 * dv)
    return J * (5 * dk * dv + 3 * dv)


def backbone_flops_per_token(shapes: ModelShapes) -> int:
    """f_phi: backbone FLOPs per token without the LM head (App. C.6, Eq. 11).

    ``f_phi = sum 2 d_in d_out + f_conv + f_rec``. For hybrids the position-dependent softmax
    attention term is *not* part of f_phi (see :func:`attention_flops_per_key`).
    """
    return linear_flops_per_token(shapes) + conv_flops_per_token(shapes) + recurrent_flops_per_token(shapes)


def lm_head_flops(shapes: ModelShapes) -> int:
    """h_phi = 2 D V (App. C.6)."""
    return 2 * shapes.hidden_size * shapes.vocab_size


def attention_flops_per_key(shapes: ModelShapes) -> int:
    """FLOPs of one (query, key) pair summed over the attention blocks of a hybrid.

    Per block and query head: ``q . k`` is ``d_h`` multiply-adds and the value accumulation another
    ``d_h`` -> ``4 H_q d_h`` FLOPs per pair (softmax excluded); 0 for pure recurrent models.
    """
    return 4 * shapes.num_attention_layers * shapes.attention_heads * shapes.attention_head_dim


def causal_key_count(start: float, count: float) -> float:
    """Keys attended by ``count`` consecutive positions starting at 0-based position ``start``.

    Position ``p`` attends to ``p + 1`` keys (itself included): ``sum_{p=start}^{start+count-1} (p+1)
    = count * start + count (count + 1) / 2``.
    """
    if count <= 0:
        return 0.0
    return count * start + count * (count + 1) / 2


# --------------------------------------------------------------------------------------------
# Plain and NoteBank costs (Eqs. 12-16)
# --------------------------------------------------------------------------------------------


def _check_counts(**kw: float) -> None:
    for k, v in kw.items():
        if v is None or v < 0:
            raise ValueError(f"{k} must be >= 0, got {v!r}")


def plain_flops(shapes: ModelShapes, *, context_len: float, question_len: float, answer_len: float) -> float:
    """F_Plain (Eq. 12): ``(T + |Q| + |Y| - 1) f_phi + |Y| h_phi``.

    The final input position predicts the first answer token, so only ``|Y| - 1`` further backbone
    steps run. Hybrids add causal attention over the same ``T + |Q| + |Y| - 1`` positions:
    ``attention_flops_per_key * n (n + 1) / 2``.
    """
    _check_counts(context_len=context_len, question_len=question_len)
    if answer_len < 1:
        raise ValueError(f"answer_len must be >= 1 (Eq. 12 predicts at least one token), got {answer_len!r}")
    n = context_len + question_len + answer_len - 1
    total = n * backbone_flops_per_token(shapes) + answer_len * lm_head_flops(shapes)
    a = attention_flops_per_key(shapes)
    if a:
        total += a * causal_key_count(0, n)
    return float(total)


def write_flops(context_len: float, *, channels: int, d_k: int, chunk_size: int = 512, tail: int = 32) -> float:
    """F_write (Eq. 14), the evaluated writer (W = 2, ``tail``-token rolling tail):

    ``6 T J d_k + 4 ceil(T/C) J d_k + 2 T J + 6 (C + tail) floor(T/C)``

    (key normalisation, chunk means, distinctiveness scores, channel aggregation; the last term
    bounds window selection). Address construction reuses these scores (no backbone pass).
    """
    _check_counts(context_len=context_len)
    T, J, C = context_len, channels, chunk_size
    if C <= 0:
        raise ValueError(f"chunk_size must be positive, got {C!r}")
    return float(6 * T * J * d_k + 4 * math.ceil(T / C) * J * d_k + 2 * T * J + 6 * (C + tail) * math.floor(T / C))


def route_flops(question_len: float, num_notes: float, *, channels: int, addr_dim: int = 16) -> float:
    """F_route (Eq. 15): ``2 |Q| N J d_rho + 3 (|Q| + N) J d_rho``; 0 for an empty archive.

    Dot products of every question position against all N stored addresses in every channel,
    plus address normalisation.
    """
    _check_counts(question_len=question_len, num_notes=num_notes)
    if num_notes == 0:
        return 0.0
    J, dr = channels, addr_dim
    return float(2 * question_len * num_notes * J * dr + 3 * (question_len + num_notes) * J * dr)


def replay_attention_flops(
    shapes: ModelShapes, *, context_len: float, question_len: float, replay_len: float, answer_len: float
) -> float:
    """Attention cost added by NoteBank in a hybrid (it does not cancel as the f_phi terms do).

    With ``a = attention_flops_per_key(shapes)`` and 0-based positions (position p sees p+1 keys):

    * question match from a copy of S_T: positions ``T .. T+|Q|-1`` -> ``a * K(T, |Q|)``;
    * replay from S_T: positions ``T .. T+|R|-1`` -> ``a * K(T, |R|)``;
    * the ``|Q| + |Y| - 1`` later positions each see ``|R|`` extra keys -> ``a |R| (|Q| + |Y| - 1)``;

    where ``K(s, n) = n s + n (n + 1) / 2`` (:func:`causal_key_count`). Together this is exactly
    the attention cost of the NB-TF run minus that of Plain. 0 for pure recurrent models.
    """
    _check_counts(context_len=context_len, question_len=question_len, replay_len=replay_len)
    a = attention_flops_per_key(shapes)
    if not a:
        return 0.0
    T, Q, R = context_len, question_len, replay_len
    later = Q + max(answer_len - 1, 0)
    return float(a * (causal_key_count(T, Q) + causal_key_count(T, R) + R * later))


@dataclass(frozen=True)
class AddedFlops:
    """Components of ΔF = F_NB-TF − F_Plain (Eq. 13)."""

    write: float
    route: float
    question_match: float
    replay: float
    attention: float = 0.0

    @property
    def total(self) -> float:
        return self.write + self.route + self.question_match + self.replay + self.attention


def added_flops(
    shapes: ModelShapes,
    *,
    context_len: float,
    question_len: float,
    replay_len: float,
    answer_len: float,
    num_notes: float,
    chunk_size: int = 512,
    tail: int = 32,
    addr_dim: int = 16,
    channels: int | None = None,
) -> AddedFlops:
    """ΔF (Eq. 13) = F_write + F_route + (|Q| + |R|) f_phi (+ replay attention for hybrids).

    The extra backbone passes are the question match (|Q| f_phi) and the replay (|R| f_phi);
    ordinary question processing and answer generation cancel against Plain. An empty archive
    (``num_notes == 0``) incurs no match, routing or replay (writing is still charged).
    ``channels`` overrides J (default ``shapes.channels``).
    """
    _check_counts(replay_len=replay_len, num_notes=num_notes, question_len=question_len)
    J = shapes.channels if channels is None else channels
    w = write_flops(context_len, channels=J, d_k=shapes.d_k, chunk_size=chunk_size, tail=tail)
    if num_notes == 0:
        if replay_len:
            raise ValueError(f"replay_len must be 0 for an empty archive, got {replay_len!r}")
        return AddedFlops(write=w, route=0.0, question_match=0.0, replay=0.0, attention=0.0)
    f = backbone_flops_per_token(shapes)
    return AddedFlops(
        write=w,
        route=route_flops(question_len, num_notes, channels=J, addr_dim=addr_dim),
        question_match=float(question_len * f),
        replay=float(replay_len * f),
        attention=replay_attention_flops(
            shapes, context_len=context_len, question_len=question_len, replay_len=replay_len, answer_len=answer_len
        ),
    )


@dataclass(frozen=True)
class ExampleCounts:
    """Recorded lengths of one evaluated example (App. C.6 uses recorded counts)."""

    context_len: float
    question_len: float
    answer_len: float
    replay_len: float = 0
    num_notes: float = 0

    @classmethod
    def coerce(cls, x: "ExampleCounts | Mapping[str, float]") -> "ExampleCounts":
        if isinstance(x, ExampleCounts):
            return x
        names = ("context_len", "question_len", "answer_len", "replay_len", "num_notes")
        return cls(**{k: x[k] for k in names if k in x})


@dataclass(frozen=True)
class FlopsAggregate:
    """Per-example accounting summed over examples (Eq. 16)."""

    n: int
    total_plain: float
    total_added: float

    @property
    def mean_plain(self) -> float:
        return self.total_plain / self.n

    @property
    def mean_added(self) -> float:
        return self.total_added / self.n

    @property
    def ratio_percent(self) -> float:
        """``100% * sum_e ΔF_e / sum_e F_Plain,e`` (Eq. 16)."""
        return 100.0 * self.total_added / self.total_plain


def aggregate_flops(
    shapes: ModelShapes,
    examples: Iterable["ExampleCounts | Mapping[str, float]"],
    *,
    chunk_size: int = 512,
    tail: int = 32,
    addr_dim: int = 16,
    channels: int | None = None,
) -> FlopsAggregate:
    """Sum F_Plain (Eq. 12) and ΔF (Eq. 13) over examples, costed one example at a time."""
    n, tp, ta = 0, 0.0, 0.0
    for x in examples:
        e = ExampleCounts.coerce(x)
        tp += plain_flops(shapes, context_len=e.context_len, question_len=e.question_len, answer_len=e.answer_len)
        ta += added_flops(
            shapes,
            context_len=e.context_len,
            question_len=e.question_len,
            replay_len=e.replay_len,
            answer_len=e.answer_len,
            num_notes=e.num_notes,
            chunk_size=chunk_size,
            tail=tail,
            addr_dim=addr_dim,
            channels=channels,
        ).total
        n += 1
    if n == 0:
        raise ValueError("aggregate_flops needs at least one example")
    return FlopsAggregate(n=n, total_plain=tp, total_added=ta)


def added_flops_ratio(
    shapes: ModelShapes, examples: Iterable["ExampleCounts | Mapping[str, float]"], **kw: Any
) -> float:
    """Added FLOPs ratio in percent (Eq. 16): ``100% * sum_e ΔF_e / sum_e F_Plain,e``."""
    return aggregate_flops(shapes, examples, **kw).ratio_percent


# --------------------------------------------------------------------------------------------
# Persistent storage (Eqs. 17-21), in bytes
# --------------------------------------------------------------------------------------------


def mha_kv_cache_bytes(num_layers: int, hidden_size: int, input_len: float, bytes_per_element: int = 2) -> float:
    """M_MHA (Eq. 17): keys and values of a full MHA cache, ``2 * bytes * |L| D P`` (= 4|L|DP in BF16)."""
    _check_counts(input_len=input_len)
    return float(2 * bytes_per_element * num_layers * hidden_size * input_len)


def archive_bytes(num_notes: float, archived_tokens: float, *, channels: int, addr_dim: int = 16) -> float:
    """Storage_NB (Eq. 19): ``2 N J d_rho + 4 U + 24 N`` bytes.

    BF16 addresses (one ``d_rho`` vector per channel and note), int32 token ids, and three uint64
    metadata fields (chunk, start, end) per note.
    """
    _check_counts(num_notes=num_notes, archived_tokens=archived_tokens)
    return float(2 * num_notes * channels * addr_dim + 4 * archived_tokens + 24 * num_notes)


def recurrent_state_bytes(shapes: ModelShapes) -> int:
    """FP32 recurrent states: ``4 J d_k d_v`` (Eq. 20; J = all state heads)."""
    return 4 * shapes.total_state_heads * shapes.d_k * shapes.d_v


def conv_cache_bytes(shapes: ModelShapes) -> int:
    """BF16 short-conv caches: ``2 c_conv J (2 d_k + d_v)`` for GDN (Eq. 20); in general
    ``2 c_conv L_rec conv_channels``."""
    return 2 * shapes.conv_kernel * shapes.num_recurrent_layers * shapes.conv_channels


def attention_kv_bytes(shapes: ModelShapes, tokens: float, bytes_per_element: int = 2) -> float:
    """KV cache of a hybrid's attention blocks: ``2 * bytes * L_attn * kv_heads * d_h * tokens``."""
    return float(2 * bytes_per_element * shapes.num_attention_layers * shapes.attention_kv_heads
                 * shapes.attention_head_dim * tokens)


@dataclass(frozen=True)
class StorageBreakdown:
    """M_NB (Eq. 20) by component, in bytes."""

    archive: float
    states: float
    conv: float
    helper: float
    attention_kv: float = 0.0

    @property
    def total(self) -> float:
        return self.archive + self.states + self.conv + self.helper + self.attention_kv

    def mib(self) -> dict[str, float]:
        """Every component and the total in MiB (2^20 bytes)."""
        d = {k: getattr(self, k) / MIB for k in ("archive", "states", "conv", "helper", "attention_kv")}
        d["total"] = self.total / MIB
        return d


def notebank_storage(
    shapes: ModelShapes,
    *,
    num_notes: float,
    archived_tokens: float,
    addr_dim: int = 16,
    helper_bytes: float = 0.0,
    input_len: float | None = None,
    channels: int | None = None,
) -> StorageBreakdown:
    """M_NB (Eq. 20) = Storage_NB + 4 J d_k d_v + 2 c_conv J (2 d_k + d_v) + M_helper.

    ``helper_bytes`` is M_helper (paper: 0.402 MiB for GDN-1.3B: projection indices and allocated
    auxiliary tensors). Hybrids also keep their attention KV cache: pass ``input_len`` (P) and it is
    added as ``attention_kv`` (BF16); it is required for hybrids.
    """
    J = shapes.channels if channels is None else channels
    kv = 0.0
    if shapes.is_hybrid:
        if input_len is None:
            raise ValueError("notebank_storage: a hybrid keeps an attention KV cache; pass input_len")
        kv = attention_kv_bytes(shapes, input_len)
    return StorageBreakdown(
        archive=archive_bytes(num_notes, archived_tokens, channels=J, addr_dim=addr_dim),
        states=float(recurrent_state_bytes(shapes)),
        conv=float(conv_cache_bytes(shapes)),
        helper=float(helper_bytes),
        attention_kv=kv,
    )


def storage_ratio(
    shapes: ModelShapes,
    *,
    input_len: float,
    num_notes: float,
    archived_tokens: float,
    addr_dim: int = 16,
    helper_bytes: float = 0.0,
) -> float:
    """M_NB / M_MHA (Eq. 21) at matched width D, depth |L| and BF16 precision."""
    nb = notebank_storage(
        shapes, num_notes=num_notes, archived_tokens=archived_tokens, addr_dim=addr_dim,
        helper_bytes=helper_bytes, input_len=input_len,
    ).total
    return nb / mha_kv_cache_bytes(shapes.num_layers, shapes.hidden_size, input_len)
