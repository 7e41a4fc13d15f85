"""Development set for address-free native routers: retrieved gold coverage of top-2
for embmax, embmax_centered and BM25 over the same archived notes, on RULER examples drawn with
seed 1 -- NOT the sweep's seed-0 examples, so a variant chosen here is tested out of sample by
the sweep (configs/eval_ruler.yaml).

    .venv/bin/python bench/router_dev.py --length 64K --n 6 --out bench/results/router_dev-64K.json

Only the writer runs (no replay), so the cost is one ingest per example (~15 s at 64K on 1 CPU).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import add_dev_draw_args, write_dev_draw  # noqa: E402
from nbcore.config import NoteBankConfig  # noqa: E402
from nbcore.evals.methods import coverage  # noqa: E402
from nbcore.notebank.routers import RouteQuery, get_router  # noqa: E402
from nbcore.reader import ingest  # noqa: E402
from nbcore.tasks import ruler  # noqa: E402
from notebank.pipeline.evaluate import parse_length  # noqa: E402
from nbcore.backbones.loading import build_backbone  # noqa: E402

ROUTERS = ("embmax", "embmax_centered", "bm25")


def run(model: str, length: int, n: int, seed: int, top_r: int = 2) -> dict:
    bb = build_backbone({"path": model, "device": "cpu"})
    tok = bb.tokenizer
    cfg = NoteBankConfig(chunk_size=512, write_budget=2, note_budget=64).validate()
    cov = {r: {t: [] for t in ruler.PAPER_SIX} for r in ROUTERS}
    archived = {t: [] for t in ruler.PAPER_SIX}
    for task in ruler.PAPER_SIX:
        for i in range(n):
            ex = ruler.generate(task, length, i, tok, seed=seed)
            res = ingest(bb, ex["context"], cfg, block_size=65536)
            texts = [tok.decode(z.tolist(), skip_special_tokens=True) for z in res.archive.token_ids]
            archived[task].append(coverage(ex["answers"], texts))
            q_ids = torch.tensor(tok(ex["question"], add_special_tokens=False)["input_ids"])
            rq = RouteQuery(bb, res.state, res.archive, ex["question"], q_ids, list(ex["answers"]), coords=None)
            for r in ROUTERS:
                top = np.argsort(-get_router(r)(rq), kind="stable")[:top_r]
                cov[r][task].append(coverage(ex["answers"], [texts[j] for j in top]))
            print(task, i, {r: cov[r][task][-1] for r in ROUTERS}, flush=True)
    mean = lambda v: round(float(np.mean(v)), 3)  # noqa: E731
    return {"archived": {t: mean(v) for t, v in archived.items()},
            "retrieved": {r: {t: mean(v) for t, v in d.items()} for r, d in cov.items()},
            "ratio_to_bm25": {r: {t: (round(mean(cov[r][t]) / mean(cov["bm25"][t]), 3) if mean(cov["bm25"][t]) else None)
                                  for t in ruler.PAPER_SIX} for r in ROUTERS if r != "bm25"}}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__)
    add_dev_draw_args(ap, model="models/tiny-gdn", length="64K", n=6)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = run(a.model, parse_length(a.length), a.n, a.seed)
    write_dev_draw(a, res, argv, top_r=2)
    print(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
