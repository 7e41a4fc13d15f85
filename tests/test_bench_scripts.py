"""The benchmark scripts run (tiny sizes) and reject bad arguments; numbers live in bench/results.
(The tiny-model probes moved to lab/probes; their tests are lab/tests/test_lab_probes.py.)"""
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
    from nbcore.evals.methods import coverage
    from nbcore.notebank.route import top_r
    from nbcore.notebank.routers import RouteQuery, get_router
    from nbcore.reader import coords_for, ingest
    from nbcore.tasks import ruler
    from nbcore.backbones.loading import build_backbone
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


def test_ruler_headline_table():
    from bench.ruler_headline import headline
    summary = {"m/plain/4K": 63.25, "m/plain/1M": 0.0, "m/nb-tf-top2/64K": 20.8, "other/plain/4K": 1.0}
    lines = headline(summary, "m", methods=["plain", "nb-tf-top2", "jrt"], lengths=["4K", "64K", "1M"]).splitlines()
    assert lines[0] == "| m | 4K | 64K | 1M |"
    assert lines[2] == "| plain | 63.2 | — | 0.0 |" and lines[3] == "| nb-tf-top2 | — | 20.8 | — |"
    assert len(lines) == 4                       # jrt measured nowhere: no row
    with pytest.raises(KeyError, match="no backbone"):
        headline(summary, "nope")


def test_gpu_lease_script_cpu_smoke(tmp_path):
    """The one script a GPU lease runs, in its CPU form: every stage runs without error, the
    replay invariants hold and the device-vs-CPU archive check compares real archives."""
    from bench.gpu import lease
    out = tmp_path / "lease.json"
    doc = lease.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["stages"].keys() == doc["stages"].keys() == {"checks", "overhead_tiny"}
    assert not [k for k, v in doc["stages"].items() if "error" in v or "skipped" in v]
    checks = doc["stages"]["checks"]["checks"]
    inv = checks["tiny_invariants_cpu"]
    assert "error" not in inv, inv
    assert inv["copy_leaves_original_bit_identical"] and inv["copy_advanced"]
    assert inv["chunked_vs_full_last_logits_max_abs"] < 1e-4
    assert inv["archive_block2048_vs_block256"]["spans_equal"] and inv["archive_rerun_determinism"]["addr_bit_identical"]
    dev = checks["tiny_gdn_cpu_vs_cpu"]
    assert "error" not in dev, dev
    assert dev["n"] == 1 and dev["spans_equal"] == 1 and dev["nb_same"] == 1
    assert doc["stages"]["overhead_tiny"]["lengths"]["1K"]["ratio"] > 0


def test_gpu_lease_skips_what_does_not_fit():
    from bench.gpu import lease
    doc = lease.main(["--smoke", "--skip-checks", "--budget-s", "-1"])
    assert "skipped" in doc["stages"]["overhead_tiny"]


def test_overhead_times_text_with_sentences(tmp_path):
    """The CPU cost benchmark reads TEXT (tokenised inside the timing, with sentence ids for
    NoteBank), reports stage medians, and the archive's bytes equal Eq. 19 for its counts."""
    from pathlib import Path
    out = tmp_path / "ov.json"
    model = str(Path(__file__).resolve().parents[1] / "models" / "tiny-gdn")
    # --allocator default: mallopt would change this test process's allocator for the rest of the suite
    doc = overhead.main(["--model", model, "--lengths", "1K", "--reps", "1", "--gen", "2", "--allocator", "default",
                         "--out", str(out)])
    assert doc["input"] == "text" and json.loads(out.read_text())["partial"] is False
    assert doc["allocator"] in ("glibc default", "MALLOC_* environment (malloc_env)")
    row = doc["lengths"]["1K"]
    nb = row["stages_median_s"]["notebank"]
    # the ratio is taken before rounding: compare with the 0.1-ms stage medians, not the ms totals
    assert row["ratio"] == pytest.approx(nb["total_s"] / row["stages_median_s"]["plain"]["total_s"], rel=5e-3)
    assert row["ratio_ci95"][0] <= row["ratio"] <= row["ratio_ci95"][1]      # one rep: the interval is the ratio
    assert nb["write_s"] > 0 and row["stages_median_s"]["plain"]["write_s"] == 0
    a = row["archive"]
    # more notes than one per chunk: real sentences, not one document-long sentence (W=2)
    assert a["notes"] > 1 and a["bytes_measured"] == a["bytes_eq19"] > 0
    with pytest.raises(SystemExit):
        overhead.main(["--model", str(tmp_path), "--lengths", "1K"])
    with pytest.raises(ValueError):
        overhead.parse_len("12Q")


