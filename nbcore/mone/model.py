"""MoNe around a frozen transformers Qwen2-family model (arXiv 2608.17616).

Write (test-time learning), segment by segment (T tokens, positions j mod T):
  the frozen model runs over the segment alone (causal attention inside the segment, no memory
  read); at every decoder layer l the attention input x = input_layernorm(h) gives
    k = SiLU(W_k x + LoRA_wk x) -> per-token L2 norm -> segment-local RoPE    (memory keys)
    v = SiLU(W_v x + LoRA_wv x)                                              (memory values)
    eta = softplus(P_eta x) per token and memory head                        (learning rates)
    beta = sigmoid(P_beta mean_j x_j) per memory head                        (momentum decay)
  and layer l's fast weights take one step of ``memory.write_segment``. W_k/W_v give kv_heads x
  head_dim channels; they are repeated to the query-head layout (as attention does for GQA), so
  keys live in the same space as the read queries W_q x and the memory width is
  num_heads x head_dim (= hidden size, as in Qwen2.5-0.5B: 14 x 64 = 896), split into
  ``mem_heads`` heads of D = width / mem_heads (paper: 4 x 224).

Read (query pass; never sees the context): for each query token j at layer l
    h_j = gate * RMSNorm_head(M(phi(W_q x_j + LoRA_rq x_j); W_S))      (phi: SiLU, L2, RoPE at j)
    memory K_j = RoPE_j(W_k h_j + LoRA_mk h_j),  memory V_j = W_v h_j + LoRA_mv h_j
  concatenated with the query tokens' own K/V in the frozen attention. Query positions are local
  [0, |Q|). Choice where the paper is silent: ONE memory token per query token, at that token's
  position; query token i attends to its own-K/V and memory-K/V of positions <= i (causal, so
  answer tokens in teacher forcing cannot see memory tokens read by later tokens). The memory
  token count therefore equals the query length |Q| (+ generated tokens), independent of the
  context length N; it is cached with the ordinary K/V during generation.

Only the MoNe parameters (LoRAs, P_eta, P_beta, gates) are trainable; the base stays frozen.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from nbcore.mone import memory as mem
from nbcore.mone.memory import FastWeights


@dataclass
class MoNeConfig:
    segment_len: int = 512          # T
    mem_heads: int = 4              # paper: 4 heads (d_h = 224 for Qwen2.5-0.5B)
    mem_ffn: int = 0                # hidden width F per head; 0 -> D (three D x D matrices)
    lora_rank: int = 16             # paper: 128 for 0.5B
    lora_alpha: float = 16.0        # LoRA scaling alpha
    lr_init: float = 1.0            # softplus(bias) at init
    beta_init: float = 0.5          # sigmoid(bias) at init
    gate_init: float = 1.0          # read gate scale at init
    key_rope: bool = True           # segment-local RoPE on memory keys / read queries
    center_keys: bool = False       # ablation (not in the paper): subtract each segment's mean SiLU key
                                    # (per head, valid tokens) before the L2 norm
    center_values: bool = False     # ablation (not in the paper): subtract each segment's mean value
    rope_theta: float = 10000.0     # RoPE base of the memory keys
    rho: float = 0.0                # channel norm after each update; 0 -> sqrt(D)
    seed: int = 0                   # W_0 seed
    write_batch: int = 8            # segments per frozen forward call during ingest

    @classmethod
    def from_dict(cls, d: dict) -> "MoNeConfig":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


class LoRA(nn.Module):
    """Low-rank delta B A x * (alpha / r) added to a frozen projection (B starts at zero)."""

    def __init__(self, d_in: int, d_out: int, rank: int, alpha: float):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, d_in) / math.sqrt(d_in))
        self.B = nn.Parameter(torch.zeros(d_out, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B) * self.scale


class MoNeLayer(nn.Module):
    """Meta-trained parameters of one decoder layer's memory."""

    def __init__(self, hidden: int, q_dim: int, kv_dim: int, cfg: MoNeConfig):
        super().__init__()
        r, a = cfg.lora_rank, cfg.lora_alpha
        self.lora = nn.ModuleDict({
            "wk": LoRA(hidden, kv_dim, r, a), "wv": LoRA(hidden, kv_dim, r, a),   # write k / v
            "rq": LoRA(hidden, q_dim, r, a),                                      # read query
            "mk": LoRA(hidden, kv_dim, r, a), "mv": LoRA(hidden, kv_dim, r, a),   # memory K / V
        })
        self.lr_proj = nn.Linear(hidden, cfg.mem_heads)
        self.mom_proj = nn.Linear(hidden, cfg.mem_heads)
        nn.init.normal_(self.lr_proj.weight, std=0.01)
        nn.init.normal_(self.mom_proj.weight, std=0.01)
        nn.init.constant_(self.lr_proj.bias, mem.inv_softplus(cfg.lr_init))
        nn.init.constant_(self.mom_proj.bias, mem.logit(cfg.beta_init))
        self.gate = nn.Parameter(torch.full((cfg.mem_heads,), float(cfg.gate_init)))


