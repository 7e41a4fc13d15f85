"""Probe a Mamba-2 offset layer (the Mamba-2 analogue of lab/probes/offset_head_probe.py).

A tiny Mamba-2 is grown by one first layer whose B reads token t-3 and C token t-6
(``--offset-heads 6:3``, every B/C dim: one B/C group serves all heads) and whose dt write gate is
fitted to number starts (``fit_dt_gate``). On niah_multikey_1 test examples at 1K tokens it
measures, for that layer alone:
  match:     does C (answer position) . B (each needle's first value token) rank the asked key's
             needle first among the 4 needles?
  retrieval: the layer's SSD scan (naive loop, fp32) read at the answer position, compared with the
             x vectors of the ten " <digit>" tokens: is the nearest the gold value's first digit?
             Once with the fitted dt, once with the ideal gate (dt = 1 at number starts, 0 else).

    python lab/probes/mamba2_offset_probe.py models/tiny-mamba2-p5          # grow it, step 0
    python lab/probes/mamba2_offset_probe.py models/tiny-mamba2-p5 --trained   # a grown, trained model (layer 0
                                      # = its offset layer)
    python lab/probes/mamba2_offset_probe.py models/tiny-mamba2-p5 --ablate    # plain multikey at 1K (N=30),
                                      # as trained and with the offset layer's out_proj zeroed
    (--n N: examples, default 20)

The numbers in lab/results/tiny-mamba2-growth.md grew models/tiny-mamba2 and probed
models/tiny-mamba2-v3 (both in git history: `git checkout b086c8c28b06 -- models/tiny-mamba2 models/tiny-mamba2-v3`).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nbcore.tasks import ruler  # noqa: E402
from nbcore.tasks.tokenizer import load_tokenizer  # noqa: E402
from lab import backbone as bb  # noqa: E402
from lab.probes.offset_head_probe import multikey_needles  # noqa: E402


def layer0_ssd_inputs(model, ids: list[int]):
    """Layer 0 of a Mamba2ForCausalLM on ``ids``: x [T, heads, hd], B [T, st], C [T, st], dt [T, heads],
    A [heads] (negative). One B/C group (n_groups = 1)."""
    block = model.backbone.layers[0]
    m = block.mixer
    inter, st, nh = m.intermediate_size, m.ssm_state_size, m.num_heads
    with torch.no_grad():
        h = block.norm(model.get_input_embeddings().weight[torch.tensor(ids)])   # [T, hidden]
        zxbcdt = m.in_proj(h)                                                     # [T, 2*inter + 2*st + nh]
        xbc = zxbcdt[:, inter:2 * inter + 2 * st].T[None]                          # [1, C, T]
        K = m.conv1d.weight.shape[-1]
        xbc = F.silu(F.conv1d(F.pad(xbc, (K - 1, 0)), m.conv1d.weight, m.conv1d.bias,
                              groups=xbc.shape[1]))[0].T                          # [T, C]
        x = xbc[:, :inter].reshape(len(ids), nh, -1)
        B, C = xbc[:, inter:inter + st], xbc[:, inter + st:]
        dt = F.softplus(zxbcdt[:, -nh:] + m.dt_bias)
        A = -m.A_log.float().exp()
    return x, B, C, dt, A


def ssd_readout(x, B, C, dt, A) -> torch.Tensor:
    """Naive Mamba-2 scan (S <- exp(A dt) S + dt x B^T per head), read with C at the last step:
    returns y [heads * hd]."""
    S = torch.zeros(x.shape[1], x.shape[2], B.shape[1])                           # [heads, hd, st]
    for t in range(x.shape[0]):
        S = S * (A * dt[t]).exp()[:, None, None] + dt[t][:, None, None] * x[t][:, :, None] * B[t][None, None, :]
    return (S @ C[-1]).reshape(-1)


def ablate(model_dir: str, n: int = 30) -> None:
    """Greedy niah_multikey_1 at 1K as trained and with layer 0 (the offset layer) silenced."""
    from transformers import AutoModelForCausalLM
    tok = load_tokenizer(model_dir)
    for name in ("none", "offset layer (out_proj = 0)"):
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        if name != "none":
            with torch.no_grad():
                model.backbone.layers[0].mixer.out_proj.weight.zero_()
        score = bb.evaluate(model, tok, ["niah_multikey_1"], 1024, n, seed=0)["niah_multikey_1"]
        print(f"{model_dir}: ablated {name}: niah_multikey_1 at 1K = {score:.1f} (N={n})")


def main(argv=None) -> int:
    args = argv or sys.argv[1:] or [str(ROOT / "models" / "tiny-mamba2-p5")]
    src = args[0]
    torch.set_num_threads(1)
    if "--ablate" in args:
        ablate(src)
        return 0
    tok = load_tokenizer(src)
    starts = bb.number_start_ids(tok)
    if "--trained" in args:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(src)
    else:
        import json
        cfg = json.loads((Path(src) / "config.json").read_text())
        torch.manual_seed(0)
        mc = bb.ModelConfig(family="mamba2", layers=cfg["num_hidden_layers"] + 1, hidden=cfg["hidden_size"],
                            head_dim=cfg["head_dim"], state=cfg["state_size"], conv=8,
                            offset_heads=((6, 3),))
        model = bb.build_model(mc, tok)
        bb.grow_from(model, src, prepend=1)
        lo, leak = bb.fit_dt_gate(model.backbone.layers[0], model.get_input_embeddings().weight.detach(), starts)
        print(f"fitted dt gate: dt >= {lo:.3f} at number starts, <= {leak:.4f} elsewhere")
    model.eval()
    digit_x = {}
    for i in starts:  # x vector of each " <digit>" token as the layer computes it (conv lag 0)
        digit_x[tok.convert_ids_to_tokens(i).strip()] = layer0_ssd_inputs(model, [i])[0][0].reshape(-1)
    n, best_needle = int(args[args.index("--n") + 1]) if "--n" in args else 20, 0
    right = {"fitted dt": 0, "dt = 1 at number starts": 0}
    for i in range(n):
        ex = ruler.generate("niah_multikey_1", 1024, i, tok)
        enc = tok(ex["context"] + ex["question"], add_special_tokens=False, return_offsets_mapping=True)
        ids, offs = enc["input_ids"], enc["offset_mapping"]
        x, B, C, dt, A = layer0_ssd_inputs(model, ids)
        score = B @ C[-1]                                                          # [T]
        needles, gold = multikey_needles(ex, offs)
        best_needle += max(needles, key=lambda vp: score[vp[1]])[1] == gold
        ideal = torch.tensor([1.0 if t in set(starts) else 0.0 for t in ids])[:, None].expand_as(dt)
        for name, d in (("fitted dt", dt), ("dt = 1 at number starts", ideal)):
            y = ssd_readout(x, B, C, d, A)
            sims = {dg: float(F.cosine_similarity(y, v, dim=0)) for dg, v in digit_x.items()}
            right[name] += max(sims, key=sims.get) == ex["answers"][0][0]
    print(f"{src}: C.B ranks the asked key's needle first among the 4 needles {best_needle}/{n}")
    for name, r in right.items():
        print(f"{src}: scan read-out nearest to the gold first digit ({name}): {r}/{n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
