"""NB-LoRA vs NB-TF, and the 2x2 of paper Table 4 (memory access x read adaptation), on a tiny model.

    .venv/bin/python bench/lora_2x2.py --model models/tiny-gdn --updates 150 --eval-n 10

1. Snapshot the model (it may be retrained while we run).
2. Train two adapter sets with Ray Train (2 CPU workers), same data and budget (paper Table 4):
   NB-LoRA (notes + routing online, replay top-R) and plain-LoRA (no NoteBank: context state + question).
   Training data: RULER NIAH examples on the *train* key split (nbcore.training.qa_data.synthetic_qa).
3. Evaluate on held-out RULER examples (*test* key split, other lengths): every example is ingested
   once with the frozen backbone (adapters are off while ingesting, so the state and archive are
   those every method sees), then answered four ways: plain / frozen, plain / plain-LoRA,
   NoteBank / frozen (NB-TF), NoteBank / NB-LoRA. Score: RULER string_match_all (0-100).
Writes bench/results/lora/<tag>.json and .md (table, command, timings, training curves).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine, today, write_json  # noqa: E402


def train(args, model_dir, replay: bool, name: str) -> dict:
    from notebank.pipeline.config import ModelSpec
    from nbcore.training.lora import LoraTrainConfig
    from notebank.pipeline.train_lora import SyntheticSpec, TrainLoraJobConfig, run_train
    nb = _nb(args)
    cfg = TrainLoraJobConfig(
        synthetic=SyntheticSpec(n=args.train_n, lengths=args.train_len, seed=args.seed),
        model=ModelSpec(path=model_dir, device="cpu"),
        train=LoraTrainConfig(updates=args.updates, examples_per_update=4, lr=args.lr, top_r=args.top_r,
                              replay=replay, seed=args.seed, nb=nb),
        storage=os.path.join(args.work, "ray_train"), name=name, output=os.path.join(args.work, name),
        num_workers=args.workers, checkpoint_every=args.checkpoint_every, torch_threads=1, max_failures=1)
    t0 = time.perf_counter()
    s = run_train(cfg)
    s["train_wall_s"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(args.work, name, "metrics.jsonl")) as f:
        hist = [json.loads(l) for l in f]
    k = max(1, len(hist) // 10)
    s["loss_curve"] = [round(sum(h["loss"] for h in hist[i:i + k]) / len(hist[i:i + k]), 4)
                       for i in range(0, len(hist), k)]
    return s


def _nb(args):
    from nbcore.config import NoteBankConfig
    return NoteBankConfig(chunk_size=args.chunk, write_budget=2, note_budget=args.note_budget, window=48, tail=32,
                          addr_dim=16)


def evaluate(args, model_dir, adapters: dict) -> dict:
    import torch

    from nbcore import ReadConfig, answer, ingest
    from nbcore.lora import load_adapter
    from nbcore.tasks import ruler
    from nbcore.backbones.loading import build_backbone
    torch.set_num_threads(args.eval_threads)
    spec = {"path": model_dir, "device": "cpu"}
    frozen = build_backbone(spec)
    nb_lora = load_adapter(build_backbone(spec), adapters["nb_lora"])
    plain_lora = load_adapter(build_backbone(spec), adapters["plain_lora"])
    cells = {  # name -> (backbone, method)
        "plain/frozen": (frozen, "plain"),
        "plain/plain-LoRA": (plain_lora, "plain"),
        "notebank/frozen (NB-TF)": (frozen, "notebank"),
        "notebank/NB-LoRA": (nb_lora, "notebank"),
    }
    tok = frozen.tokenizer
    nb = _nb(args)
    rows = []
    t0 = time.perf_counter()
    for length in args.eval_len:
        for task in args.tasks:
            for i in range(args.eval_n):
                ex = ruler.generate(task, length, i, tok, seed=args.seed + 1000, split="test")
                budget = len(tok(ruler.answer_text(ex["answers"]), add_special_tokens=False)["input_ids"]) + 4
                res = ingest(frozen, ex["context"], nb)
                row = {"task": task, "length": length, "index": i, "answers": ex["answers"],
                       "n_notes": len(res.archive)}
                for name, (bb, method) in cells.items():
                    rc = ReadConfig(method=method, top_r=args.top_r, max_new_tokens=budget)
                    a = answer(bb, res.state, res.archive, ex["question"], rc)
                    row[name] = {"score": ruler.score(task, a.text, ex["answers"]), "text": a.text,
                                 "retrieved": a.retrieved}
                # routing must not depend on the reader
                assert row["notebank/frozen (NB-TF)"]["retrieved"] == row["notebank/NB-LoRA"]["retrieved"]
                notes = [tok.decode(res.archive.token_ids[j].tolist()) for j in row["notebank/NB-LoRA"]["retrieved"]]
                row["retrieval_hit"] = sum(any(g in n for n in notes) for g in ex["answers"]) / len(ex["answers"])
                row["archived"] = sum(any(g in tok.decode(z.tolist()) for z in res.archive.token_ids)
                                      for g in ex["answers"]) / len(ex["answers"])
                rows.append(row)
        print(f"eval length {length}: {len(rows)} examples, {time.perf_counter() - t0:.0f}s", flush=True)
    summary = {}
    for name in cells:
        per = {}
        for length in args.eval_len:
            for task in args.tasks:
                xs = [r[name]["score"] for r in rows if r["task"] == task and r["length"] == length]
                per[f"{task}@{length}"] = round(sum(xs) / len(xs), 2)
        allx = [r[name]["score"] for r in rows]
        summary[name] = {"mean": round(sum(allx) / len(allx), 2), "per_task": per}
    diag = {"retrieval_hit": round(100 * sum(r["retrieval_hit"] for r in rows) / len(rows), 1),
            "archived": round(100 * sum(r["archived"] for r in rows) / len(rows), 1)}
    return {"summary": summary, "diagnostics": diag, "rows": rows, "eval_wall_s": round(time.perf_counter() - t0, 1)}


def to_markdown(res: dict) -> str:
    s = res["eval"]["summary"]
    a = res["args"]
    lines = [f"# NB-LoRA 2x2 on {a['model']} ({res['date']})", "",
             f"Command: `{res['command']}`", "",
             f"Machine: {res['machine']} (training workers and evaluation run 1 torch thread each).", "",
             f"Model snapshot: {res.get('model_meta')}", "",
             f"Held-out: RULER {', '.join(a['tasks'])} on test-split keys, lengths {a['eval_len']}, "
             f"{a['eval_n']} examples per task and length (string_match_all, 0-100). NoteBank C={a['chunk']}, "
             f"W=2, B={a['note_budget']}, R={a['top_r']}.", "",
             f"Training (each adapter set): {a['updates']} AdamW updates x 4 examples, lr {a['lr']}, r=8, alpha=16, "
             f"all recurrent layers; RULER train-split keys, lengths {a['train_len']}; Ray Train, {a['workers']} CPU workers.",
             "", "| memory access \\ reader | frozen | LoRA |", "|---|---|---|",
             f"| w/o NoteBank (plain) | {s['plain/frozen']['mean']} | {s['plain/plain-LoRA']['mean']} |",
             f"| w/ NoteBank (top-{a['top_r']}) | {s['notebank/frozen (NB-TF)']['mean']} | {s['notebank/NB-LoRA']['mean']} |",
             "", "Per task and length:", "", "| task@length | " + " | ".join(s) + " |",
             "|---|" + "---|" * len(s)]
    keys = list(next(iter(s.values()))["per_task"])
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(str(s[n]["per_task"][k]) for n in s) + " |")
    lines += ["", "Training:", ""]
    for name, t in res["train"].items():
        lines.append(f"- {name}: {t.get('updates')} updates, {t.get('train_wall_s')} s, loss curve (10 bins) "
                     f"{t.get('loss_curve')}")
    d = res["eval"].get("diagnostics", {})
    lines += ["", f"Gold values archived in some note: {d.get('archived')}%; in the top-{a['top_r']} replayed notes: "
              f"{d.get('retrieval_hit')}% (native routing; identical for both readers).",
              "", f"Eval wall time: {res['eval']['eval_wall_s']} s.", ""]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/tiny-gdn")
    p.add_argument("--work", default="out/lora_2x2")
    p.add_argument("--out", default="bench/results/lora")
    p.add_argument("--tag", default="tiny_gdn_2x2")
    p.add_argument("--updates", type=int, default=150)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--train-n", type=int, default=600)
    p.add_argument("--train-len", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--eval-len", type=int, nargs="+", default=[4096])
    p.add_argument("--eval-n", type=int, default=10)
    p.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_single_2", "niah_single_3",
                                                  "niah_multikey_1", "niah_multiquery", "niah_multivalue"])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--note-budget", type=int, default=64)
    p.add_argument("--top-r", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--eval-threads", type=int, default=1)   # 2 threads on a busy 2-core box: 40 ms per tiny conv1d
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-train", action="store_true", help="reuse adapters already in --work")
    args = p.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    model_dir = os.path.abspath(os.path.join(args.work, "model"))
    if not args.skip_train:
        if os.path.isdir(model_dir):
            shutil.rmtree(model_dir)
        shutil.copytree(args.model, model_dir)
    res = {"date": today(), "machine": machine(), "command": " ".join(["python"] + sys.argv),
           "args": vars(args), "train": {}}
    with open(os.path.join(model_dir, "train_meta.json")) as f:
        meta = json.load(f)
    res["model_meta"] = {k: meta.get(k) for k in ("model", "steps", "tokens", "wall_s", "params")}
    adapters = {"nb_lora": os.path.join(args.work, "nb-lora"), "plain_lora": os.path.join(args.work, "plain-lora")}
    if not args.skip_train:
        from notebank.pipeline.cli import init_ray
        from notebank.pipeline.config import RaySpec
        init_ray(RaySpec(num_cpus=args.workers))
        for name, replay in (("nb-lora", True), ("plain-lora", False)):
            shutil.rmtree(os.path.join(args.work, "ray_train", name), ignore_errors=True)
            res["train"][name] = train(args, model_dir, replay, name)
            print(json.dumps({name: res["train"][name]}), flush=True)
        import ray
        ray.shutdown()
    else:
        for name in ("nb-lora", "plain-lora"):
            with open(os.path.join(args.work, name, "train_summary.json")) as f:
                res["train"][name] = json.load(f)
    res["eval"] = evaluate(args, model_dir, adapters)
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, f"{args.tag}.json"), res)
    with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
        f.write(to_markdown(res))
    print(to_markdown(res))


if __name__ == "__main__":
    main()
