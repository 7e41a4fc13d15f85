"""How much of the gold value MoNe's greedy answers carry, per context length.

RULER's string_match_all scores a 7-digit value 0 unless every digit is right, which hides progress
while the memory learns. This reads the cells of a `jobs/evaluate.py` MoNe run and reports, per
(task, length): n, exact answers, the first digit right, and the share of digits in place (the
answer's digits compared position by position with the gold value's; 10% by chance), with the
share per position, and how the near misses miss: two adjacent digits swapped (4642691 -> 4642619)
or one digit wrong.

    python jobs/evaluate.py -c configs/eval_mone_smollm2.yaml --set 'methods=[mone]' --set 'lengths=[1K]' \
        --set 'tasks=[niah_single_1]' --set adapters=<export> --set output=<dir>
    python bench/mone_digits.py <dir> [--json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd


def _digits(pred: str) -> str:
    return "".join(c for c in pred if c.isdigit())


def digits_in_place(pred: str, gold: str) -> list[bool]:
    """Position-by-position match of the prediction's digits (non-digits dropped) against ``gold``."""
    got = _digits(pred)
    return [i < len(got) and got[i] == g for i, g in enumerate(gold)]


def near_miss(pred: str, gold: str) -> str:
    """"exact", "swap" (two adjacent digits exchanged), "one_digit" (one substituted) or "other",
    on the answer's first ``len(gold)`` digits (non-digits dropped)."""
    got = _digits(pred)[: len(gold)]
    if got == gold:
        return "exact"
    if len(got) == len(gold):
        diff = [i for i, (a, b) in enumerate(zip(got, gold)) if a != b]
        if len(diff) == 1:
            return "one_digit"
        if len(diff) == 2 and diff[1] == diff[0] + 1 and got[diff[0]] == gold[diff[1]] and got[diff[1]] == gold[diff[0]]:
            return "swap"
    return "other"


def summarize(run_dir: Path, method: str = "mone") -> dict:
    cells = sorted((run_dir / "cells" / method).glob("*/*/*.parquet"))
    if not cells:
        raise SystemExit(f"no cells under {run_dir / 'cells' / method}")
    out = {}
    for path in cells:
        task, length = path.parent.parent.name, path.parent.name
        for row in pd.read_parquet(path).itertuples():
            gold = str(list(row.answers)[0])
            hits = digits_in_place(str(row.pred), gold)
            c = out.setdefault(f"{task}/{length}", {"n": 0, "exact": 0, "first_digit": 0, "swap": 0,
                                                    "one_digit": 0, "pos": [0] * len(gold)})
            c["n"] += 1
            c["exact"] += int(float(row.score) == 100.0)
            c["first_digit"] += int(hits[0])
            kind = near_miss(str(row.pred), gold)
            if kind in ("swap", "one_digit"):
                c[kind] += 1
            c["pos"] = [a + int(h) for a, h in zip(c["pos"], hits)]
    for c in out.values():
        c["digits_in_place"] = round(sum(c["pos"]) / (c["n"] * len(c["pos"])), 3)
        c["by_position"] = [round(p / c["n"], 2) for p in c.pop("pos")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a jobs/evaluate.py output folder with MoNe cells")
    ap.add_argument("--method", default="mone")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = ap.parse_args()
    res = summarize(a.run_dir, a.method)
    if a.json:
        print(json.dumps(res, indent=1))
        return
    print("| task / length | n | exact | first digit right | digits in place | by position | misses: adjacent swap / one digit |")
    print("|---|---|---|---|---|---|---|")
    for k, c in res.items():
        print(f"| {k} | {c['n']} | {c['exact']}/{c['n']} | {c['first_digit']}/{c['n']} | "
              f"{100 * c['digits_in_place']:.0f}% | {' '.join(f'{p:.2f}' for p in c['by_position'])} | "
              f"{c['swap']} / {c['one_digit']} |")


if __name__ == "__main__":
    main()
