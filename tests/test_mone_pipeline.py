"""`memory: mone` in the ingest/query jobs and the MoNe evaluation job (issue 7), on the shipped tiny
frozen Qwen2 base with its meta-trained MoNe parameters, a real local Ray, real Parquet/safetensors."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from conftest import REPO, TEST_ACTORS, write_jsonl
from nbcore.mone import state as mstate
from pipeline.config import ConfigError, IngestJobConfig, QueryJobConfig, build
from schemas.mone import MoneDocRecord

BASE = str(REPO / "models" / "tiny-qwen2")
MONE_ACTORS = {**TEST_ACTORS, "num_actors": 1}
pytestmark = pytest.mark.skipif(not (Path(BASE) / "mone" / "mone_config.json").is_file(),
                                reason="models/tiny-qwen2/mone (meta-trained MoNe) not shipped")


@pytest.fixture(scope="module")
def mone():
    """(MoNeModel, tokenizer) in the test process: the reference the pipeline must reproduce."""
    from nbcore.mone.model import MoNeModel
    from nbcore.tasks.tokenizer import load_tokenizer
    torch.set_num_threads(1)
    return MoNeModel.from_pretrained(BASE, f"{BASE}/mone").eval(), load_tokenizer(BASE)


def ruler_docs(tok, n: int, length: int = 420) -> tuple[list[dict], list[dict]]:
    from nbcore.tasks import ruler
    docs, qs = [], []
    for i in range(n):
        ex = ruler.generate("niah_single_1", length, i, tok, seed=3, split="test")
        docs.append({"doc_id": f"doc{i}", "text": ex["context"]})
        qs.append({"question_id": f"q{i}", "doc_id": f"doc{i}", "question": ex["question"],
                   "answers": list(ex["answers"])})
    return docs, qs


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def load_state(root: Path, doc: str) -> mstate.MoNeState:
    rec = MoneDocRecord.from_bytes((root / "manifest" / "docs" / f"{doc}.json").read_bytes(), doc)
    return mstate.MoNeState.from_bytes((root / rec.state.path).read_bytes(), rec.state.path)


def assert_same_state(a: mstate.MoNeState, b: mstate.MoNeState, exact: bool = False):
    assert (a.pending, a.n_segments, a.n_tokens) == (b.pending, b.n_segments, b.n_tokens)
    for (k, x), y in zip(a.tensors().items(), b.tensors().values()):
        if exact:
            assert torch.equal(x, y), k
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=k)


def job_yaml(path: Path, **cfg) -> str:
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------
# ingest + query through the jobs

def test_ingest_and_query_jobs_with_mone_memory(ray_session, mone, tmp_path, capsys):
    from jobs import ingest as ingest_job
    from jobs import query as query_job
    model, tok = mone
    docs, qs = ruler_docs(tok, 2)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs + [{"doc_id": "empty", "text": ""}])
    questions = write_jsonl(tmp_path / "questions.jsonl", qs + [
        {"question_id": "lost", "doc_id": "nowhere", "question": "Anything?"}])
    out, answers = tmp_path / "states", tmp_path / "answers.parquet"
    common = dict(memory="mone", model={"path": BASE, "device": "cpu"}, actors=MONE_ACTORS, progress=False)
    icfg = job_yaml(tmp_path / "ingest.yaml", corpus=str(corpus), output=str(out), **common)
    assert ingest_job.main(["-c", icfg]) == 0
    s = last_json(capsys.readouterr().out)
    assert (s["docs_ok"], s["docs_failed"], s["memory"]) == (2, 1, "mone"), s

    # the committed state is the state nbcore computes for the document's tokens, fixed-size
    run = json.loads((out / "manifest" / "_run.json").read_text())
    assert run["fingerprint"]["memory"] == "mone"
    for d in docs:
        ref = mstate.ingest(model, ids_of(tok, d["text"]))
        got = load_state(out, d["doc_id"])
        assert_same_state(got, ref)
        assert (out / "state" / f"{d['doc_id']}.p00001.safetensors").is_file()
    assert not (out / "notes").exists()                  # no NoteBank notes: the state is the memory
    before = {p.name: p.read_bytes() for p in (out / "state").iterdir()}

    # the query pass reads only the states: the corpus is gone
    corpus.unlink()
    qcfg = job_yaml(tmp_path / "query.yaml", questions=str(questions), archive=str(out), output=str(answers),
                    read={"max_new_tokens": 8}, **common)
    assert query_job.main(["-c", qcfg]) == 0
    s = last_json(capsys.readouterr().out)
    assert (s["questions_ok"], s["questions_failed"]) == (2, 1), s
    rows = {r["question_id"]: r for r in pq.read_table(answers).to_pylist()}
    assert rows["lost"]["status"] == "failed" and "not ingested" in rows["lost"]["error"]
    for d, q in zip(docs, qs):
        r = rows[q["question_id"]]
        assert (r["status"], r["method"]) == ("ok", "mone")
        fast = mstate.finalized(model, mstate.ingest(model, ids_of(tok, d["text"])))
        expect = model.generate(ids_of(tok, q["question"]), fast, 8, tok.eos_token_id)
        assert r["token_ids"] == expect and r["answer"] == tok.decode(expect)
        assert r["score"] is not None

    # rerun: nothing redone, bytes unchanged (deterministic files)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)
    assert ingest_job.main(["-c", icfg]) == 0
    s = last_json(capsys.readouterr().out)
    assert (s["docs_ok"], s["docs_skipped"]) == (0, 2), s
    assert {p.name: p.read_bytes() for p in (out / "state").iterdir()} == before


def test_two_part_incremental_ingest_equals_one_part(ray_session, mone, tmp_path):
    from pipeline.ingest import run_ingest
    from pipeline.mone_pipeline import start_mone_workers
    from pipeline.pool import stop_workers
    from pipeline.config import ActorSpec, ModelSpec
    model, tok = mone
    text = ruler_docs(tok, 1, length=700)[0][0]["text"]
    full = ids_of(tok, text)
    # a split at a space whose two halves tokenise to the whole's tokens, and not at a segment boundary
    T = model.cfg.segment_len
    split = next(i for i in range(len(text) // 2, len(text)) if text[i] == " "
                 and ids_of(tok, text[:i]) + ids_of(tok, text[i:]) == full and len(ids_of(tok, text[:i])) % T)
    a, b = text[:split], text[split:]
    workers = start_mone_workers(build(ModelSpec, {"path": BASE}), build(ActorSpec, MONE_ACTORS), None)
    try:
        def ingest(corpus_rows, out, **kw):
            corpus = write_jsonl(tmp_path / f"c-{len(list(tmp_path.iterdir()))}.jsonl", corpus_rows)
            cfg = build(IngestJobConfig, {"corpus": str(corpus), "output": str(out), "memory": "mone",
                                          "model": {"path": BASE}, "actors": MONE_ACTORS, "progress": False, **kw})
            return run_ingest(cfg, workers=workers)

        two, one = tmp_path / "two", tmp_path / "one"
        assert ingest([{"doc_id": "x", "text": a}], two)["docs_ok"] == 1
        s = ingest([{"doc_id": "x", "text": b}], two)
        assert s["docs_failed"] == 1 and "append: true" in s["failures"][0]["error"]   # refused without append
        s = ingest([{"doc_id": "x", "text": b}], two, append=True)
        assert (s["docs_appended"], s["docs_ok"]) == (1, 0), s
        assert ingest([{"doc_id": "x", "text": a + b}], one)["docs_ok"] == 1
        assert_same_state(load_state(two, "x"), load_state(one, "x"))
        rec = MoneDocRecord.from_bytes((two / "manifest" / "docs" / "x.json").read_bytes(), "x")
        assert [p.n_tokens for p in rec.parts] == [len(ids_of(tok, a)), len(ids_of(tok, b))]
        assert rec.n_tokens == len(full) and rec.n_segments == len(full) // T and rec.n_pending == len(full) % T
        assert sorted(p.name for p in (two / "state").iterdir()) == ["x.p00002.safetensors"]   # part 1 removed
        # appending an already-appended part again is a no-op; a failed append keeps the committed state
        assert ingest([{"doc_id": "x", "text": b}], two, append=True)["docs_skipped"] == 1
        assert ingest([{"doc_id": "x", "text": ""}], two, append=True)["docs_failed"] == 1
        assert MoneDocRecord.from_bytes((two / "manifest" / "docs" / "x.json").read_bytes(), "x").status == "ok"
        # the pipeline state equals nbcore's incremental ingest
        ref = mstate.append(model, mstate.ingest(model, ids_of(tok, a)), ids_of(tok, b))
        assert_same_state(load_state(two, "x"), ref)
    finally:
        stop_workers(workers[0])


def test_memory_choice_is_validated(tmp_path, capsys):
    from jobs import ingest as ingest_job
    from pipeline.query import run_query
    from pipeline.store import FingerprintMismatch
    base = {"corpus": "c.jsonl", "output": "o", "model": {"path": BASE}}
    with pytest.raises(ConfigError, match=r"memory must be one of \['notebank', 'mone'\], got 'bogus'"):
        build(IngestJobConfig, {**base, "memory": "bogus"}).validate()
    with pytest.raises(ConfigError, match="memory must be one of"):
        build(QueryJobConfig, {"questions": "q", "archive": "a", "output": "o", "memory": "bogus"}).validate()
    with pytest.raises(SystemExit) as e:
        ingest_job.main(["--set", "corpus=c.jsonl", "--set", "output=o", "--set", "memory=bogus"])
    assert e.value.code == 2 and "got 'bogus'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="needs model.path"):
        build(IngestJobConfig, {**base, "memory": "mone", "model": {"path": None, "hf_config": {"model_type": "qwen2"}}}).validate()
    with pytest.raises(ConfigError, match="append: true needs memory: mone"):
        build(IngestJobConfig, {**base, "append": True}).validate()
    q = build(QueryJobConfig, {"questions": "q", "archive": "a", "output": "o", "memory": "mone",
                               "model": {"path": BASE}}).validate()
    assert q.methods == ["mone"]
    with pytest.raises(ConfigError, match="answers with"):
        build(QueryJobConfig, {"questions": "q", "archive": "a", "output": "o", "memory": "mone",
                               "model": {"path": BASE}, "methods": ["notebank"]}).validate()
    # a NoteBank query against a MoNe output folder says which memory it holds
    root = tmp_path / "states"
    (root / "manifest").mkdir(parents=True)
    from schemas.manifest import run_record
    (root / "manifest" / "_run.json").write_bytes(run_record({"memory": "mone", "model": "m"}, "now"))
    write_jsonl(tmp_path / "q.jsonl", [{"question_id": "a", "doc_id": "d", "question": "?"}])
    with pytest.raises(FingerprintMismatch, match="set memory: mone"):
        run_query(build(QueryJobConfig, {"questions": str(tmp_path / "q.jsonl"), "archive": str(root),
                                         "output": str(tmp_path / "a.parquet"), "model": {"path": BASE}}))


# ------------------------------------------------------------------------------------------------
# cost accounting and the evaluation job

def test_live_tensor_peak_counts_storages():
    from nbcore.mone.cost import measure

    def f():
        x = torch.ones(256, 256)
        y = x @ x
        v = y.view(-1)          # a view: no new storage
        del x
        z = torch.ones(128, 256)  # fits in the freed x
        return v.sum() + z.sum()
    _, c = measure(f)
    assert c.peak_bytes == 2 * 256 * 256 * 4 and c.flops == 2 * 256 ** 3


def test_eval_job_end_to_end_and_resume(ray_session, tmp_path, capsys):
    from jobs import evaluate as eval_job
    out = tmp_path / "eval"
    cfg = job_yaml(tmp_path / "eval.yaml", benchmark="mone", output=str(out), model=BASE,
                   tasks=["niah_single_1", "fwe"], lengths=[256, 512], n_examples=1, rag_top_k=[1, 2],
                   rag_encoder="dense", progress=False)
    s = eval_job.main(["-c", cfg])
    assert (s["examples"], s["examples_run"], s["examples_failed"]) == (4, 4, 0), s
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {f"{m}/{t}/{L}" for m in ("mone", "icl", "rag") for t in ("s_niah", "fwe")
                            for L in (256, 512)}
    assert all(0 <= v <= 100 for v in summary.values())
    cost = json.loads((out / "cost.json").read_text())
    for t in ("s_niah", "fwe"):
        short, long = cost[f"mone/{t}/256"], cost[f"mone/{t}/512"]
        assert long["write_flops"] > short["write_flops"] > 0 and short["query_flops"] > 0
        assert short["state_bytes"] > 0 and short["write_peak_bytes"] > 0 and short["query_peak_bytes"] > 0
        assert cost[f"icl/{t}/512"]["query_flops"] > cost[f"icl/{t}/256"]["query_flops"]
        assert cost[f"icl/{t}/256"]["write_flops"] == 0 and cost[f"rag/{t}/256"]["write_flops"] > 0   # MiniLM index
    assert set(json.loads((out / "rag_by_k.json").read_text())) >= {"rag@1/s_niah/256", "rag@2/fwe/512"}
    report = (out / "report.md").read_text()
    assert "## s_niah" in report and "## RAG by K" in report and "Cost per example" in report
    for png in ("accuracy_vs_length.png", "cost_vs_length.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pq.read_table(out / "results.parquet").num_rows == 4 * (2 + 2)   # mone, icl, rag@1, rag@2

    # resume: nothing to do; one lost example is redone alone, with the same result
    s = eval_job.main(["-c", cfg])
    assert (s["examples_run"], s["examples_skipped"]) == (0, 4), s
    cell = out / "cells" / "fwe" / "256" / "0000.parquet"
    before = pq.read_table(cell).to_pylist()
    cell.unlink()
    s = eval_job.main(["-c", cfg])
    assert (s["examples_run"], s["examples_skipped"]) == (1, 3), s
    after = pq.read_table(cell).to_pylist()
    assert [(r["method"], r["rag_k"], r["pred"], r["write_flops"], r["query_flops"]) for r in after] == \
           [(r["method"], r["rag_k"], r["pred"], r["write_flops"], r["query_flops"]) for r in before]
    assert json.loads((out / "summary.json").read_text()) == summary
    capsys.readouterr()


def test_shipped_eval_config_runs_at_8x_the_meta_training_length():
    from pipeline.config import load_config
    from pipeline.evaluate_mone import MoneEvalJobConfig, parse_length
    path = REPO / "configs" / "eval_mone.yaml"
    cfg = load_config(MoneEvalJobConfig, path)
    assert cfg.benchmark == "mone" and set(cfg.methods) == {"mone", "icl", "rag"}
    assert "python jobs/evaluate.py -c configs/eval_mone.yaml" in path.read_text().split("\nbenchmark:")[0]
    meta = json.loads((Path(BASE) / "mone" / "mone_config.json").read_text())
    train_len = meta["train"]["max_segments"] * meta["mone"]["segment_len"]
    assert max(parse_length(x) for x in cfg.lengths) == 8 * train_len
    with pytest.raises(ConfigError, match="rag_encoder"):
        load_config(MoneEvalJobConfig, path, ["rag_encoder=bge"])
