"""The benchmark scripts run (tiny sizes) and reject bad arguments; numbers live in bench/results."""
import json

import pytest

from bench.gpu import overhead_gpu
from bench import overhead, route_bench


def test_gpu_script_cpu_smoke(tmp_path):
    out = tmp_path / "gpu.json"
    doc = overhead_gpu.main(["--tiny", "--device", "cpu", "--lengths", "1K", "--reps", "1", "--gen", "2",
                             "--out", str(out)])
    row = doc["lengths"]["1K"]
    # times are rounded to ms in the JSON, the ratio is taken before rounding
    assert row["plain_s"] > 0 and row["nb_s"] > 0
    assert row["ratio"] == pytest.approx(row["nb_s"] / row["plain_s"], rel=0.1, abs=0.05)
    assert json.loads(out.read_text())["model"].startswith("tiny")


@pytest.mark.parametrize("argv", [["--reps", "0", "--tiny", "--device", "cpu"],
                                  ["--lengths", "12Q", "--tiny", "--device", "cpu"]], ids=["reps0", "badlen"])
def test_gpu_script_rejects_bad_args(argv):
    with pytest.raises((SystemExit, ValueError)):
        overhead_gpu.main(argv)


def test_parse_len():
    assert overhead.parse_len("16K") == 16384 and overhead.parse_len("1M") == 1 << 20 and overhead.parse_len("700") == 700


def test_route_bench_small():
    res = route_bench.bench_route([8, 64], J=4, Q=3, reps=1)
    assert set(res) == {"8", "64"} and res["64"]["warm_ms"] >= 0


def test_router_dev_small():
    """One 1K example per task through the shipped tiny GDN; coverages are fractions, ratios vs BM25."""
    from pathlib import Path
    from bench import router_dev
    res = router_dev.run(str(Path(__file__).resolve().parents[1] / "models" / "tiny-gdn"), 1024, 1, seed=1)
    assert set(res["retrieved"]) == {"embmax", "embmax_centered", "bm25"}
    assert all(0.0 <= v <= 1.0 for d in res["retrieved"].values() for v in d.values())
    assert set(res["ratio_to_bm25"]) == {"embmax", "embmax_centered"}


def test_channel_hits_agrees_with_the_native_router():
    """The per-channel diagnosis re-derives Eq. 5's votes: its top-2 coverage and gold vote count
    must equal what the production `native` router + top_r give on the same archive."""
    from pathlib import Path
    import numpy as np
    import torch
    from bench import channel_hits as ch
    from nbcore.config import NoteBankConfig
    from nbcore.evals.ruler_eval import coverage
    from nbcore.notebank.route import top_r
    from nbcore.notebank.routers import RouteQuery, get_router
    from nbcore.reader import coords_for, ingest
    from nbcore.tasks import ruler
    from pipeline.worker import build_backbone
    bb = build_backbone({"path": str(Path(__file__).resolve().parents[1] / "models" / "tiny-gdn"), "device": "cpu"})
    ex = ruler.generate("niah_multivalue", 2048, 0, bb.tokenizer, seed=1)
    res = ingest(bb, ex["context"], NoteBankConfig(chunk_size=256, write_budget=2, note_budget=64).validate())
    hit, cov, chance, votes = ch.channel_hits(bb, res.archive, res.state, ex["question"], list(ex["answers"]))
    assert hit.shape == (res.archive.routing_keys().shape[0],) and 0 < chance < 1
    q_ids = torch.tensor(bb.tokenizer(ex["question"], add_special_tokens=False)["input_ids"])
    rq = RouteQuery(bb, res.state, res.archive, ex["question"], q_ids, list(ex["answers"]),
                    coords_for(bb, res.archive.config))
    native = get_router("native")(rq)
    texts = [bb.tokenizer.decode(z.tolist(), skip_special_tokens=True) for z in res.archive.token_ids]
    gold = np.array([coverage(list(ex["answers"]), [t]) > 0 for t in texts])
    assert cov == coverage(list(ex["answers"]), [texts[i] for i in top_r(native, 2, res.archive.starts)])
    assert votes["gold"] == int(native[gold].max()) and native[gold].sum() == hit.sum()


