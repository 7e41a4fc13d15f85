"""Analytical cost beside the measured one (RULER report): nbcore.cost (paper App. C.6-C.7) applied to
the counts each example recorded, next to the measured wall times and archive sizes.

    FLOPs    F_Plain (Eq. 12) of the plain rows; NoteBank's added ΔF = F_write + F_route + (|Q| + |R|) f_phi
             (Eq. 13) of the nb-tf-top2 rows, and ΔF / F_Plain as Eq. 16 (a ratio of sums), from the
             checkpoint's shapes (f_phi, h_phi) and the recorded T, |Q|, |R|, |Y|, N
    bytes    the archive as measured (its arrays: BF16 addresses, int32 note token ids, three int64 span
             fields per note) beside Eq. 19; M_NB (Eq. 20: archive + FP32 states + conv caches, without
             helper tensors) beside an MHA KV cache of the same width and depth (Eq. 17)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from notebank.pipeline.reporting.common import length_label

NB_METHOD = "nb-tf-top2"            # the paper's NoteBank method, costed against plain


@dataclass(frozen=True)
class CostModel:
    """What the analytical cost of one backbone needs: its shapes and the writer config."""

    shapes: object                  # nbcore.cost.ModelShapes
    chunk_size: int = 512
    tail: int = 32
    addr_dim: int = 16


def shapes_of(model) -> object | None:
    """nbcore.cost.ModelShapes of a ModelSpec (checkpoint config.json or hf_config); None when the
    config cannot be read or its architecture is not one nbcore.cost knows."""
    import os

    from nbcore.cost import shapes_from_hf_config
    try:
        from transformers import AutoConfig
        if model.path:
            if not os.path.isfile(os.path.join(model.path, "config.json")):
                return None                 # a remote or missing checkpoint: never a network call here
            cfg = AutoConfig.from_pretrained(model.path, local_files_only=True)
        elif model.hf_config:
            kw = dict(model.hf_config)
            cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
        else:
            return None
        return shapes_from_hf_config(cfg)
    except Exception:  # noqa: BLE001 - no analytical cost for this backbone; the report says so
        return None


def cost_models(backbones, budgets, notebank_for) -> dict[tuple[str, str], CostModel]:
    """{(reported backbone, budget): CostModel}. Several entries can report under one backbone (adapter
    and add-on entries): the entry named like the label wins, else the first."""
    out: dict[tuple[str, str], CostModel] = {}
    ordered = sorted(backbones, key=lambda b: b.name != b.label)
    cache: dict[str, object] = {}
    for b in ordered:
        for budget in budgets:
            k = (b.label, budget.name)
            if k in out:
                continue
            mk = repr(b.model)
            if mk not in cache:
                cache[mk] = shapes_of(b.model)
            if cache[mk] is None:
                continue
            nb = notebank_for(b, budget)
            out[k] = CostModel(cache[mk], nb.chunk_size, nb.tail, nb.addr_dim)
    return out


def _mib(x: float) -> str:
    return f"{x / 2**20:.3f}"


def _answer_len(d, budget: int | None):
    """|Y| per row: the recorded answer tokens, else the generation budget (rows of older runs)."""
    if "answer_tokens" in d and d["answer_tokens"].notna().all():
        return d["answer_tokens"].clip(lower=1).astype(float), True
    return np.full(len(d), float(budget or 1)), False


def cost_section(df, costs: dict[tuple[str, str], CostModel], answer_budget: int | None = None) -> list[str]:
    """Markdown lines: per backbone (and budget), a length x {measured, analytical} table for plain
    and nb-tf-top2. Backbones without a cost model or without both methods are left out."""
    from nbcore import cost
    need = {"plain", NB_METHOD}
    keys = ["task", "length", "index"]
    budgets = df["budget"] if "budget" in df else None
    lines: list[str] = []
    for (bb, bud), cm in sorted(costs.items()):
        d = df[(df.backbone == bb) & (budgets == bud if budgets is not None else True)]
        if not need <= set(d.method):
            continue
        s = cm.shapes
        f_phi, h_phi = cost.backbone_flops_per_token(s), cost.lm_head_flops(s)
        plain, nb = d[d.method == "plain"].copy(), d[d.method == NB_METHOD].copy()
        plain["y"], recorded = _answer_len(plain, answer_budget)
        nb = nb.merge(plain[keys + ["y"]], on=keys, how="left")           # the Plain answer length, paired
        nb["y"] = nb["y"].fillna(float(answer_budget or 1))
        for t in (plain, nb):
            t["wall_s"] = t["ingest_s"] + t["probe_s"] + t["route_s"] + t["replay_generate_s"]
        if not lines:
            lines += ["## Cost: measured and analytical (paper App. C.6-C.7)", "",
                      "Measured: mean wall seconds per example (ingest + probe + route + replay/generate) and "
                      "the archive's arrays (BF16 addresses, int32 note token ids, three int64 span fields per "
                      "note). Analytical (nbcore.cost, from the checkpoint's shapes and each example's recorded "
                      "counts): F_Plain (Eq. 12) per plain example; the FLOPs NoteBank adds, "
                      f"ΔF = F_write + F_route + (|Q| + |R|) f_phi (Eq. 13), per {NB_METHOD} example, and "
                      "ΔF / F_Plain over the examples (Eq. 16); the archive by Eq. 19; M_NB = archive + FP32 "
                      "states + conv caches (Eq. 20, without helper tensors) beside an MHA KV cache of the same "
                      "width and depth, BF16 (Eq. 17).", ""]
        title = bb if bud == "default" else f"{bb} ({bud})"
        y_note = "" if recorded else "; |Y| = the generation budget (answer lengths not recorded)"
        lines += [f"### {title}", "",
                  f"f_phi = {f_phi:,} FLOPs/token, h_phi = {h_phi:,} FLOPs, J = {s.channels} channels, "
                  f"C = {cm.chunk_size}, d_rho = {cm.addr_dim}{y_note}.", "",
                  "| length | T | plain s | F_Plain GFLOPs | nb s | ΔF GFLOPs | ΔF / F_Plain | notes N | "
                  "archived U | archive KiB (measured) | archive KiB (Eq. 19) | M_NB MiB | MHA KV MiB |",
                  "|" + "---|" * 13]
        for n in sorted(set(plain.length) & set(nb.length)):
            p, q = plain[plain.length == n], nb[nb.length == n]
            f_plain = [cost.plain_flops(s, context_len=r.n_tokens, question_len=r.question_tokens, answer_len=r.y)
                       for r in p.itertuples()]
            f_plain_nb = [cost.plain_flops(s, context_len=r.n_tokens, question_len=r.question_tokens,
                                           answer_len=r.y) for r in q.itertuples()]
            added = [cost.added_flops(s, context_len=r.n_tokens, question_len=r.question_tokens,
                                      replay_len=r.replay_len, answer_len=r.y, num_notes=r.n_notes,
                                      chunk_size=cm.chunk_size, tail=cm.tail, addr_dim=cm.addr_dim).total
                     for r in q.itertuples()]
            measured = (q.n_notes * (q.address_bytes_per_note + 24) + 4 * q.archived_tokens).mean()
            eq19 = float(np.mean([cost.archive_bytes(r.n_notes, r.archived_tokens, channels=s.channels,
                                                     addr_dim=cm.addr_dim) for r in q.itertuples()]))
            states = cost.recurrent_state_bytes(s) + cost.conv_cache_bytes(s)
            kv = cost.mha_kv_cache_bytes(s.num_layers, s.hidden_size, float((q.n_tokens + q.question_tokens).mean()))
            lines.append(f"| {length_label(n)} | {q.n_tokens.mean():.0f} | {p.wall_s.mean():.3f} | "
                         f"{np.mean(f_plain) / 1e9:.3f} | {q.wall_s.mean():.3f} | {np.mean(added) / 1e9:.4f} | "
                         f"{100 * sum(added) / sum(f_plain_nb):.2f}% | {q.n_notes.mean():.1f} | "
                         f"{q.archived_tokens.mean():.0f} | {measured / 1024:.1f} | {eq19 / 1024:.1f} | "
                         f"{_mib(eq19 + states)} | {_mib(kv)} |")
        lines.append("")
    return lines
