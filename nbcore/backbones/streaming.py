"""`streaming`: a Llama-architecture Transformer (Llama, Qwen2, SmolLM2 through the GGUF loader) read
with attention sinks plus a sliding window (StreamingLLM, Xiao et al. 2023), so that its inference
state is bounded exactly like a recurrent model's: evidence that leaves the window is gone.

State (StreamingCache), per layer: the KV of the first `sinks` tokens of the document and of the
last `window` tokens, keys stored BEFORE RoPE; a token counter. Size O(L * (sinks + window)),
independent of the document length T.

Position rule (StreamingLLM's "positions within the cache"). A query at document position p
attends to
    the sinks i < min(sinks, p + 1)                        rotated at position i, and
    the window tokens j with lo(p) <= j <= p               rotated at position s + (j - lo(p)),
where s = number of sinks held, lo(p) = max(sinks, window start, p - window + 1); the query is
rotated at position s + (p - lo(p)) (p itself while p < sinks). So positions never exceed
sinks + window - 1, which stays inside the trained context (SmolLM2: 8,192), window tokens keep
their true distances p - j, and sinks sit right before the oldest window token. Until the window
is full this is ordinary causal attention at true positions.

How this relates to transformers' caches: `DynamicSlidingWindowLayer` (Mistral/Gemma sliding
layers) keeps the last W - 1 keys already rotated at their TRUE positions and has no sinks, so
positions grow with T beyond the trained range; the former `SinkCache` (removed in 4.5x) stored
rotated keys and re-rotated the sink/window keys by the shift each time the window moved.
Caching keys before RoPE and rotating at attention time (as StreamingLLM's own Llama patch does)
gives the same scores without accumulating re-rotation error; RoPE is relative, so window keys
and queries are rotated in a frame starting at the window's first token (small angles, no
precision loss at 1M tokens).

The layer loop runs the real model's modules (norms, q/k/v/o projections with their biases, MLP,
final norm, lm_head, the model's rotary embedding for cos/sin); only the attention is ours. With a
window that holds the whole sequence it equals the transformers model's own forward
(tests/test_streaming.py), and `naive_windowed_logits` is the naive per-query reference of the
windowed attention it is tested against.

NoteBank channels: (layer, KV head), J = layers x KV heads (SmolLM2-135M: 30 x 3 = 90), d = head_dim.
Native key = the head's key before RoPE; native query = the mean of the head's query group
(GQA: the query heads that read this KV head) before RoPE, so <q, k> is the group's mean
attention logit before rotation.

Reset (the analogue of lambda = 0, App. C.3): `reset_state(state, 0)` drops the window and keeps
the sinks and the token counter. The next tokens then attend to the sinks and to themselves, at
positions s, s + 1, ...: exactly what a fresh read of [first `sinks` tokens, new tokens] gives
(tested). A window cannot be scaled, so 0 < lam < 1 is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nbcore.backbones.base import Backbone, BackboneState, FeatureTap

DEFAULT_SINKS = 4
DEFAULT_WINDOW = 1024          # ppl 1.5% above full attention past the window (bench/results/streaming-smollm2/README.md)
MODEL_TYPES = ("llama", "qwen2", "mistral")
# tokens per layer-major piece of one forward (bounds activations on 64K-token blocks); a multiple
# of every NoteBank chunk size in use, so the tap's per-piece calls start on chunk boundaries
PIECE = 8192
QUERY_TILE = 512               # queries per attention tile: logits [H, 512, sinks + window + 512]


@dataclass
class StreamingCache:
    """Per-layer sink and window KV, keys before RoPE. Lists of L tensors:
    sink_k / sink_v [s, H_kv, d] (s <= sinks), win_k / win_v [w, H_kv, d] (w <= window), the window
    holding document positions n_seen - w .. n_seen - 1 (all >= sinks and >= win_start).
    win_start: document position the window may start at (0, or where the last reset dropped it)."""

    sink_k: list = field(default_factory=list)
    sink_v: list = field(default_factory=list)
    win_k: list = field(default_factory=list)
    win_v: list = field(default_factory=list)
    n_seen: int = 0
    win_start: int = 0

    def n_sinks(self) -> int:
        return int(self.sink_k[0].shape[0]) if self.sink_k else 0

    def n_window(self) -> int:
        return int(self.win_k[0].shape[0]) if self.win_k else 0


def _rot(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers' apply_rotary_pos_emb (rotate_half). x [n, H, d]; cos/sin [n, d]."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


class StreamingBackbone(Backbone):
    """Sinks + sliding window over a transformers Llama-architecture causal LM (see module doc)."""

    family = "streaming"

    def __init__(self, model, tokenizer=None, sinks: int = DEFAULT_SINKS, window: int = DEFAULT_WINDOW):
        cfg = model.config
        if cfg.model_type not in MODEL_TYPES:
            raise ValueError(f"streaming: model_type {cfg.model_type!r} is not Llama-architecture {MODEL_TYPES}")
        if int(sinks) < 0 or int(window) < 1:
            raise ValueError(f"streaming: need sinks >= 0 and window >= 1, got sinks={sinks}, window={window}")
        maxpos = getattr(cfg, "max_position_embeddings", None)
        if maxpos and sinks + window > maxpos:
            raise ValueError(f"streaming: sinks + window = {sinks + window} exceeds the model's "
                             f"max_position_embeddings {maxpos}")
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.sinks, self.window = int(sinks), int(window)
        base = self._base_model().model
        self.rec_layers = list(range(len(base.layers)))
        attn = base.layers[0].self_attn
        self.key_dim = int(attn.head_dim)
        self.n_q_heads = int(cfg.num_attention_heads)
        self.heads_per_layer = int(cfg.num_key_value_heads)
        self.groups = self.n_q_heads // self.heads_per_layer
        self._rope: tuple | None = None

    def _base_model(self):
        m = self.model
        return m.get_base_model() if hasattr(m, "get_base_model") else m

    def _compute_fingerprint(self) -> str:
        # the archive's features do not depend on the window (keys/queries are position-free), but
        # the state and answers do: the window is part of what a saved state is valid for
        return f"{super()._compute_fingerprint()}-s{self.sinks}w{self.window}"

    # ---- RoPE table ------------------------------------------------------------------------
    def _cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, d] fp32 at integer positions pos [n] (< sinks + window + QUERY_TILE + PIECE),
        from the model's own rotary embedding (its rope scaling included)."""
        need = self.sinks + self.window + PIECE + 1
        dev = self.device
        if self._rope is None or self._rope[0].device != dev:
            rot = self._base_model().model.rotary_emb
            ids = torch.arange(need, device=dev)[None]
            x = torch.zeros(1, dtype=torch.float32, device=dev)
            cos, sin = rot(x, ids)
            self._rope = (cos[0].float(), sin[0].float())
        return self._rope[0][pos], self._rope[1][pos]

    # ---- state ----------------------------------------------------------------------------
    def new_state(self) -> BackboneState:
        return BackboneState(cache=StreamingCache(), n_tokens=0)

    def reset_state(self, state: BackboneState, lam: float) -> None:
        """lam = 1: no-op. lam = 0: drop the window, keep the sinks and the token counter (see the
        module doc). A windowed KV cache cannot be scaled: 0 < lam < 1 raises."""
        if lam == 1:
            return
        if lam != 0:
            raise ValueError(f"streaming: reset_state takes lam 0 (drop the window, keep the sinks) or 1, got {lam}")
        c: StreamingCache = state.cache
        c.win_k = [k[:0] for k in c.win_k]
        c.win_v = [v[:0] for v in c.win_v]
        c.win_start = state.n_tokens

    def state_to_tensors(self, state: BackboneState) -> dict[str, torch.Tensor]:
        c: StreamingCache = state.cache
        out = {"n_tokens": torch.tensor([state.n_tokens], dtype=torch.int64),
               "win_start": torch.tensor([c.win_start], dtype=torch.int64)}
        if c.sink_k:
            out["sink_k"] = torch.stack(c.sink_k).contiguous()      # [L, s, H_kv, d]
            out["sink_v"] = torch.stack(c.sink_v).contiguous()
            out["win_k"] = torch.stack(c.win_k).contiguous()        # [L, w, H_kv, d]
            out["win_v"] = torch.stack(c.win_v).contiguous()
        return out

    def state_from_tensors(self, tensors: dict[str, torch.Tensor]) -> BackboneState:
        n = int(tensors["n_tokens"][0])
        c = StreamingCache(n_seen=n, win_start=int(tensors["win_start"][0]))
        if "sink_k" in tensors:
            dev = self.device
            for name in ("sink_k", "sink_v", "win_k", "win_v"):
                setattr(c, name, [t.to(dev).clone() for t in tensors[name].unbind(0)])
        return BackboneState(cache=c, n_tokens=n)

    def state_bytes(self, state: BackboneState) -> int:
        c: StreamingCache = state.cache
        return sum(t.numel() * t.element_size() for ts in (c.sink_k, c.sink_v, c.win_k, c.win_v) for t in ts)

    # ---- compute --------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, state: BackboneState, ids: torch.Tensor, tap: FeatureTap | None = None,
                need_logits: bool = True) -> torch.Tensor | None:
        """Advance `state` over ids [T]; logits of the last position [V] fp32 (or None).
        Layer-major over pieces of PIECE tokens; tap.on_layer(layer, q [t, H_kv, d], k [t, H_kv, d])
        once per layer per piece (pre-RoPE, fp32)."""
        if ids.dim() != 1:
            raise ValueError(f"ids must be 1-D [T], got shape {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise ValueError("forward over zero tokens")
        ids = ids.to(self.device)
        h = None
        with self._adapter_ctx():
            for a in range(0, ids.numel(), PIECE):
                h = self._piece(state, ids[a:a + PIECE], tap)
            if not need_logits:
                return None
            m = self._base_model()
            return m.lm_head(m.model.norm(h[-1:]))[0].float()

    @torch.no_grad()
    def forward_hidden(self, state: BackboneState, ids: torch.Tensor) -> torch.Tensor:
        """Advance `state` over ids [T] like `forward`; -> the final-normed hidden state of every
        position [T, hidden] (lm_head of row t = logits after token t; bench/streaming_ppl.py)."""
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"ids must be a non-empty 1-D [T], got shape {tuple(ids.shape)}")
        ids = ids.to(self.device)
        with self._adapter_ctx():
            hs = [self._piece(state, ids[a:a + PIECE], None) for a in range(0, ids.numel(), PIECE)]
        return self._base_model().model.norm(torch.cat(hs))

    def _piece(self, state: BackboneState, ids: torch.Tensor, tap) -> torch.Tensor:
        """One piece, all layers; updates the cache. -> final hidden states [n, hidden]."""
        c: StreamingCache = state.cache
        base = self._base_model().model
        p0 = state.n_tokens
        n = ids.numel()
        h = base.embed_tokens(ids)                                     # [n, hidden]
        plan = self._plan(c, p0, n)
        new_sk, new_sv, new_wk, new_wv = [], [], [], []
        for li, layer in enumerate(base.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(n, self.n_q_heads, self.key_dim)
            k = attn.k_proj(x).view(n, self.heads_per_layer, self.key_dim)
            v = attn.v_proj(x).view(n, self.heads_per_layer, self.key_dim)
            if tap is not None:
                qg = q.float().view(n, self.heads_per_layer, self.groups, self.key_dim).mean(2)
                tap.on_layer(li, qg, k.float())
            sk = c.sink_k[li] if c.sink_k else k[:0]
            sv = c.sink_v[li] if c.sink_v else v[:0]
            wk = c.win_k[li] if c.win_k else k[:0]
            wv = c.win_v[li] if c.win_v else v[:0]
            n_new_sink = plan["n_new_sink"]
            sk, sv = torch.cat([sk, k[:n_new_sink]]), torch.cat([sv, v[:n_new_sink]])
            wk, wv = torch.cat([wk, k[n_new_sink:]]), torch.cat([wv, v[n_new_sink:]])
            o = self._attend(q, sk, sv, wk, wv, plan, attn.scaling)
            h = h + attn.o_proj(o.reshape(n, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            new_sk.append(sk)
            new_sv.append(sv)
            keep = min(wk.shape[0], self.window)
            new_wk.append(wk[wk.shape[0] - keep:].clone())
            new_wv.append(wv[wv.shape[0] - keep:].clone())
        c.sink_k, c.sink_v, c.win_k, c.win_v = new_sk, new_sv, new_wk, new_wv
        state.n_tokens = c.n_seen = p0 + n
        return h

    def _plan(self, c: StreamingCache, p0: int, n: int) -> dict:
        """Index bookkeeping shared by every layer of one piece: query positions p [n], window-key
        positions j (held window, then the new non-sink tokens), lo(p), the queries' sink-frame
        positions, and the base of the relative frame (j[0])."""
        dev = self.device
        S = self.sinks
        n_new_sink = max(0, min(S, p0 + n) - p0)                  # new tokens at positions < sinks
        w_old = c.n_window()
        j0 = p0 - w_old if w_old else p0 + n_new_sink
        p = torch.arange(p0, p0 + n, device=dev)
        j = torch.arange(j0, p0 + n, device=dev)
        lo = torch.clamp(p - self.window + 1, min=max(S, c.win_start))
        s_tot = c.n_sinks() + n_new_sink
        q_pos_sink = torch.where(p < S, p, s_tot + (p - lo))
        return {"n_new_sink": n_new_sink, "p": p, "j": j, "lo": lo, "q_pos_sink": q_pos_sink, "base": j0}

    def _attend(self, q, sk, sv, wk, wv, plan, scaling) -> torch.Tensor:
        """q [n, Hq, d] (pre-RoPE); sinks sk/sv [s, Hkv, d]; window keys wk/wv [w, Hkv, d] at document
        positions plan['j'] (pre-RoPE). -> attention output [n, Hq, d]."""
        n = q.shape[0]
        s = sk.shape[0]
        p, j, lo = plan["p"], plan["j"], plan["lo"]
        base = plan["base"]
        dt = q.dtype
        g = self.groups
        # keys rotated once: sinks at 0..s-1, window keys at j - base (relative frame)
        cs, ss = self._cos_sin(torch.arange(s, device=q.device))
        sk_r = _rot(sk.float(), cs, ss).to(dt).repeat_interleave(g, dim=1)       # [s, Hq, d]
        cw, sw = self._cos_sin(j - base)
        wk_r = _rot(wk.float(), cw, sw).to(dt).repeat_interleave(g, dim=1)       # [w, Hq, d]
        sv_e = sv.repeat_interleave(g, dim=1)
        wv_e = wv.repeat_interleave(g, dim=1)
        out = torch.empty_like(q)
        for a in range(0, n, QUERY_TILE):
            b = min(n, a + QUERY_TILE)
            pt, lot = p[a:b], lo[a:b]
            qt = q[a:b].float()
            cq, sq = self._cos_sin(pt - base)
            q_w = _rot(qt, cq, sq).to(dt)
            cq2, sq2 = self._cos_sin(plan["q_pos_sink"][a:b])
            q_s = _rot(qt, cq2, sq2).to(dt)
            # window keys this tile can see: positions up to pt[-1]
            jmax = max(0, int(pt[-1]) - base + 1)
            jmin = min(jmax, max(0, int(lot[0]) - base))
            jt = j[jmin:jmax]
            lw = torch.einsum("thd,jhd->htj", q_w, wk_r[jmin:jmax]).float() * scaling    # [Hq, t, w']
            mw = (jt[None, :] <= pt[:, None]) & (jt[None, :] >= lot[:, None])           # [t, w']
            lw = lw.masked_fill(~mw[None], float("-inf"))
            ls = torch.einsum("thd,shd->hts", q_s, sk_r).float() * scaling               # [Hq, t, s]
            ms = torch.arange(s, device=q.device)[None, :] <= pt[:, None]
            ls = ls.masked_fill(~ms[None], float("-inf"))
            w = torch.softmax(torch.cat([ls, lw], dim=-1), dim=-1).to(dt)
            o = torch.einsum("hts,shd->thd", w[..., :s], sv_e) + \
                torch.einsum("htj,jhd->thd", w[..., s:], wv_e[jmin:jmax])
            out[a:b] = o
        return out


def naive_windowed_logits(bb: StreamingBackbone, ids: torch.Tensor) -> torch.Tensor:
    """Naive reference: the model over the whole sequence ids [T] at once, every query's attention
    computed on its own (a Python loop over positions) by the position rule of the module doc
    (no reset). Independent of StreamingCache and the tiled kernel. -> logits [T, V] fp32."""
    m = bb._base_model()
    base = m.model
    S, W = bb.sinks, bb.window
    T = ids.numel()
    ids = ids.to(bb.device)
    h = base.embed_tokens(ids)
    rot = base.rotary_emb

    def rope(x, pos):                     # x [n, H, d], pos list[int] -> rotated with the model's own table
        cos, sin = rot(x.float(), torch.tensor([pos], device=x.device))
        return _rot(x.float(), cos[0].float(), sin[0].float())

    with torch.no_grad():
        for layer in base.layers:
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(T, bb.n_q_heads, bb.key_dim)
            k = attn.k_proj(x).view(T, bb.heads_per_layer, bb.key_dim).repeat_interleave(bb.groups, 1)
            v = attn.v_proj(x).view(T, bb.heads_per_layer, bb.key_dim).repeat_interleave(bb.groups, 1)
            o = torch.empty_like(q)
            for t in range(T):
                sinks = list(range(min(S, t + 1)))
                lo = max(S, t - W + 1)
                win = list(range(lo, t + 1)) if t >= S else []
                keys = sinks + win
                pos = sinks + [len(sinks) + (jj - lo) for jj in win]
                qpos = t if t < S else len(sinks) + (t - lo)
                kr = rope(k[keys], pos)                                  # [m, Hq, d]
                qr = rope(q[t:t + 1], [qpos])[0]                        # [Hq, d]
                a = torch.softmax(torch.einsum("hd,mhd->hm", qr, kr) * attn.scaling, dim=-1)
                o[t] = torch.einsum("hm,mhd->hd", a, v[keys].float()).to(o.dtype)
            h = h + attn.o_proj(o.reshape(T, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return m.lm_head(base.norm(h)).float()
