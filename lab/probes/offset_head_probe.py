"""Probe the offset-induction head of a grown tiny GDN (layer 0, head 0; lab/results/tiny-gdn-growth.md).

On niah_multikey_1 test examples at 1K tokens it measures, for that head alone:
  match:     does q (answer position) . k (each needle's first value token) rank the asked key's
             needle first among the 4 needles / among all positions?
  retrieval: run the head's gated delta rule over the whole prompt (naive loop, fp32) and compare
             its read-out at the answer position with the value vectors of the ten " <digit>"
             tokens: is the nearest one the gold value's first digit? Once with the head's own
             write gate beta, once with beta = 1 at number starts and 0 elsewhere (the ideal gate).
             For a layer past the first (init-last) values are contextual: nearest of the 4
             needles' stored value vectors instead (chance 5/20).

    python lab/probes/offset_head_probe.py init            # the source grown as in the doc, step 0
    python lab/probes/offset_head_probe.py init-gated      # ... plus the fitted number-start write gate
    python lab/probes/offset_head_probe.py init-last       # the new layer appended last instead (gate fitted)
    python lab/probes/offset_head_probe.py <model dir>     # a trained checkpoint (5 layers, conv >= 7),
                                      # e.g. models/tiny-gdn-v5
    python lab/probes/offset_head_probe.py <model dir> --ablate   # plain multikey at 1K (N=30) with the
                                      # offset head's / the whole new layer's read-out zeroed
    (--source DIR: the 4-layer GDN the init modes grow, default models/tiny-gdn)

The numbers in lab/results/tiny-gdn-growth.md grew models/tiny-gdn-v2 (`--source models/tiny-gdn-v2`;
in git history: `git checkout b086c8c28b06 -- models/tiny-gdn-v2`).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nbcore.tasks import ruler  # noqa: E402
from nbcore.tasks.tokenizer import load_tokenizer  # noqa: E402
from lab import backbone as bb  # noqa: E402


def head_qkv(model, ids: list[int], head: int = 0, layer_idx: int = 0):
    """Layer ``layer_idx``, head ``head``: q, k [T, d] (l2-normed), v [T, d], beta [T], decay [T]."""
    layer = model.model.layers[layer_idx]
    a = layer.linear_attn
    d, kd = a.head_k_dim, a.key_dim
    cap = {}
    hook = layer.register_forward_pre_hook(
        lambda mod, args, kw: cap.__setitem__("x", args[0] if args else kw["hidden_states"]), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), use_cache=False)
        hook.remove()
        h = layer.input_layernorm(cap["x"])                                             # [1, T, H]
        x = a.in_proj_qkv(h).transpose(1, 2)                                            # [1, C, T]
        K = a.conv1d.weight.shape[-1]
        x = F.silu(F.conv1d(F.pad(x, (K - 1, 0)), a.conv1d.weight, a.conv1d.bias, groups=x.shape[1]))
        x = x[0].T                                                                       # [T, C]
        sl = slice(head * d, (head + 1) * d)
        q = F.normalize(x[:, sl], dim=-1)
        k = F.normalize(x[:, kd + sl.start:kd + sl.stop], dim=-1)
        v = x[:, 2 * kd + sl.start:2 * kd + sl.stop]
        beta = a.in_proj_b(h)[0, :, head].sigmoid()
        g = (-a.A_log.float().exp()[head] * F.softplus(a.in_proj_a(h)[0, :, head].float() + a.dt_bias[head])).exp()
    return q, k, v, beta, g, h[0]


def fit_gate_on_states(model, layer_idx: int, tok, starts: set[int], n: int = 6) -> None:
    """``fit_write_gate`` for a layer whose input is not the embedding: fit on the layer's normed
    inputs over ``n`` train-split examples (number starts vs everything else)."""
    xs, ys = [], []
    for i in range(n):
        ex = ruler.generate("niah_multikey_1", 1024, i, tok, split="train")
        ids = tok(ex["context"] + ex["question"], add_special_tokens=False)["input_ids"]
        xs.append(head_qkv(model, ids, layer_idx=layer_idx)[5])
        ys += [1.0 if t in starts else 0.0 for t in ids]
    w = bb.fit_gate_weights(torch.cat(xs), torch.tensor(ys))
    with torch.no_grad():
        model.model.layers[layer_idx].linear_attn.in_proj_b.weight[0] = w


def multikey_needles(ex: dict, offs: list) -> tuple[list, int]:
    """A niah_multikey_1 example's needles as [(value, token position of its first token)], and the
    asked needle's position (``offs``: the tokenizer's offset mapping of context + question)."""
    needles = []
    for m in re.finditer(r"for [\w-]+ is: (\d+)", ex["context"]):
        pos = next(j for j, (a, b) in enumerate(offs) if a <= m.start(1) - 1 < b or a == m.start(1))
        needles.append((m.group(1), pos))
    return needles, next(p for val, p in needles if val == ex["answers"][0])


def delta_rule_readout(q, k, v, beta, g) -> torch.Tensor:
    """Naive gated delta rule (S <- g S; S += beta (v - S k) k^T), read with q at the last step."""
    S = torch.zeros(v.shape[1], k.shape[1])
    for t in range(k.shape[0]):
        S = S * g[t]
        S = S + beta[t] * torch.outer(v[t] - S @ k[t], k[t])
    return S @ q[-1]


def ablate(model_dir: str, n: int = 30) -> None:
    """Greedy niah_multikey_1 at 1K with layer 0's offset head (head 0) or whole read-out zeroed."""
    from transformers import AutoModelForCausalLM
    tok = load_tokenizer(model_dir)
    for name in ("none", "offset head", "whole new layer"):
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        layer = model.model.layers[0]
        with torch.no_grad():
            if name == "offset head":
                layer.linear_attn.out_proj.weight[:, :layer.linear_attn.head_v_dim] = 0
            elif name == "whole new layer":
                layer.linear_attn.out_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        score = bb.evaluate(model, tok, ["niah_multikey_1"], 1024, n, seed=0)["niah_multikey_1"]
        print(f"{model_dir}: ablated {name}: niah_multikey_1 at 1K = {score:.1f} (N={n})")


