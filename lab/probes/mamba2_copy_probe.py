"""Could a *built* Mamba-2 copy layer supply the next uuid piece? (a probe, no training)

tiny-mamba2-v4 (then shipped; now in git history) copied uuids (niah_single_3) with one wrong piece in ~33,
i.e. ~99.3% per piece, and four continuations did not raise it (lab/results/tiny-mamba2-growth.md). The
offset layer (v3) showed that a built layer-0 circuit can add what training does not find, so this
probes the copy analogue before building it: a new first layer whose dt gate writes only at
uuid-like pieces (hex characters, two-letter a-f pieces, '-'), whose x (value) reads token t, whose
B (key) reads the pieces before it and whose C (query) reads the current ones, so that at the answer
position C.B finds the needle position that followed the same context, and the state's read-out is
the next piece. The SSD scan is evaluated exactly with A = 0 (no decay): y_t = sum_{s<=t} dt_s
(C_t . B_s) x_s, x = the layer's normed embedding. Per teacher-forced answer position after the
first piece: is the piece whose normed embedding is nearest (cosine, among uuid-like pieces) to y_t
the gold next piece?

Key codes, channel j of the 64 B/C dims, u_j = r_j . e (e = normed token embedding):
  B_j(s) = silu(g (u_j(s-1) + alpha_j u_j(s-2)) - th),  C_j(t) = silu(g (u_j(t) + alpha_j u_j(t-1)) - th)
  rows r:  eye (hidden dims 0-63, the project's induction init), randn (random projections);
  alpha:   0 (unigram key, t-1 only), 1 (bag of the two pieces before), +-1 (random signs: a hash
           of the ordered pair); g scaled to the std of u on uuid pieces.
Write gates: "pieces" (dt = 1 at every uuid-like piece: the best a layer-0 gate, which sees only
the token, can do) and "oracle" (dt = 1 only inside the needle's uuid and the answer).

    python lab/probes/mamba2_copy_probe.py models/tiny-mamba2-p5 --n 6     # 6 examples at 1K and at 2K

(The numbers in lab/results were measured on models/tiny-mamba2-v4: `git checkout b086c8c28b06 --
models/tiny-mamba2-v4` restores it.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nbcore.tasks import ruler  # noqa: E402
from nbcore.tasks.tokenizer import load_tokenizer  # noqa: E402

HEX = set("0123456789abcdef-")


def uuid_piece_ids(tok) -> list[int]:
    """Ids of pieces made of hex characters / '-' (with or without a leading space)."""
    return sorted(i for t, i in tok.get_vocab().items() if t.lstrip(" ") and set(t.lstrip(" ")) <= HEX)


def examples(tok, n: int) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, answer start) for n niah_single_3 examples at 1K and n at 2K."""
    out = []
    for length in (1024, 2048):
        for i in range(n):
            ex = ruler.generate("niah_single_3", length, i, tok)
            p = tok(ex["context"] + ex["question"], add_special_tokens=False)["input_ids"]
            a = tok(ruler.answer_text(ex["answers"]), add_special_tokens=False)["input_ids"]
            out.append((p + a, len(p)))
    return out


def codes(e: torch.Tensor, R: torch.Tensor, alpha: torch.Tensor, g: float, th: float):
    """e: [T, hidden] normed embeddings -> B, C: [T, st] (see the module docstring)."""
    u = e @ R.T                                                     # [T, st]
    z = torch.zeros_like(u[:1])
    u1, u2 = torch.cat([z, u[:-1]]), torch.cat([z, z, u[:-2]])      # token t-1, t-2
    return F.silu(g * (u1 + alpha * u2) - th), F.silu(g * (u + alpha * u1) - th)


def oracle_gate(ids: list[int], start: int) -> torch.Tensor:
    """dt = 1 on the needle's uuid (found by its first 8 pieces) and the answer, 0 elsewhere."""
    gold, dt = ids[start:-1], torch.zeros(len(ids))
    k = min(8, len(gold))
    hits = [q for q in range(start - len(gold) + 1) if ids[q:q + k] == gold[:k]]
    if not hits:
        raise RuntimeError("needle uuid not found in the prompt")
    dt[hits[0]:hits[0] + len(gold)] = 1.0
    dt[start:] = 1.0
    return dt


