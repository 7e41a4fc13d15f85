"""Headline table (six-task means, 0-100) for one backbone from a sweep's summary.json or results.json.

    python bench/ruler_headline.py bench/results/ruler/summary.json tiny-gdn-v5
    python bench/ruler_headline.py bench/results/ruler/results.json tiny-gdn-v5     # mean ± half the 95% CI (n)
    python bench/ruler_headline.py bench/results/ruler/summary.json tiny-gdn --methods plain nb-tf-top2

summary.json maps "<backbone>/<method>/<length>" to a six-task mean and holds a key only where all
six tasks were measured, so a "—" here means "not measured at that length", not zero. results.json
(schemas/results.py) has the same keys with n and the 95% interval.
"""
from __future__ import annotations

import argparse
import json
import sys

LENGTHS = ["4K", "16K", "64K", "256K", "1M"]
METHODS = ["plain", "jrt", "nb-tf-top2", "nb-tf-top2-reset", "nb-bm25-top2-reset", "nb-dense-top2",
           "nb-oracle-top2", "nb-oracle-top2-reset", "nb-embmax_centered-top2",
           "nb-embmax_centered-top2-reset"]


def cell(v) -> str:
    """A summary.json number as '82.9'; a results.json entry as '82.9 ± 7.1 (60)'."""
    if v is None:
        return "—"
    if isinstance(v, dict):
        lo, hi = v["ci"]
        return f"{v['value']:.1f} ± {(hi - lo) / 2:.1f} ({v['n-samples']})"
    return f"{v:.1f}"


def load(path: str) -> dict:
    """summary.json as it is; results.json (validated) as its "results" map."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and data.get("schema") == "results.summary":
        import os
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from notebank.schemas.results import validate_results
        validate_results(data, path)
        return data["results"]
    return data


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
        lines.append(f"| {m} | " + " | ".join(cell(v) for v in vals) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("summary")
    ap.add_argument("backbone")
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--lengths", nargs="+", default=LENGTHS)
    args = ap.parse_args(argv)
    summary = load(args.summary)
    try:
        print(headline(summary, args.backbone, args.methods, args.lengths))
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