def test_channel_hits_cli_writes_its_result(tmp_path):
    import json
    from pathlib import Path
    from bench import channel_hits
    out = tmp_path / "hits.json"
    model = str(Path(__file__).resolve().parents[1] / "models" / "tiny-gdn")
    assert channel_hits.main(["--model", model, "--length", "1024", "--n", "1", "--chunk-size", "256",
                              "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["channels"]) == len(res["hit_rate"]) == 16 and len(res["votes_gold_vs_other"]) == 6
    assert res["chunk_size"] == 256 and res["seed"] == 1 and "--chunk-size 256" in res["command"]


def test_uuid_copy_errors_collisions_look_both_ways():
    from bench.uuid_copy_errors import at_risk, successors
    gold = [1, 2, 3, 1, 2, 4, 1]
    assert successors(gold, 5, 2) == {3}          # (1, 2) before 5 also at 0, followed by 3
    assert successors(gold, 2, 2) == {4}          # ... and before 2 it recurs LATER, followed by 4
    assert at_risk(gold, 2, 2) and at_risk(gold, 5, 2)
    assert successors(gold, 5, 3) == set() and not at_risk(gold, 5, 3)   # (3, 1, 2) only there
    assert successors(gold, 4, 1) == {2} and not at_risk(gold, 4, 1)     # after 1 always comes 2
    assert successors([1, 2, 3, 1, 4], 1, 1) == {4} and at_risk([1, 2, 3, 1, 4], 1, 1)  # later 1 -> 4
    assert successors(gold, 1, 2) == set()        # too early for a 2-gram


def test_uuid_copy_errors_runs_on_a_tiny_model(tmp_path):
    """End to end on a random tiny GDN with the project tokenizer: every field is there."""
    import torch
    from nbcore.tasks.tokenizer import build_tokenizer
    from nbcore.training.backbone import ModelConfig, build_model
    from bench.uuid_copy_errors import analyse
    tok = build_tokenizer()
    torch.manual_seed(0)
    m = build_model(ModelConfig(hidden=32, layers=1, heads=2, mlp=32), tok).eval()
    r = analyse(m, tok, 256, 2)
    assert r["n"] == 2 and 0 <= r["score"] <= 100 and r["failed"] == 2 - round(r["score"] / 50)
    assert 0 < r["risk1_baseline"] <= 1 and r["risk3_baseline"] <= r["risk1_baseline"]
    assert r["tf_pieces"] > 0 and 0 <= r["tf_wrong"] <= r["tf_pieces"]
    by = r["tf_error_rate_by_risk"]
    assert sum(c["pieces"] for c in by.values()) == r["tf_pieces"]
    assert sum(c["wrong"] for c in by.values()) == r["tf_wrong"]


def test_ruler_headline_table():
    from bench.ruler_headline import headline
    summary = {"m/plain/4K": 63.25, "m/plain/1M": 0.0, "m/nb-tf-top2/64K": 20.8, "other/plain/4K": 1.0}
    lines = headline(summary, "m", methods=["plain", "nb-tf-top2", "jrt"], lengths=["4K", "64K", "1M"]).splitlines()
    assert lines[0] == "| m | 4K | 64K | 1M |"
    assert lines[2] == "| plain | 63.2 | — | 0.0 |" and lines[3] == "| nb-tf-top2 | — | 20.8 | — |"
    assert len(lines) == 4                       # jrt measured nowhere: no row
    with pytest.raises(KeyError, match="no backbone"):
        headline(summary, "nope")


def test_mamba2_offset_probe_scan_matches_the_model():
    """bench/mamba2_offset_probe.py's naive scan, gated and projected like the mixer does, equals
    transformers' Mamba2Mixer output at the last position (so the probe measures the real layer)."""
    import torch
    from bench import mamba2_offset_probe as probe
    from nbcore.tasks.tokenizer import build_tokenizer
    from nbcore.training.backbone import ModelConfig, build_model, fit_dt_gate, number_start_ids
    tok = build_tokenizer()
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


def test_mamba2_offset_probe_runs_on_the_shipped_model(capsys):
    from bench import mamba2_offset_probe as probe
    probe.main(["models/tiny-mamba2", "--n", "3"])
    out = capsys.readouterr().out
    assert "fitted dt gate" in out and "C.B ranks" in out and "(fitted dt):" in out


def test_copy_probe_scan_matches_the_recurrence():
    """bench/mamba2_copy_probe.py: the closed-form gated read-out equals the Mamba-2 recurrence (A = 0)."""
    import torch

    from bench.mamba2_copy_probe import gated_readout, naive_gated_readout
    g = torch.Generator().manual_seed(0)
    T, st, D = 63, 8, 5
    B, C, x = torch.randn(T, st, generator=g), torch.randn(T, st, generator=g), torch.randn(T, D, generator=g)
    dt = (torch.rand(T, generator=g) > 0.5).float()
    torch.testing.assert_close(gated_readout(B, C, dt, x), naive_gated_readout(B, C, dt, x), rtol=1e-5, atol=1e-4)


def test_copy_probe_can_succeed_with_orthogonal_codes():
    """With one-hot embeddings, identity key rows and a needle whose pieces are all distinct, the
    probe's unigram copy layer reads every next piece right (so a low score measures the codes)."""
    import torch

    from bench.mamba2_copy_probe import piece_accuracy
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
    from bench import train_curves
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
