"""Every job checks its config, paths and field names before torch loads or Ray starts: a typo exits 2
with one line naming the key, and writes nothing. (The bars say 2-5 s; on a shared 2-core box the
time limit here is loose so the test does not flake; the check that torch is not imported is the
exact form of "before any model loads".)"""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIMIT_S = 60


def _run(tmp_path, *args):
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    return p, time.perf_counter() - t0


CASES = [
    (["jobs/run_demo.py", "--set", "read.router=natve"], "unknown router 'natve' (did you mean 'native'?)"),
    (["jobs/train_lora.py", "-c", "configs/train_lora.yaml", "--set", "data=/nope.jsonl"],
     "data: QA rows file '/nope.jsonl' does not exist"),
    (["jobs/ingest.py", "-c", "configs/ingest.yaml", "--set", "chunk_sise=1"], "unknown key(s) ['chunk_sise']"),
    (["jobs/run_demo.py", "--set", "model.path=/tmp/nope-notebank"],
     "model.path: no checkpoint directory '/tmp/nope-notebank'"),
    (["jobs/query.py", "-c", "configs/query.yaml", "--set", "read.preset=papr"], "read.preset must be one of"),
]


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(c[0][:1] + c[0][-1:]) for c in CASES])
def test_typo_exits_2_with_one_line_and_writes_nothing(tmp_path, args, message):
    args = [str(REPO / a) if a.endswith((".py", ".yaml")) else a for a in args]
    p, wall = _run(tmp_path, *args)
    assert p.returncode == 2, p.stderr[-2000:]
    assert message in p.stderr
    assert p.stderr.strip().count("\n") == 0, p.stderr            # one line, no traceback
    assert list(tmp_path.iterdir()) == []                         # nothing written
    assert wall < LIMIT_S


def test_corpus_with_other_field_names_is_refused_up_front(tmp_path):
    corpus = tmp_path / "in" / "corpus.jsonl"
    corpus.parent.mkdir()
    corpus.write_text(json.dumps({"id": "a", "content": "some text"}) + "\n")
    out = tmp_path / "out"
    p, _ = _run(tmp_path, str(REPO / "jobs/ingest.py"), "-c", str(REPO / "configs/ingest.yaml"),
                "--set", f"corpus={corpus}", "--set", f"output={out}", "--set", f"model.path={REPO}/models/tiny-gdn")
    assert p.returncode == 2, p.stderr[-2000:]
    assert "rows need the fields ['doc_id', 'text']" in p.stderr and "['id', 'content']" in p.stderr
    assert not out.exists()


@pytest.mark.parametrize("module,attr", [("notebank.pipeline.ingest", "IngestJobConfig"),
                                         ("notebank.pipeline.query", "QueryJobConfig"),
                                         ("notebank.pipeline.demo", "DemoConfig"),
                                         ("notebank.pipeline.train_lora", "TrainLoraJobConfig")])
def test_job_configs_load_without_torch(module, attr):
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import {module} as m; m.{attr}; "
            "bad = [x for x in ('torch', 'ray', 'transformers') if x in sys.modules]; "
            "assert not bad, bad")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_report_only_refuses_to_rewrite_committed_results(tmp_path):
    out = REPO / "bench/results/ruler"
    if not (out / "report.md").exists():
        pytest.skip("no committed RULER results")
    before = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    p, _ = _run(tmp_path, str(REPO / "jobs/evaluate.py"), "-c", str(REPO / "configs/eval_ruler.yaml"),
                "--report-only", "--set", f"output={out}")
    assert p.returncode == 2, p.stderr[-2000:]
    assert "committed files" in p.stderr and "--force" in p.stderr
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == before