def test_overhead_interleaved_mode_times_each_method_on_its_own_steps(tmp_path):
    """--interleave block: the two runs stepped block by block give what separate runs give (same
    archive, same answers), and each method's total is the sum of its own stages, not the pair's."""
    from pathlib import Path
    from nbcore import NoteBankConfig, load_backbone
    bb = load_backbone(str(Path(__file__).resolve().parents[1] / "models" / "tiny-gdn"))
    cfg = NoteBankConfig()
    text, question = overhead.make_text_input(bb, 3000)
    alone = {m: overhead.run_text(bb, text, question, m, cfg, 3, 1024) for m in overhead.METHODS}
    for first in (0, 1):
        pair = overhead.run_interleaved(bb, text, question, cfg, 3, 1024, first=first)
        for m in overhead.METHODS:
            got, want = pair[m], alone[m]
            for k in ("n_tokens", "n_notes", "archived_tokens", "archive_bytes", "answer"):
                assert got[k] == want[k], (m, k)
            parts = got["tokenize_s"] + got["prefill_s"] + got["write_s"] + got["probe_s"] + got["route_s"] \
                + got["replay_generate_s"]
            assert parts <= got["total_s"] <= parts + 0.5 * got["total_s"], (m, parts, got["total_s"])
    assert pair["notebank"]["n_notes"] > 1 and pair["plain"]["n_notes"] == 0 and pair["plain"]["write_s"] == 0
    with pytest.raises(ValueError, match="interleave"):
        overhead.bench(bb, ["1K"], cfg, interleave="steps")


def test_capture_kernel_bench_checks_and_times_both_paths():
    """bench/capture_kernel.py: outputs checked against the torch reference, then both paths timed."""
    from bench import capture_kernel
    from nbcore.kernels import native
    if not native.available():
        pytest.skip("no C compiler here")
    row = capture_kernel.bench_shape(H=3, D=20, dr=7, C=128, segment=256, reps=1, inner=1)
    assert row["native_us_per_segment"] > 0 and row["torch_us_per_segment"] > 0 and row["speedup"] > 0
    situ = capture_kernel.bench_in_situ(H=2, D=16, dr=8, C=128, T=300, pairs=3)
    assert situ["layer_call_ms"] > 0 and situ["pairs"] == 3 and {"native_extra_ms", "torch_extra_ms"} <= set(situ)


def test_mone_digits_counts_digits_in_place(tmp_path):
    """bench/mone_digits.py: exact answers, first digit and digits in place per (task, length) from a
    MoNe run's cells; a short or non-digit answer counts its missing digits as wrong."""
    import pandas as pd

    from bench import mone_digits
    assert mone_digits.digits_in_place("3546655.", "3546465") == [True] * 4 + [False, False, True]
    assert mone_digits.digits_in_place("no", "12") == [False, False]
    assert mone_digits.near_miss(" 4642619.", "4642691") == "swap"
    assert mone_digits.near_miss("4642699", "4642691") == "one_digit"
    assert mone_digits.near_miss("4642916", "4642691") == "other"     # a rotation, not one swap
    assert mone_digits.near_miss("46426", "4642691") == "other"
    assert mone_digits.near_miss("4642691.", "4642691") == "exact"
    cell = tmp_path / "cells" / "mone" / "niah_single_1" / "1024"
    cell.mkdir(parents=True)
    pd.DataFrame({"pred": ["1234567.", "1234000", "9", "1234576"], "answers": [["1234567"]] * 4,
                  "score": [100.0, 0.0, 0.0, 0.0]}).to_parquet(cell / "0000.parquet")
    res = mone_digits.summarize(tmp_path)["niah_single_1/1024"]
    assert res["n"] == 4 and res["exact"] == 1 and res["first_digit"] == 3
    assert res["digits_in_place"] == round((7 + 4 + 0 + 5) / 28, 3) and res["by_position"][0] == 0.75
    assert res["swap"] == 1 and res["one_digit"] == 0
    with pytest.raises(SystemExit):
        mone_digits.summarize(tmp_path / "nothing")
