"""The lab's probe scripts (lab/probes/) run at tiny sizes and measure what they claim."""
from __future__ import annotations

import pytest


def test_uuid_copy_errors_collisions_look_both_ways():
    from lab.probes.uuid_copy_errors import at_risk, successors
    gold = [1, 2, 3, 1, 2, 4, 1]
    assert successors(gold, 5, 2) == {3}          # (1, 2) before 5 also at 0, followed by 3
    assert successors(gold, 2, 2) == {4}          # ... and before 2 it recurs LATER, followed by 4
    assert at_risk(gold, 2, 2) and at_risk(gold, 5, 2)
    assert successors(gold, 5, 3) == set() and not at_risk(gold, 5, 3)   # (3, 1, 2) only there
    assert successors(gold, 4, 1) == {2} and not at_risk(gold, 4, 1)     # after 1 always comes 2
    assert successors([1, 2, 3, 1, 4], 1, 1) == {4} and at_risk([1, 2, 3, 1, 4], 1, 1)  # later 1 -> 4
    assert successors(gold, 1, 2) == set()        # too early for a 2-gram


def test_uuid_copy_errors_runs_on_a_tiny_model(tok):
    """End to end on a random tiny GDN with the project tokenizer: every field is there."""
    import torch

    from lab.backbone import ModelConfig, build_model
    from lab.probes.uuid_copy_errors import analyse
    torch.manual_seed(0)
    m = build_model(ModelConfig(hidden=32, layers=1, heads=2, mlp=32), tok).eval()
    r = analyse(m, tok, 256, 2)
    assert r["n"] == 2 and 0 <= r["score"] <= 100 and r["failed"] == 2 - round(r["score"] / 50)
    assert 0 < r["risk1_baseline"] <= 1 and r["risk3_baseline"] <= r["risk1_baseline"]
    assert r["tf_pieces"] > 0 and 0 <= r["tf_wrong"] <= r["tf_pieces"]
    by = r["tf_error_rate_by_risk"]
    assert sum(c["pieces"] for c in by.values()) == r["tf_pieces"]
    assert sum(c["wrong"] for c in by.values()) == r["tf_wrong"]


def test_mamba2_offset_probe_scan_matches_the_model(tok):
    """lab/probes/mamba2_offset_probe.py's naive scan, gated and projected like the mixer does, equals
    transformers' Mamba2Mixer output at the last position (so the probe measures the real layer)."""
    import torch

    from lab.backbone import ModelConfig, build_model, fit_dt_gate, number_start_ids
    from lab.probes import mamba2_offset_probe as probe
    torch.manual_seed(0)
    m = build_model(ModelConfig(family="mamba2", hidden=32, head_dim=16, state=16, layers=1, conv=8,
                                offset_heads=((6, 3),)), tok).eval()
    fit_dt_gate(m.backbone.layers[0], m.get_input_embeddings().weight.detach(), number_start_ids(tok))
    ids = torch.randint(5, len(tok), (37,)).tolist()
    mix = m.backbone.layers[0].mixer
    assert torch.all(mix.D == 0)  # the probe leaves out the D skip; the offset init sets D = 0
    got = {}
    mix.register_forward_hook(lambda mod, a, out: got.__setitem__("y", out))
    with torch.no_grad():
        m(input_ids=torch.tensor([ids]))
        y = probe.ssd_readout(*probe.layer0_ssd_inputs(m, ids))                   # [inter]
        h = m.backbone.layers[0].norm(m.get_input_embeddings().weight[ids[-1]])
        z = mix.in_proj(h)[:mix.intermediate_size]
        ref = mix.out_proj(mix.norm(y[None, None], z[None, None]))[0, 0]
    torch.testing.assert_close(ref, got["y"][0, -1], rtol=1e-4, atol=1e-5)


def test_mamba2_offset_probe_runs_on_the_shipped_model(capsys, model_dir):
    """Grow the shipped Mamba-2 by an offset layer in front (fitted dt gate) and probe it."""
    from lab.probes import mamba2_offset_probe as probe
    probe.main([str(model_dir("tiny-mamba2-p5")), "--n", "3"])
    out = capsys.readouterr().out
    assert "fitted dt gate" in out and "C.B ranks" in out and "(fitted dt):" in out