def gated_readout(B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The layer's scan with A = 0 in closed form: y_t = sum_{s<=t} dt_s (C_t . B_s) x_s.
    B, C: [T, st], dt: [T], x: [T, D] -> y: [T, D] (naive_gated_readout is the recurrent reference)."""
    T = len(dt)
    return ((C @ B.T) * torch.ones(T, T).tril() * dt[None, :]) @ x     # [t, s] causal, gated


def naive_gated_readout(B, C, dt, x) -> torch.Tensor:
    """Reference: the Mamba-2 recurrence S <- S + dt_t x_t B_t^T (A = 0), read y_t = S C_t."""
    S, ys = torch.zeros(x.shape[1], B.shape[1]), []
    for t in range(len(dt)):
        S = S + dt[t] * x[t][:, None] * B[t][None, :]
        ys.append(S @ C[t])
    return torch.stack(ys)


def piece_accuracy(eh, pieces, exs, R, alpha, g, th, gate: str) -> tuple[float, float]:
    """(next-piece accuracy after the first answer piece, fraction of uuids with every piece right)."""
    is_piece = torch.zeros(len(eh))
    is_piece[pieces] = 1.0
    P = torch.tensor(pieces)
    keys = F.normalize(eh[P], dim=-1)
    right = total = whole = 0
    for ids, start in exs:
        t_ids = torch.tensor(ids)
        T, e = len(ids), eh[t_ids]
        B, C = codes(e, R, alpha, g, th)
        dt = is_piece[t_ids] if gate == "pieces" else oracle_gate(ids, start)
        y = gated_readout(B, C, dt, e)[start:T - 2]                      # reads predicting start+1 .. T-2
        pred = P[(F.normalize(y, dim=-1) @ keys.T).argmax(-1)]
        ok = pred == t_ids[start + 1:T - 1]
        right, total, whole = right + int(ok.sum()), total + len(ok), whole + bool(ok.all())
    return right / total, whole / len(exs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="models/tiny-mamba2-p5")
    ap.add_argument("--n", type=int, default=6, help="examples per length (1K and 2K)")
    ap.add_argument("--state", type=int, default=64)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    tok = load_tokenizer(args.model)
    E = AutoModelForCausalLM.from_pretrained(args.model).get_input_embeddings().weight.detach()
    eh = E * torch.rsqrt(E.pow(2).mean(-1, keepdim=True) + 1e-5)     # a new layer's RMSNorm (weight 1)
    pieces = uuid_piece_ids(tok)
    exs = examples(tok, args.n)
    piece_set = set(pieces)
    prompt_share = sum(sum(t in piece_set for t in ids[:s]) for ids, s in exs) / sum(s for _, s in exs)
    print(f"{len(pieces)} uuid-like pieces; they are {prompt_share:.1%} of the prompt tokens "
          f"({len(exs)} examples at 1K/2K)")
    cos = F.normalize(eh[pieces], dim=-1) @ F.normalize(eh[pieces], dim=-1).T
    off = cos[~torch.eye(len(pieces), dtype=torch.bool)]
    print(f"cosine between the pieces' normed embeddings: mean {off.mean():.2f}, max {off.max():.2f}")
    st = args.state
    rows = {"eye": torch.eye(E.shape[1])[:st], "randn": torch.randn(st, E.shape[1]) / E.shape[1] ** 0.5}
    alphas = {"0": torch.zeros(st), "1": torch.ones(st), "+-1": torch.randint(0, 2, (st,)).float() * 2 - 1}
    print("| rows | alpha | g*std, th | next piece (gate: pieces) | next piece (gate: oracle) |")
    print("|---|---|---|---|---|")
    best = 0.0
    for rname, R in rows.items():
        s = float((eh[pieces] @ R.T).std())
        for aname, alpha in alphas.items():
            for gs, th in ((1, 0.0), (3, 3.0), (3, 4.5), (5, 7.5)):
                a1, w1 = piece_accuracy(eh, pieces, exs, R, alpha, gs / s, th, "pieces")
                a2, w2 = piece_accuracy(eh, pieces, exs, R, alpha, gs / s, th, "oracle")
                best = max(best, a2)
                print(f"| {rname} | {aname} | {gs}, {th} | {a1:.3f} (whole uuid {w1:.2f}) | {a2:.3f} ({w2:.2f}) |")
    print(f"best next-piece accuracy with the oracle gate: {best:.3f} (v4 as trained: ~0.993)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
