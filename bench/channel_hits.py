"""Which channels carry the paper router's signal? Per channel (recurrent layer, key head / B-C
group) of Eq. 5, how often its single vote lands on a note that holds a gold value, beside the
top-2 retrieved coverage of the vote count. Only the writer and the question probe run (no replay).

    .venv/bin/python bench/channel_hits.py --model models/tiny-mamba2-p5 --chunk-size 256 \\
        --length 16K --n 2 --out bench/results/channel_hits/tiny-mamba2-p5-16K.json

RULER examples drawn with seed 1 (a development draw, disjoint from the sweep's seed-0 examples).
A channel that votes at random hits a gold note with probability ~ (gold notes / notes), printed
as `chance`.
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
from nbcore.notebank.route import channel_winners, top_r  # noqa: E402
from nbcore.notebank.routers import RouteQuery  # noqa: E402
from nbcore.reader import coords_for, ingest  # noqa: E402
from nbcore.tasks import ruler  # noqa: E402
from notebank.pipeline.evaluate import parse_length  # noqa: E402
from nbcore.backbones.loading import build_backbone  # noqa: E402


def channel_hits(bb, archive, state, question: str, answers: list[str]) -> tuple[np.ndarray, float, float, dict]:
    """-> (hit [J] bool: channel j's winner note holds a gold value, top-2 retrieved coverage,
    chance = fraction of notes holding a gold value, votes = {gold: most votes on a gold note,
    other: most votes on any other note})."""
    tok = bb.tokenizer
    texts = [tok.decode(z.tolist(), skip_special_tokens=True) for z in archive.token_ids]
    gold = np.array([coverage(answers, [t]) > 0 for t in texts])
    q_ids = torch.tensor(tok(question, add_special_tokens=False)["input_ids"])
    rq = RouteQuery(bb, state, archive, question, q_ids, answers, coords_for(bb, archive.config))
    u = rq.probe()                                                   # [Q, J, d_rho]
    keys = archive.routing_keys()                                    # [J*m, N, d_rho]
    winners = channel_winners(u, keys, archive.config.addr_positions).numpy()          # [J]
    votes = np.bincount(winners, minlength=len(texts)).astype(np.float64)
    top = top_r(votes, 2, archive.starts)
    other = votes[~gold].max() if (~gold).any() else 0.0
    return (gold[winners], coverage(answers, [texts[i] for i in top]), float(gold.mean()),
            {"gold": int(votes[gold].max()) if gold.any() else 0, "other": int(other)})


def run(model: str, length: int, n: int, seed: int, chunk_size: int) -> dict:
    bb = build_backbone({"path": model, "device": "cpu"})
    cfg = NoteBankConfig(chunk_size=chunk_size, write_budget=2, note_budget=64).validate()
    hits, cov, chance, votes = [], {t: [] for t in ruler.PAPER_SIX}, [], []
    for task in ruler.PAPER_SIX:
        for i in range(n):
            ex = ruler.generate(task, length, i, bb.tokenizer, seed=seed)
            res = ingest(bb, ex["context"], cfg, block_size=65536)
            h, c, p, v = channel_hits(bb, res.archive, res.state, ex["question"], list(ex["answers"]))
            hits.append(h)
            votes.append(v)
            cov[task].append(c)
            chance.append(p)
            print(task, i, "hits", h.astype(int).tolist(), "top-2 cov", round(c, 2), "votes", v, flush=True)
    hpl = bb.heads_per_layer
    rate = np.mean(np.stack(hits), axis=0)                           # [J]
    return {"channels": [f"L{j // hpl}.h{j % hpl}" for j in range(len(rate))],
            "hit_rate": [round(float(x), 3) for x in rate],
            "chance": round(float(np.mean(chance)), 4),
            # per example: the most votes a gold note got vs the most any other note got
            "votes_gold_vs_other": [[v["gold"], v["other"]] for v in votes],
            "tf_top2_retrieved_cov": {t: round(float(np.mean(v)), 3) for t, v in cov.items()},
            "tf_top2_retrieved_cov_mean": round(float(np.mean([np.mean(v) for v in cov.values()])), 3)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dev_draw_args(ap, model="models/tiny-gdn-v5", length="16K", n=2)
    ap.add_argument("--chunk-size", type=int, default=512, help="C (the sweep: 512 GDN, 256 Mamba-2)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = run(a.model, parse_length(a.length), a.n, a.seed, a.chunk_size)
    write_dev_draw(a, res, argv, chunk_size=a.chunk_size)
    print({k: res[k] for k in ("channels", "hit_rate", "chance", "tf_top2_retrieved_cov_mean", "votes_gold_vs_other")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