def test_copy_probe_scan_matches_the_recurrence():
    """lab/probes/mamba2_copy_probe.py: the closed-form gated read-out equals the Mamba-2 recurrence (A = 0)."""
    import torch

    from lab.probes.mamba2_copy_probe import gated_readout, naive_gated_readout
    g = torch.Generator().manual_seed(0)
    T, st, D = 63, 8, 5
    B, C, x = torch.randn(T, st, generator=g), torch.randn(T, st, generator=g), torch.randn(T, D, generator=g)
    dt = (torch.rand(T, generator=g) > 0.5).float()
    torch.testing.assert_close(gated_readout(B, C, dt, x), naive_gated_readout(B, C, dt, x), rtol=1e-5, atol=1e-4)


def test_copy_probe_can_succeed_with_orthogonal_codes():
    """With one-hot embeddings, identity key rows and a needle whose pieces are all distinct, the
    probe's unigram copy layer reads every next piece right (so a low score measures the codes)."""
    import torch

    from lab.probes.mamba2_copy_probe import piece_accuracy
    V = 16
    eh = torch.eye(V)                        # token i = basis vector i
    needle = [3, 7, 1, 12, 5, 9]             # distinct pieces
    ids = [0, 2] + needle + [2, 0, 2] + needle + [15]   # haystack, needle, question, answer, eos
    start = 2 + len(needle) + 3
    exs = [(ids, start)]
    acc, whole = piece_accuracy(eh, needle, exs, torch.eye(V), torch.zeros(V), 4.0, 2.0, "oracle")
    assert acc == 1.0 and whole == 1.0
    # all-zero key rows give every token the same code, so the pieces cannot be told apart
    acc_bad, _ = piece_accuracy(eh, needle, exs, torch.zeros(V, V), torch.zeros(V), 4.0, 2.0, "oracle")
    assert acc_bad < 0.5


