"""Training curves of lab/train_backbone.py logs, side by side: answer CE, LM CE and teacher-forced
answer EM (the logged EMAs) against step and against wall-clock minutes, one PNG.

Why: from-scratch variants are compared with the shipped run at matched steps and matched wall time
(a variant that costs more per step on this CPU can look better per step and worse per minute).

    python lab/probes/train_curves.py lab/results/tiny-mamba2-growth/train_v2.log:v2 \
        lab/results/tiny-mamba2-growth/train_p1_scratch.log:p1-product-layer --out lab/results/tiny-mamba2-growth/curves_p1_vs_v2.png
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

# "step 10 t=9s frac=0.001 ph=0 len=187 ans=7.184 lm=7.366 tf_em=0.00 lr=1.00e-03"
STEP_RE = re.compile(r"step (\d+) t=(\d+)s frac=\S+ ph=(\d+) len=(\d+) ans=([\d.]+) lm=([\d.]+) tf_em=([\d.]+)")
FIELDS = ("step", "t", "phase", "len", "ans", "lm", "tf_em")


def parse_log(text: str) -> dict[str, list[float]]:
    """Columns of the logged steps (a resumed run's repeated steps keep the last one logged)."""
    rows: dict[int, tuple] = {}
    for m in STEP_RE.finditer(text):
        vals = (int(m[1]), int(m[2]), int(m[3]), int(m[4]), float(m[5]), float(m[6]), float(m[7]))
        rows[vals[0]] = vals
    cols = list(zip(*(rows[s] for s in sorted(rows)))) or [()] * len(FIELDS)
    return {f: list(c) for f, c in zip(FIELDS, cols)}


def plot(curves: dict[str, dict[str, list[float]]], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = (("ans", "answer CE (EMA)", True), ("lm", "LM CE (EMA)", False), ("tf_em", "teacher-forced answer EM (EMA)", False))
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    for row, (x, xlabel) in enumerate((("step", "step"), ("t", "wall-clock minutes"))):
        for ax, (key, title, log_y) in zip(axes[row], panels):
            for name, c in curves.items():
                xs = c[x] if x == "step" else [t / 60 for t in c["t"]]
                ax.plot(xs, c[key], label=name, lw=1.2)
            ax.set_xlabel(xlabel)
            ax.set_title(title)
            ax.grid(alpha=0.3)
            if log_y:
                ax.set_yscale("log")
    axes[0][0].legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", help="LOG[:LABEL] (label defaults to the file stem)")
    ap.add_argument("--out", required=True, help="PNG to write")
    args = ap.parse_args(argv)
    curves = {}
    for spec in args.logs:
        path, _, label = spec.partition(":")
        c = parse_log(Path(path).read_text())
        if not c["step"]:
            raise SystemExit(f"{path}: no 'step N t=..s ... ans=.. lm=.. tf_em=..' lines")
        curves[label or Path(path).stem] = c
        print(f"{label or path}: {len(c['step'])} points, last step {c['step'][-1]} at {c['t'][-1] / 60:.1f} min, "
              f"ans {c['ans'][-1]:.3f}, lm {c['lm'][-1]:.3f}, tf_em {c['tf_em'][-1]:.2f}")
    plot(curves, Path(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
