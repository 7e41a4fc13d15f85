"""bench/dataplane.py --quick runs end to end (its own local Ray, in a subprocess) and writes every key."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, TINY_MODEL, TINY_NB


def test_bench_dataplane_uses_the_test_model():
    from bench import dataplane
    assert dataplane.TINY_MODEL == TINY_MODEL and dataplane.TINY_NB == TINY_NB
    assert dataplane.tiny_model(64) == TINY_MODEL
    big = dataplane.tiny_model(256)["hf_config"]
    assert big["hidden_size"] == 256 and big["linear_key_head_dim"] == 64


def test_bench_dataplane_quick(tmp_path):
    out = tmp_path / "dp.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "dataplane.py"), "--quick", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    r = json.loads(out.read_text())
    for k in ("driver_rss_growth_mib", "driver_bytes_per_doc", "actors_2_vs_1", "files_per_1000_docs",
              "n_docs", "command", "date", "machine"):
        assert k in r, k
    assert "--quick" in r["command"] and r["machine"]["nproc"] >= 1 and r["machine"]["cpu_model"]
    db = r["driver_bytes_per_doc"]
    assert all(v > 0 for k, v in db["new"].items() if isinstance(v, float)), db
    # the driver gets O(record) bytes per document: a several times larger state leaves them nearly unchanged
    st = db["state_bytes_per_doc"]
    assert st["hidden 256"] > 4 * st["hidden 64"] and db["new_large_over_small"] < 1.5, db
    assert db["new"]["hidden 64"] < st["hidden 64"]
    rss = r["driver_rss_growth_mib"]
    assert rss["rss_3"] > 0 and rss["rss_12"] > 0 and rss["n_docs"] == [3, 12]
    side = r["actors_2_vs_1"]["new"]
    assert side["e2e_1"] > 0 and side["e2e_2"] > 0
    assert r["files_per_1000_docs"]["new"] > 0
    md = (tmp_path / "dp.md").read_text()
    assert md.startswith("# Ingest data plane") and "## History: the pre-Ray-Data driver" in md