def test_train_curves_parse_and_plot(tmp_path):
    """The log parser reads every logged step (a resumed run's repeat keeps the last line), skips
    other lines, and the CLI writes one PNG for two logs; a log without step lines is an error."""
    from lab.probes import train_curves
    log = ("11:59:12 mamba2: 734432 params; budget 95.0 min\n"
           "11:59:21 step 10 t=9s frac=0.001 ph=0 len=187 ans=7.184 lm=7.366 tf_em=0.00 lr=1.00e-03\n"
           "checkpoint at step 10\n"
           "11:59:40 step 20 t=28s frac=0.004 ph=1 len=137 ans=5.786 lm=6.423 tf_em=0.25 lr=2.00e-03\n"
           "12:01:00 step 20 t=30s frac=0.004 ph=1 len=140 ans=5.500 lm=6.400 tf_em=0.30 lr=2.00e-03\n")
    c = train_curves.parse_log(log)
    assert c["step"] == [10, 20] and c["t"] == [9, 30] and c["phase"] == [0, 1]
    assert c["ans"] == [7.184, 5.5] and c["tf_em"] == [0.0, 0.3]
    (tmp_path / "a.log").write_text(log)
    (tmp_path / "b.log").write_text(log.replace("ans=7.184", "ans=6.0"))
    out = tmp_path / "curves.png"
    assert train_curves.main([f"{tmp_path / 'a.log'}:a", str(tmp_path / "b.log"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty.log").write_text("nothing here\n")
    with pytest.raises(SystemExit, match="no 'step N"):
        train_curves.main([str(tmp_path / "empty.log"), "--out", str(tmp_path / "x.png")])


SCRIPTS = ("mamba2_copy_probe", "mamba2_offset_probe", "offset_head_probe", "uuid_copy_errors", "train_curves")


def test_probe_scripts_import_from_the_repo_root():
    """Each probe loads as a script (python lab/probes/<name>.py, here from inside lab/): its own
    sys.path set-up finds lab and nbcore (one fresh interpreter for all); it defaults to shipped
    models only."""
    import re
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    paths = [str(root / "lab" / "probes" / f"{s}.py") for s in SCRIPTS]
    code = ("import runpy, sys\n"
            f"for p in {paths!r}:\n"
            "    sys.path[:] = [q for q in sys.path if q not in ('', '.')]\n"
            "    runpy.run_path(p, run_name='probe')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=root / "lab", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for script, path in zip(SCRIPTS, paths):
        for m in re.findall(r'"models" / "([\w-]+)"|default="models/([\w-]+)"', Path(path).read_text()):
            name = next(x for x in m if x)
            assert (root / "models" / name).is_dir(), f"{script} defaults to the missing models/{name}"


def test_mone_ablations_data_and_a_short_run():
    """lab/probes/mone_ablations.py: each context holds its needle [MARK, value] once and the query's
    target is that value; a few steps of every variant run and report own/other accuracy."""
    import torch

    from lab.probes import mone_ablations as ab
    g = torch.Generator().manual_seed(0)
    ctx, q = ab.contexts(g, 6, 16)
    assert ctx.shape == (6, 1, 16) and q.shape == (6, 3)
    for row, qq in zip(ctx[:, 0], q):
        at = (row == ab.MARK).nonzero().flatten()
        assert len(at) == 1 and row[at[0] + 1] == qq[-1] and int(qq[-1]) in ab.VALUES.tolist()
        assert ((row >= ab.FILLER[0]) | (row == ab.MARK) | (row == qq[-1])).all()
    for variant in ab.VARIANTS:
        r = ab.run(variant, "curriculum", seed=0, steps=2, eval_every=2, batch=2)
        (c,) = r["curve"]
        assert c["step"] == 2 and c["T"] == 16 and 0 <= c["own_acc"] <= 1 and c["other_ce"] > 0


def test_mone_rates_sees_a_layer_that_writes_the_needle_harder():
    """With input-free rates every layer's needle/filler ratio is 1; a layer whose rate is made to
    grow along the needle tokens' inputs shows up, and the others stay at 1."""
    import torch

    from lab.probes.mone_rates import rates
    from nbcore.mone.model import MoNeConfig, MoNeModel
    from nbcore.tasks import ruler
    from nbcore.tasks.tokenizer import load_tokenizer
    tiny = "models/tiny-qwen2"
    model = MoNeModel.from_pretrained(tiny, cfg=MoNeConfig(segment_len=64, mem_heads=2, lora_rank=4))
    tok = load_tokenizer(tiny)
    with torch.no_grad():
        for ml in model.mone:
            ml.lr_proj.weight.zero_()
    flat = rates(model, tok, length=512, n=2)
    assert len(flat["needle_over_filler_by_layer"]) == model.n_layers
    assert flat["needle_over_filler_by_layer"] == [1.0] * model.n_layers
    # layer 1's rate: softplus(w . x + b), w along (mean needle input - mean filler input)
    ex = ruler.generate("niah_single_1", 512, 0, tok, seed=0, split="test")
    a, b = ex["needle_spans"][0]
    pre = len(tok(ex["context"][:a], add_special_tokens=False)["input_ids"])
    nd = len(tok(ex["context"][a:b], add_special_tokens=False)["input_ids"])
    ids = tok(ex["context"], add_special_tokens=False)["input_ids"]
    s0 = min(pre // 64 * 64, len(ids) - 64)
    x = model.segment_inputs(torch.tensor([ids[s0:s0 + 64]]))[1][0]
    m = torch.zeros(64, dtype=torch.bool)
    m[pre - s0:pre - s0 + nd] = True
    d = x[m].mean(0) - x[~m].mean(0)
    with torch.no_grad():
        model.mone[1].lr_proj.weight.copy_((4 * d / d.norm() ** 2).expand_as(model.mone[1].lr_proj.weight))
    skewed = rates(model, tok, length=512, n=1)["needle_over_filler_by_layer"]
    assert skewed[1] > 3
    assert [r for i, r in enumerate(skewed) if i != 1] == [1.0] * (model.n_layers - 1)