class LayerCache:
    """Per-layer K/V (own and memory tokens, [B, Hkv, L, hd]) and their positions [L]."""

    def __init__(self, n_layers: int):
        self.k: list = [None] * n_layers
        self.v: list = [None] * n_layers
        self.pos: list = [None] * n_layers

    def n_entries(self, layer: int = 0) -> int:
        return 0 if self.k[layer] is None else self.k[layer].shape[2]


def _masked_mean(t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Mean over the valid tokens of each segment: t [B, T, H, D], m [B, T, 1] -> [B, 1, H, D]."""
    w = m.unsqueeze(-1)
    return (t * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp_min(1)


class MoNeModel(nn.Module):
    def __init__(self, base, cfg: MoNeConfig):
        super().__init__()
        c = base.config
        self.base = base
        self.cfg = cfg
        for p in base.parameters():
            p.requires_grad_(False)
        base.eval()
        self.hidden = c.hidden_size
        self.n_heads = c.num_attention_heads
        self.n_kv = c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.q_dim = self.n_heads * self.head_dim
        self.kv_dim = self.n_kv * self.head_dim
        if self.q_dim != self.hidden:
            raise ValueError("MoNe needs num_heads * head_dim == hidden_size (memory outputs are "
                             f"fed to W_k/W_v): {self.q_dim} != {self.hidden}")
        if self.q_dim % cfg.mem_heads:
            raise ValueError(f"memory width {self.q_dim} not divisible by mem_heads {cfg.mem_heads}")
        self.D = self.q_dim // cfg.mem_heads
        self.Fw = cfg.mem_ffn or self.D
        self.rho = cfg.rho or math.sqrt(self.D)
        self.n_layers = c.num_hidden_layers
        self.mone = nn.ModuleList(MoNeLayer(self.hidden, self.q_dim, self.kv_dim, cfg)
                                  for _ in range(self.n_layers))
        for l in range(self.n_layers):
            for k, w in mem.init_weights(cfg.mem_heads, self.Fw, self.D, self.rho,
                                         seed=cfg.seed * 1000 + l).items():
                self.register_buffer(f"w0_{l}_{k}", w, persistent=False)

    # ------------------------------------------------------------------------------------------
    # persistence of the meta-trained parameters

    def save_adapters(self, out_dir: str | Path, extra: dict | None = None) -> None:
        from safetensors.torch import save_file
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.mone.state_dict().items()},
                  str(out / "mone_adapters.safetensors"))
        (out / "mone_config.json").write_text(json.dumps({"mone": asdict(self.cfg), **(extra or {})},
                                                         indent=2))

    @classmethod
    def from_pretrained(cls, base_dir: str | Path, adapters_dir: str | Path | None = None,
                        cfg: MoNeConfig | None = None, *, gguf_file: str | None = None,
                        cache_dir: str | None = None) -> "MoNeModel":
        """``base_dir``: a checkpoint directory or any source of nbcore.backbones.gguf (a .gguf file,
        a directory with ``gguf_file``, ``pkg:<package>/<file>``; dequantised once into ``cache_dir``)."""
        from transformers import AutoModelForCausalLM

        from nbcore.backbones.gguf import resolve_checkpoint
        base_dir = resolve_checkpoint(base_dir, gguf_file=gguf_file, cache_dir=cache_dir)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        if adapters_dir is not None and cfg is None:
            cfg = MoNeConfig.from_dict(json.loads((Path(adapters_dir) / "mone_config.json").read_text())["mone"])
        model = cls(base, cfg or MoNeConfig())
        if adapters_dir is not None:
            from safetensors.torch import load_file
            model.mone.load_state_dict(load_file(str(Path(adapters_dir) / "mone_adapters.safetensors")))
        return model

    @property
    def device(self) -> torch.device:
        """Where the frozen base (and the MoNe parameters, moved with it by ``.to``) live."""
        return self.base.lm_head.weight.device

    def trainable_parameters(self):
        return [p for p in self.mone.parameters() if p.requires_grad]

    # ------------------------------------------------------------------------------------------
    # fast-weight state

    def w0(self, layer: int) -> dict[str, torch.Tensor]:
        return {k: getattr(self, f"w0_{layer}_{k}") for k in mem.WEIGHTS}

    def fresh(self, batch: int = 1) -> list[FastWeights]:
        return [mem.fresh_state(self.w0(l), batch) for l in range(self.n_layers)]

    def _heads_view(self, t: torch.Tensor) -> torch.Tensor:
        """[B, T, kv_dim] -> query-head layout (repeat each kv head, as repeat_kv) -> [B, T, Hm, D]."""
        B, T, _ = t.shape
        g = self.n_heads // self.n_kv
        if g > 1:
            t = t.view(B, T, self.n_kv, 1, self.head_dim).expand(B, T, self.n_kv, g, self.head_dim)
        return t.reshape(B, T, self.cfg.mem_heads, self.D)

    def write_inputs(self, layer: int, x: torch.Tensor, mask: torch.Tensor):
        """(k, v, eta, beta) of one segment at ``layer`` from its attention inputs x [B, T, d]."""
        attn = self.base.model.layers[layer].self_attn
        ml = self.mone[layer]
        T = x.shape[1]
        k = self._heads_view(attn.k_proj(x) + ml.lora["wk"](x))
        v = self._heads_view(attn.v_proj(x) + ml.lora["wv"](x))
        pos = torch.arange(T, device=x.device) if self.cfg.key_rope else None  # segment-local: j mod T
        m = mask.to(x.dtype).unsqueeze(-1)
        if self.cfg.center_keys:
            # a direction shared by every key of the segment makes the update return nearly the
            # same vector for every key (../shared/notes/mone-findings.md); RoPE and L2 as usual
            k = F.silu(k)
            k = k - _masked_mean(k, m)
            k = mem.apply_rope(mem.l2norm(k), *mem.rope_cos_sin(pos, self.D, self.cfg.rope_theta)) \
                if pos is not None else mem.l2norm(k)
        else:
            k = mem.key_features(k, pos, self.cfg.rope_theta)
        v = F.silu(v)
        if self.cfg.center_values:
            v = v - _masked_mean(v, m)
        eta = F.softplus(ml.lr_proj(x))
        xm = (x * m).sum(1) / m.sum(1).clamp_min(1)
        beta = torch.sigmoid(ml.mom_proj(xm))
        return k, v, eta, beta

    def layer_write(self, layer: int, fw: FastWeights, x: torch.Tensor, mask: torch.Tensor) -> FastWeights:
        k, v, eta, beta = self.write_inputs(layer, x, mask)
        return mem.write_segment(fw, k, v, eta, beta, mask, self.rho)

    def layer_loss(self, layer: int, w: dict[str, torch.Tensor], x: torch.Tensor, mask: torch.Tensor):
        """Layer l's associative segment loss L_s = -(1/T) sum_j v_j^T M(k_j; W) (rates eta = 1)."""
        k, v, _, _ = self.write_inputs(layer, x, mask)
        m = mask.to(x.dtype)
        omega = (m / m.sum(1, keepdim=True).clamp_min(1)).unsqueeze(-1).expand(*m.shape, self.cfg.mem_heads)
        return mem.assoc_loss(k, v, omega, w["w_in"], w["w_gate"], w["w_out"])

    @torch.no_grad()
    def segment_inputs(self, seg_ids: torch.Tensor) -> list[torch.Tensor]:
        """Frozen forward of independent segments [N, T] (positions 0..T-1, right padding allowed):
        the attention input x of every layer, [N, T, d] each (detached)."""
        _, xs = self._run(seg_ids, torch.arange(seg_ids.shape[1], device=seg_ids.device), capture=True,
                          from_zero=True)
        return xs

    def write(self, fast: list[FastWeights], seg_ids: torch.Tensor, seg_mask: torch.Tensor,
              xs: list[torch.Tensor] | None = None, checkpoint: bool = False) -> list[FastWeights]:
        """Write S segments into a batch of states. seg_ids, seg_mask: [B, S, T]. Sequential over
        segments, layer-local at each layer. Differentiable w.r.t. the MoNe parameters.

        checkpoint: recompute each (segment, layer) update in the backward pass instead of keeping its
        activations (torch.utils.checkpoint). Backpropagation through S segments then holds S x layers
        fast-weight states (SmolLM2: ~2 MB per row each) rather than every update's keys, values, LoRA
        and SwiGLU intermediates (several times that), for ~1.3x the write's compute; the gradients are
        the same (tests/test_mone_memory.py)."""
        B, S, T = seg_ids.shape
        if xs is None:
            xs = self.segment_inputs(seg_ids.reshape(B * S, T))
        xs = [x.view(B, S, T, -1) for x in xs]
        step = self._checkpointed_write if checkpoint and torch.is_grad_enabled() else self.layer_write
        for s in range(S):
            fast = [step(l, fast[l], xs[l][:, s], seg_mask[:, s]) for l in range(self.n_layers)]
        return fast

    def _checkpointed_write(self, layer: int, fw: FastWeights, x: torch.Tensor, mask: torch.Tensor) -> FastWeights:
        from torch.utils.checkpoint import checkpoint
        names = list(fw.tensors())

        def update(x, mask, *state):
            return tuple(self.layer_write(layer, FastWeights(**dict(zip(names, state))), x, mask).tensors().values())

        return FastWeights(**dict(zip(names, checkpoint(update, x, mask, *fw.tensors().values(),
                                                        use_reentrant=False))))

    # ------------------------------------------------------------------------------------------
    # frozen forward (own loop over the transformers modules, so memory K/V can be injected)

    def memory_kv(self, layer: int, x: torch.Tensor, positions: torch.Tensor, fw: FastWeights,
                  cos: torch.Tensor, sin: torch.Tensor):
        """Memory K/V for query tokens: [B, Hkv, n, hd] each (K with the attention's RoPE)."""
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
        attn = self.base.model.layers[layer].self_attn
        ml = self.mone[layer]
        B, n, _ = x.shape
        q = (attn.q_proj(x) + ml.lora["rq"](x)).view(B, n, self.cfg.mem_heads, self.D)
        q = mem.key_features(q, positions if self.cfg.key_rope else None, self.cfg.rope_theta)
        h = mem.swiglu_forward(q, fw.w_in, fw.w_gate, fw.w_out)
        h = (mem.rms_norm(h) * ml.gate[:, None]).reshape(B, n, self.hidden)
        mk = (attn.k_proj(h) + ml.lora["mk"](h)).view(B, n, self.n_kv, self.head_dim).transpose(1, 2)
        mv = (attn.v_proj(h) + ml.lora["mv"](h)).view(B, n, self.n_kv, self.head_dim).transpose(1, 2)
        mk, _ = apply_rotary_pos_emb(mk, mk, cos, sin)
        return mk, mv

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, fast: list[FastWeights] | None = None,
             cache: LayerCache | None = None, capture: bool = False, from_zero: bool = False):
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb, repeat_kv
        base = self.base.model
        B, n = ids.shape
        h = base.embed_tokens(ids)
        # no memory tokens, nothing cached, positions 0..n-1: the mask is exactly causal.
        # from_zero: the caller made positions = arange(n) (no data-dependent check needed)
        causal = (fast is None and n > 1 and (cache is None or cache.k[0] is None)
                  and (from_zero or torch.equal(positions, torch.arange(n, device=positions.device))))
        cos, sin = base.rotary_emb(h, positions[None].expand(B, n))
        xs = []
        for l, layer in enumerate(base.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            if capture:
                xs.append(x)
                if l == self.n_layers - 1:
                    return None, xs
            q = attn.q_proj(x).view(B, n, self.n_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(B, n, self.n_kv, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(B, n, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            kpos = positions
            if fast is not None:
                mk, mv = self.memory_kv(l, x, positions, fast[l], cos, sin)
                k, v = torch.cat([k, mk], 2), torch.cat([v, mv], 2)
                kpos = torch.cat([positions, positions])
            if cache is not None:
                if cache.k[l] is not None:
                    k = torch.cat([cache.k[l], k], 2)
                    v = torch.cat([cache.v[l], v], 2)
                    kpos = torch.cat([cache.pos[l], kpos])
                cache.k[l], cache.v[l], cache.pos[l] = k, v, kpos
            g = self.n_heads // self.n_kv
            if causal:       # plain causal self-attention: SDPA's fused kernel, no [n, n] mask
                o = F.scaled_dot_product_attention(q, repeat_kv(k, g), repeat_kv(v, g), is_causal=True,
                                                   scale=attn.scaling)
            else:
                mask = kpos[None, :] <= positions[:, None]
                o = F.scaled_dot_product_attention(q, repeat_kv(k, g), repeat_kv(v, g), attn_mask=mask,
                                                   scale=attn.scaling)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(B, n, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return base.norm(h), xs

    def logits(self, ids: torch.Tensor, fast: list[FastWeights] | None = None,
               positions: torch.Tensor | None = None, cache: LayerCache | None = None,
               last_only: bool = False) -> torch.Tensor:
        """Query pass (fast=None: the plain frozen model). ids [B, n]; positions default [0, n).
        -> [B, n, vocab], or [B, 1, vocab] with last_only (decoding needs no other row)."""
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device)
        h, _ = self._run(ids, positions, fast=fast, cache=cache)
        return self.base.lm_head(h[:, -1:] if last_only else h)

    @torch.no_grad()
    def generate(self, prompt: list[int], fast: list[FastWeights] | None, max_new: int,
                 eos: int | None = None, return_cache: bool = False):
        """Greedy decoding with a K/V cache (own + memory entries). Positions continue from the
        prompt: local [0, |Q|) for MoNe queries, [0, N + |Q|) for ICL/RAG prompts."""
        cache = LayerCache(self.n_layers)
        dev = self.device
        ids = torch.tensor([prompt], device=dev)
        logits = self.logits(ids, fast, torch.arange(len(prompt), device=dev), cache, last_only=True)
        out: list[int] = []
        pos = len(prompt)
        for _ in range(max_new):
            nxt = int(logits[0, -1].argmax())
            if eos is not None and nxt == eos:
                break
            out.append(nxt)
            if len(out) == max_new:
                break
            logits = self.logits(torch.tensor([[nxt]], device=dev), fast, torch.tensor([pos], device=dev), cache)
            pos += 1
        return (out, cache) if return_cache else out
