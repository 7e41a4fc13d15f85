"""Where does a tiny model's uuid copy (niah_single_3) go wrong?

For each failed example, the first wrong answer token j is compared with the gold token sequence:
is the k-gram just before it (gold[j-k:j]) repeated earlier in the value? If copy errors came from
k-gram induction collisions (two places in the uuid with the same context), error positions would
show repeated k-grams far more often than positions in general (the baseline column: the same rate
over every position j >= 1 of every gold value).

    python bench/uuid_copy_errors.py models/tiny-gdn-v4 --length 1024 2048 --n 50
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbcore.tasks import ruler  # noqa: E402
from nbcore.tasks.tokenizer import load_tokenizer  # noqa: E402
from nbcore.training.backbone import greedy  # noqa: E402

TASK = "niah_single_3"


def repeated_before(gold: list[int], j: int, k: int) -> bool:
    """The k-gram ending at position j-1 occurs at an earlier start in ``gold``."""
    if j < k:
        return False
    g = tuple(gold[j - k:j])
    return any(tuple(gold[s:s + k]) == g for s in range(0, j - k))


def analyse(model, tok, length: int, n: int, seed: int = 0) -> dict:
    fails, ok, first_tok = [], 0, 0
    base = {1: [], 2: [], 3: []}
    for i in range(n):
        ex = ruler.generate(TASK, length, i, tok, seed=seed, split="test")
        prompt = tok(ex["context"] + ex["question"], add_special_tokens=False)["input_ids"]
        gold = tok(" " + ex["answers"][0], add_special_tokens=False)["input_ids"]
        for j in range(1, len(gold)):
            for k in base:
                base[k].append(repeated_before(gold, j, k))
        out = greedy(model, prompt, len(gold) + 2, tok.eos_token_id)
        if ruler.score(TASK, tok.decode(out), ex["answers"]) == 100:
            ok += 1
            continue
        j = next((x for x in range(min(len(out), len(gold))) if out[x] != gold[x]), None)
        if j is None:
            continue
        if j == 0:
            first_tok += 1
            continue
        fails.append({"example": i, "position": j, "of": len(gold),
                      "context": tok.convert_ids_to_tokens(gold[max(0, j - 3):j]),
                      "gold": tok.convert_ids_to_tokens([gold[j]])[0],
                      "got": tok.convert_ids_to_tokens([out[j]])[0],
                      **{f"rep{k}": repeated_before(gold, j, k) for k in base}})
    rate = lambda xs: round(sum(xs) / len(xs), 3) if xs else float("nan")  # noqa: E731
    return {"length": length, "n": n, "score": 100.0 * ok / n, "failed": n - ok,
            "wrong_first_token": first_tok,
            **{f"rep{k}_at_errors": rate([f[f"rep{k}"] for f in fails]) for k in base},
            **{f"rep{k}_baseline": rate(base[k]) for k in base},
            "errors": fails}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--length", type=int, nargs="+", default=[1024])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the full result (every error) here")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    res = [analyse(model, tok, L, args.n) for L in args.length]
    print("| length | N | single_3 | failed | repeated 1/2/3-gram before the first error | "
          "same, all positions (baseline) |")
    print("|---|---|---|---|---|---|")
    for r in res:
        print(f"| {r['length']} | {r['n']} | {r['score']:.1f} | {r['failed']} | "
              f"{r['rep1_at_errors']:.2f} / {r['rep2_at_errors']:.2f} / {r['rep3_at_errors']:.2f} | "
              f"{r['rep1_baseline']:.2f} / {r['rep2_baseline']:.2f} / {r['rep3_baseline']:.2f} |")
    for r in res:
        for f in r["errors"]:
            print(f"  {r['length']} ex {f['example']}: pos {f['position']}/{f['of']} after "
                  f"{''.join(f['context'])!r}: {f['gold']!r} -> {f['got']!r}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "results": res}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
