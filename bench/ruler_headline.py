"""Headline table (six-task means, 0-100) for one backbone from a sweep's summary.json.

    python bench/ruler_headline.py bench/results/ruler/summary.json tiny-gdn-v5
    python bench/ruler_headline.py bench/results/ruler/summary.json tiny-gdn --methods plain nb-tf-top2

summary.json maps "<backbone>/<method>/<length>" to a six-task mean and holds a key only where all
six tasks were measured, so a "—" here means "not measured at that length", not zero.
"""
from __future__ import annotations

import argparse
import json
import sys

LENGTHS = ["4K", "16K", "64K", "256K", "1M"]
METHODS = ["plain", "jrt", "nb-tf-top2", "nb-tf-top2-reset", "nb-bm25-top2-reset", "nb-dense-top2",
           "nb-oracle-top2", "nb-oracle-top2-reset", "nb-embmax_centered-top2",
           "nb-embmax_centered-top2-reset"]


def headline(summary: dict, backbone: str, methods=METHODS, lengths=LENGTHS) -> str:
    """-> Markdown table: one row per method with any measured length, one column per length."""
    known = {k.split("/")[0] for k in summary}
    if backbone not in known:
        raise KeyError(f"no backbone {backbone!r} in summary.json (have: {sorted(known)})")
    lines = [f"| {backbone} | " + " | ".join(lengths) + " |", "|---|" + "---|" * len(lengths)]
    for m in methods:
        vals = [summary.get(f"{backbone}/{m}/{L}") for L in lengths]
        if all(v is None for v in vals):
            continue
        lines.append(f"| {m} | " + " | ".join("—" if v is None else f"{v:.1f}" for v in vals) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("summary")
    ap.add_argument("backbone")
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--lengths", nargs="+", default=LENGTHS)
    args = ap.parse_args(argv)
    with open(args.summary) as f:
        summary = json.load(f)
    try:
        print(headline(summary, args.backbone, args.methods, args.lengths))
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