def main(argv=None) -> int:
    args = list(argv or sys.argv[1:])
    if not args or args[0].startswith("--"):
        args = ["init", *args]
    arg = args[0]
    torch.set_num_threads(1)
    if "--ablate" in args:
        ablate(arg)
        return 0
    source = Path(args[args.index("--source") + 1]) if "--source" in args else ROOT / "models" / "tiny-gdn"
    tok = load_tokenizer(source if arg.startswith("init") else arg)
    layer_idx = 0
    starts = bb.number_start_ids(tok)
    if arg in ("init", "init-gated", "init-last"):
        torch.manual_seed(0)
        mc = bb.ModelConfig(layers=5, conv=8, bigram_heads=2, offset_heads=((6, 3),))
        model = bb.build_model(mc, tok)
        bb.grow_from(model, source, prepend=0 if arg == "init-last" else 1)
        if arg == "init-last":
            layer_idx = 4
            model.eval()
            fit_gate_on_states(model, layer_idx, tok, set(starts))
        if arg == "init-gated":
            bb.fit_write_gate(model.model.layers[0], model.get_input_embeddings().weight.detach(),
                              bb.number_start_ids(tok), [0])
    else:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(arg)
    model.eval()
    digit_v = {}
    for i in starts:  # value vector of each " <digit>" token, as the head computes it (conv lag 0)
        v = head_qkv(model, [i], layer_idx=layer_idx)[2]
        digit_v[tok.convert_ids_to_tokens(i).strip()] = v[0]
    n, best_needle, best_all = 20, 0, 0
    right = {"own beta": 0, "beta at number starts": 0}
    for i in range(n):
        ex = ruler.generate("niah_multikey_1", 1024, i, tok)
        enc = tok(ex["context"] + ex["question"], add_special_tokens=False, return_offsets_mapping=True)
        ids, offs = enc["input_ids"], enc["offset_mapping"]
        q, k, v, beta, g, _ = head_qkv(model, ids, layer_idx=layer_idx)
        score = k @ q[-1]                                                               # [T]
        needles, gold = multikey_needles(ex, offs)
        best_needle += max(needles, key=lambda vp: score[vp[1]])[1] == gold
        best_all += int((score > score[gold]).sum()) == 0
        ideal = torch.tensor([1.0 if t in set(starts) else 0.0 for t in ids])
        for name, b in (("own beta", beta), ("beta at number starts", ideal)):
            o = delta_rule_readout(q, k, v, b, g)
            if layer_idx == 0:  # values are token embeddings: nearest digit
                sims = {dg: float(F.cosine_similarity(o, vv, dim=0)) for dg, vv in digit_v.items()}
                right[name] += max(sims, key=sims.get) == ex["answers"][0][0]
            else:  # contextual values: nearest of the 4 needles' stored value vectors
                sims = {val: float(F.cosine_similarity(o, v[p], dim=0)) for val, p in needles}
                right[name] += max(sims, key=sims.get) == ex["answers"][0]
    print(f"{arg}: q.k ranks the asked key's needle first among the 4 needles {best_needle}/{n}, "
          f"among all positions {best_all}/{n}")
    for name, r in right.items():
        print(f"{arg}: delta-rule read-out nearest to the gold first digit ({name}): {r}/{n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
