"""Where does a tiny model's uuid copy (niah_single_3) go wrong?

A copy reads the next piece of the value by matching the pieces just generated against the pieces
the needle wrote. The whole value is in the state before the answer starts, so a k-gram context
that occurs twice in the value, before *or after* the current position, makes the match ambiguous
(an induction collision). For each wrong piece j (the first wrong token of a failed greedy answer,
and every wrong piece under teacher forcing) this asks, for k = 1, 2, 3:
- at risk: does the k-gram gold[j-k:j] occur elsewhere in the value followed by another piece?
  The baseline column is the same rate over every position of every gold value.
- from a collision: is the wrong piece exactly what follows such another occurrence?

(Until 2026-12-01 this script only looked for earlier occurrences, which hid the collisions with
later positions; see lab/results/tiny-mamba2-growth.md, session 13.)

    python lab/probes/uuid_copy_errors.py models/tiny-mamba2-p5 --length 1024 2048 --n 50

(lab/results/uuid_copy_errors/ holds the runs on models/tiny-mamba2-v4 and models/tiny-gdn-v5; v4 is in
git history: `git checkout b086c8c28b06 -- models/tiny-mamba2-v4`.)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nbcore.tasks import ruler  # noqa: E402
from nbcore.tasks.tokenizer import load_tokenizer  # noqa: E402
from lab.backbone import greedy  # noqa: E402

TASK = "niah_single_3"
KS = (1, 2, 3)


def successors(gold: list[int], j: int, k: int) -> set[int]:
    """Pieces that follow the k-gram gold[j-k:j] at its other occurrences in ``gold`` (earlier or
    later than j). Empty when j < k or the k-gram occurs nowhere else."""
    if j < k:
        return set()
    g = gold[j - k:j]
    return {gold[s] for s in range(k, len(gold)) if s != j and gold[s - k:s] == g}


def at_risk(gold: list[int], j: int, k: int) -> bool:
    """The k-gram before j also occurs elsewhere in the value, followed by another piece."""
    return bool(successors(gold, j, k) - {gold[j]})


def _rate(xs) -> float:
    return round(sum(xs) / len(xs), 3) if xs else float("nan")


def analyse(model, tok, length: int, n: int, seed: int = 0) -> dict:
    """Greedy answers (the score) and one teacher-forced pass per example (every wrong piece)."""
    fails, ok, first_tok = [], 0, 0
    base = {k: [] for k in KS}
    tf_wrong, tf_pieces = [], 0
    by_risk = {"none": [0, 0], "1-gram only": [0, 0], "2-gram": [0, 0]}  # [wrong, pieces]
    for i in range(n):
        ex = ruler.generate(TASK, length, i, tok, seed=seed, split="test")
        prompt = tok(ex["context"] + ex["question"], add_special_tokens=False)["input_ids"]
        gold = tok(" " + ex["answers"][0], add_special_tokens=False)["input_ids"]
        with torch.no_grad():  # teacher forced: position len(prompt)-1+j predicts gold[j]
            logits = model(input_ids=torch.tensor([prompt + gold]), use_cache=False).logits
        pred = logits[0, len(prompt) - 1:len(prompt) - 1 + len(gold)].argmax(-1).tolist()
        tf_pieces += len(gold) - 1
        for j in range(1, len(gold)):
            risk = {k: at_risk(gold, j, k) for k in KS}
            for k in KS:
                base[k].append(risk[k])
            cls = "2-gram" if risk[2] else "1-gram only" if risk[1] else "none"
            by_risk[cls][0] += pred[j] != gold[j]
            by_risk[cls][1] += 1
            if pred[j] != gold[j]:
                tf_wrong.append({f"risk{k}": risk[k] for k in KS}
                                | {f"coll{k}": pred[j] in successors(gold, j, k) for k in KS})
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
                      **{f"risk{k}": at_risk(gold, j, k) for k in KS},
                      **{f"coll{k}": out[j] in successors(gold, j, k) for k in KS}})
    return {"length": length, "n": n, "score": 100.0 * ok / n, "failed": n - ok,
            "wrong_first_token": first_tok,
            **{f"risk{k}_at_errors": _rate([f[f"risk{k}"] for f in fails]) for k in KS},
            **{f"coll{k}_at_errors": _rate([f[f"coll{k}"] for f in fails]) for k in KS},
            **{f"risk{k}_baseline": _rate(base[k]) for k in KS},
            "tf_pieces": tf_pieces, "tf_wrong": len(tf_wrong),
            **{f"tf_risk{k}": _rate([w[f"risk{k}"] for w in tf_wrong]) for k in KS},
            **{f"tf_coll{k}": _rate([w[f"coll{k}"] for w in tf_wrong]) for k in KS},
            "tf_error_rate_by_risk": {c: {"wrong": w, "pieces": p, "rate": round(w / p, 4) if p else None}
                                      for c, (w, p) in by_risk.items()},
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
    trio = lambda r, key: " / ".join(f"{r[key.format(k)]:.2f}" for k in KS)  # noqa: E731
    print("| length | N | single_3 | failed | first errors at risk (1/2/3-gram) | "
          "all positions at risk (baseline) | first errors copied from the collision |")
    print("|---|---|---|---|---|---|---|")
    for r in res:
        print(f"| {r['length']} | {r['n']} | {r['score']:.1f} | {r['failed']} | {trio(r, 'risk{}_at_errors')} | "
              f"{trio(r, 'risk{}_baseline')} | {trio(r, 'coll{}_at_errors')} |")
    print("\nteacher forced (every wrong piece):")
    print("| length | pieces | wrong | wrong at risk (1/2/3-gram) | wrong copied from the collision |")
    print("|---|---|---|---|---|")
    for r in res:
        print(f"| {r['length']} | {r['tf_pieces']} | {r['tf_wrong']} | {trio(r, 'tf_risk{}')} | {trio(r, 'tf_coll{}')} |")
    print("\nteacher-forced error rate by the collision risk of the position:")
    print("| length | no collision | previous piece recurs (1-gram only) | previous 2 pieces recur |")
    print("|---|---|---|---|")
    for r in res:
        cell = lambda c: "{wrong} / {pieces} = {pct}%".format(  # noqa: E731
            pct=round(100 * (r["tf_error_rate_by_risk"][c]["rate"] or 0), 2), **r["tf_error_rate_by_risk"][c])
        print(f"| {r['length']} | {cell('none')} | {cell('1-gram only')} | {cell('2-gram')} |")
    for r in res:
        for f in r["errors"]:
            print(f"  {r['length']} ex {f['example']}: pos {f['position']}/{f['of']} after "
                  f"{''.join(f['context'])!r}: {f['gold']!r} -> {f['got']!r}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "results": res}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
