"""Lab CLI: train the tiny frozen base Transformer for MoNe (transformers Qwen2 layout) on CPU.

    python lab/train_base_transformer.py --out models/tiny-qwen2 --minutes 20 --threads 1
    # the shipped models/tiny-qwen2 stopped at step 1,051 of that budget (12.3 CPU minutes):
    python lab/train_base_transformer.py --out models/tiny-qwen2 --minutes 20 --threads 1 --max-steps 1051

The budget is CPU time of the training process (resumes add up), not wall time.

Model: Qwen2ForCausalLM, hidden 128, 4 layers, 4 query heads = 4 KV heads of dim 32
(num_heads * head_dim == hidden, as in Qwen2.5-0.5B: 14 x 64 = 896), SwiGLU MLP 384, tied
embeddings, the project BPE tokenizer (``nbcore.tasks.tokenizer.build_tokenizer``, 2,048 entries;
identical to the one shipped with the other tiny models, which is built deterministically).
Data: RULER S-NIAH (noise and essay haystacks), MK-NIAH and FWE (train-split keys) plus plain
prose LM, full context in the prompt (ICL), length curriculum 128 -> 1024 tokens.
Loss = answer CE + 0.5 x LM CE on the other tokens. AdamW, warmup, cosine decay, clip 1.0.
Resumes from runs/<out name>/ckpt.pt. Pure torch + transformers (no ray).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nbcore.tasks import haystack as hs  # noqa: E402
from nbcore.tasks import ruler  # noqa: E402

TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "fwe")
PHASES = [(0.0, 128, 256), (0.15, 192, 512), (0.45, 256, 1024)]
# "dense": needle-dense start (short S-NIAH contexts, many answers per step), then all tasks
RECIPES = {
    "default": [(f, lo, hi, TASKS) for f, lo, hi in PHASES],
    "dense": [(0.0, 64, 192, ("niah_single_1",)), (0.25, 96, 384, ("niah_single_1", "niah_single_2")),
              (0.45, 128, 512, TASKS), (0.7, 256, 1024, TASKS)],
    # "induct": like "dense" plus repeated random token strings (LM loss on the repeat), the classic
    # fast route to induction heads, which needle retrieval builds on
    "induct": [(0.0, 64, 192, ("repeat", "niah_single_1")), (0.25, 96, 384, ("repeat", "niah_single_1", "niah_single_2")),
               (0.45, 128, 512, ("repeat",) + TASKS), (0.7, 256, 1024, TASKS)],
}


def build_model(tok, hidden=128, layers=4, heads=4, kv_heads=4, mlp=384):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=16384,
        rope_theta=10000.0, tie_word_embeddings=True, use_cache=True, use_sliding_window=False,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return Qwen2ForCausalLM(cfg)


def encode(ex, tok):
    prompt = tok(ex["context"] + ex["question"], add_special_tokens=False)["input_ids"]
    ans = tok(ruler.answer_text(ex["answers"]), add_special_tokens=False)["input_ids"]
    return prompt + ans + [tok.eos_token_id], len(prompt)


def make_batch(step, frac, tok, seed, tokens_per_step, recipe="default"):
    rng = random.Random(f"tinyqwen2|{seed}|{step}")
    _, lo, hi, tasks = [p for p in RECIPES[recipe] if p[0] <= frac][-1]
    length = rng.randint(lo, hi)
    seqs = []
    for _ in range(max(1, tokens_per_step // length)):
        task = rng.choice(tasks)
        if task == "repeat":  # random tokens x (length/2), then x again; only the repeat is scored
            half = length // 2
            x = [rng.randrange(4, len(tok)) for _ in range(half)]
            seqs.append((x + x, half + 1))
            continue
        if rng.random() < 0.1:
            text = hs.essay_slice(int(length * 0.8), rng.randrange(len(hs.essay_words())))
            ids = tok(text, add_special_tokens=False)["input_ids"][:length]
            seqs.append((ids, len(ids)))
        else:
            ex = ruler.generate(task, length, rng.randrange(1 << 30), tok, seed=seed,
                                split="train")
            seqs.append(encode(ex, tok))
    T = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), T), tok.pad_token_id, dtype=torch.long)
    ans = torch.zeros((len(seqs), T), dtype=torch.bool)
    lm = torch.zeros((len(seqs), T), dtype=torch.bool)
    for i, (s, a) in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        lm[i, :min(a, len(s)) - 1] = True
        ans[i, a - 1:len(s) - 1] = True
    return ids, ans, lm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "models" / "tiny-qwen2"))
    ap.add_argument("--minutes", type=float, default=20.0, help="CPU-time budget (minutes)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tokens-per-step", type=int, default=4096)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="default")
    ap.add_argument("--max-steps", type=int, default=None,
                    help="stop after this many steps (the lr schedule still follows --minutes)")
    ap.add_argument("--prior-cpu", type=float, default=None,
                    help="CPU seconds spent before the checkpoint (for checkpoints without the record)")
    args = ap.parse_args(argv)

    from nbcore.tasks.tokenizer import build_tokenizer, load_tokenizer
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    run_dir = Path(args.run_dir) if args.run_dir else ROOT / "runs" / out.name
    run_dir.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(out) if (out / "tokenizer.json").is_file() else build_tokenizer()
    model = build_model(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    step, elapsed, cpu_prior = 0, 0.0, 0.0
    ck_path = run_dir / "ckpt.pt"
    if ck_path.exists():
        ck = torch.load(ck_path, weights_only=False)
        model.load_state_dict(ck["model"]); opt.load_state_dict(ck["opt"])
        step, elapsed = ck["step"], ck["elapsed"]
        cpu_prior = ck.get("cpu", args.prior_cpu or 0.0)
        print(f"resumed at step {step}, {elapsed:.0f}s", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    budget = args.minutes * 60
    t0 = time.time() - elapsed
    c0 = time.process_time()
    cpu = lambda: cpu_prior + time.process_time() - c0  # noqa: E731  (this process, all threads)
    last = time.time()
    ema = None

    def save():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "elapsed": time.time() - t0,
                    "cpu": cpu()}, ck_path)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        (out / "train_meta.json").write_text(json.dumps({
            "script": "lab/train_base_transformer.py", "params": n_params, "steps": step,
            "wall_s": round(time.time() - t0, 1), "cpu_s": round(cpu(), 1), "threads": args.threads, "lr": args.lr,
            "tokens_per_step": args.tokens_per_step, "recipe": args.recipe, "minutes": args.minutes,
            "seed": args.seed, "max_steps": args.max_steps,
            "phases": RECIPES[args.recipe],
            "final_ema": {"ans_ce": ema[0], "lm_ce": ema[1], "tf_em": ema[2]} if ema else None},
            indent=2))

    model.train()
    while cpu() < budget and (args.max_steps is None or step < args.max_steps):  # budget = CPU seconds
        # of this training (all runs of it together)
        frac = cpu() / budget
        ids, ans, lm = make_batch(step, frac, tok, args.seed, args.tokens_per_step, args.recipe)
        lr = args.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        tgt = ids[:, 1:]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                             reduction="none").view_as(tgt)
        a, l = ans[:, :-1], lm[:, :-1]
        a_l = (ce * a).sum() / a.sum().clamp(min=1)
        l_l = (ce * l).sum() / l.sum().clamp(min=1)
        loss = a_l + 0.5 * l_l
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        with torch.no_grad():
            ok = ((logits.argmax(-1) == tgt) | ~a).all(1) & a.any(1)
            em = ok.float().sum().item() / max(1, int(a.any(1).sum()))
        v = (a_l.item(), l_l.item(), em)
        ema = v if ema is None else tuple(0.95 * e + 0.05 * x for e, x in zip(ema, v))
        if step % 10 == 0:
            print(f"{time.strftime('%H:%M:%S')} step {step} t={time.time() - t0:.0f}s len={ids.shape[1]} "
                  f"cpu={cpu():.0f}s ans={ema[0]:.3f} lm={ema[1]:.3f} tf_em={ema[2]:.2f} lr={lr:.2e}", flush=True)
        if time.time() - last > 120:
            save(); last = time.time()
    save()
    print(f"done: {step} steps, {n_params} params, {time.time() - t0:.0f}s wall, {cpu():.0f}s CPU",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
