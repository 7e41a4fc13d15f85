"""A store that fails under a job: disk full (ENOSPC), permission denied (EACCES) and a vanished
output folder give one line naming the path and what to do, then the JSON summary with what the store
holds, and exit 1. The errors are injected at fsspec's LocalFileSystem._open inside the job process
(the tests run as root, so chmod would deny nothing); the job runs in this process on the shared Ray."""
from __future__ import annotations

import errno
import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem

from conftest import TEST_ACTORS, TINY_MODEL, TINY_NB, write_jsonl
from notebank.pipeline.cli import store_failure
from notebank.pipeline.config import IngestJobConfig, QueryJobConfig, build
from notebank.pipeline.ingest import run_ingest


def _args(d: dict) -> list[str]:
    return [a for k, v in d.items() for a in ("--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}")]


def ingest_args(corpus, out) -> list[str]:
    return _args({"corpus": str(corpus), "output": str(out), "model": TINY_MODEL, "notebank": TINY_NB,
                  "actors": TEST_ACTORS, "progress": False, "block_size": 512, "docs_per_group": 1})


def inject(monkeypatch, when, err):
    """Make LocalFileSystem._open raise `err(path)` for paths where when(path, mode) holds."""
    real = LocalFileSystem._open

    def _open(self, path, mode="rb", *a, **kw):
        if when(str(path), mode):
            e = err(str(path))
            if e is not None:
                raise e
        return real(self, path, mode, *a, **kw)
    monkeypatch.setattr(LocalFileSystem, "_open", _open)


def run_main(job: str, args: list[str], capsys):
    import importlib
    mod = importlib.import_module(f"jobs.{job}")
    rc = mod.main([*args, "--json"])      # the summary as one JSON line (a table otherwise)
    cap = capsys.readouterr()
    summary = json.loads(cap.out.strip().splitlines()[-1])
    errors = [l for l in cap.err.splitlines() if l.startswith("error:")]
    return rc, summary, errors, cap.err


@pytest.fixture(scope="module")
def archived(ray_session, tmp_path_factory):
    """An output with 2 committed groups (one document each), and its corpus."""
    root = tmp_path_factory.mktemp("store")
    write_jsonl(root / "corpus" / "a.jsonl", [{"doc_id": f"d{i}", "text": f"Document {i}. " * 40} for i in range(2)])
    cfg = build(IngestJobConfig, {"corpus": str(root / "corpus"), "output": str(root / "out"), "model": TINY_MODEL,
                                  "notebank": TINY_NB, "actors": TEST_ACTORS, "progress": False, "block_size": 512,
                                  "docs_per_group": 1})
    assert run_ingest(cfg)["docs_ok"] == 2
    return root


def _copy(archived, tmp_path):
    shutil.copytree(archived / "out", tmp_path / "out")
    shutil.copytree(archived / "corpus", tmp_path / "corpus")
    return tmp_path / "corpus", tmp_path / "out"


def test_disk_full_is_one_line_and_a_summary_of_what_is_committed(archived, tmp_path, capsys, monkeypatch):
    corpus, out = _copy(archived, tmp_path)
    # a truncated shard makes the driver write its record (manifest/shards/): the disk is full by then
    pq.write_table(pa.table({"doc_id": ["x"] * 40, "text": ["y " * 50] * 40}), corpus / "b.parquet", row_group_size=4)
    raw = (corpus / "b.parquet").read_bytes()
    (corpus / "b.parquet").write_bytes(raw[: len(raw) // 2])
    inject(monkeypatch, lambda p, m: "manifest/shards" in p and "w" in m,
           lambda p: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), p))
    rc, s, errors, err = run_main("ingest", ingest_args(corpus, out), capsys)
    assert rc == 1, err
    assert len(errors) == 1 and "no space left" in errors[0] and "manifest/shards" in errors[0], err
    assert "free space" in errors[0] and "Traceback" not in err
    assert (s["status"], s["committed_groups"], s["committed_docs"]) == ("failed", 2, 2), s
    assert not (out / "_lease.json").exists()                       # released: a rerun can start at once


def test_permission_denied_names_the_path(archived, tmp_path, capsys, monkeypatch):
    corpus, out = _copy(archived, tmp_path)
    inject(monkeypatch, lambda p, m: "/manifest/commits/" in p and "r" in m,
           lambda p: PermissionError(errno.EACCES, os.strerror(errno.EACCES), p))
    rc, s, errors, err = run_main("ingest", ingest_args(corpus, out), capsys)
    assert rc == 1 and len(errors) == 1 and "permission denied on" in errors[0], err
    assert str(out / "manifest" / "commits") in errors[0] and "access to" in errors[0]
    # the commit records stay unreadable, so the summary says what it could not read instead of counts
    assert s["status"] == "failed" and "committed_groups" not in s and "Permission" in s["committed_error"], s


def test_vanished_output_is_one_line_and_exit_1(archived, tmp_path, capsys, monkeypatch):
    corpus, out = _copy(archived, tmp_path)

    def vanish(p):
        shutil.rmtree(out, ignore_errors=True)         # the real thing: the folder goes, the open then fails
        return None
    inject(monkeypatch, lambda p, m: "/manifest/commits/" in p and "r" in m, vanish)
    rc, s, errors, err = run_main("ingest", ingest_args(corpus, out), capsys)
    assert rc == 1 and len(errors) == 1 and f"the store {out} vanished" in errors[0], err
    assert "mounted" in errors[0] and (s["committed_groups"], s["committed_docs"]) == (0, 0), s


def test_query_permission_denied_on_its_output(archived, tmp_path, capsys, monkeypatch):
    qs = tmp_path / "q.jsonl"
    write_jsonl(qs, [{"question_id": "q0", "doc_id": "d0", "question": "?"},
                     {"question_id": "q1", "doc_id": "gone", "question": "?"}])    # a rejected row: the driver writes
    out = tmp_path / "answers"
    inject(monkeypatch, lambda p, m: "part-rejected" in p and "w" in m,
           lambda p: PermissionError(errno.EACCES, os.strerror(errno.EACCES), p))
    args = _args({"questions": str(qs), "archive": str(archived / "out"), "output": str(out), "model": TINY_MODEL,
                  "actors": TEST_ACTORS, "progress": False, "methods": ["plain"], "read": {"max_new_tokens": 2}})
    rc, s, errors, err = run_main("query", args, capsys)
    assert rc == 1 and len(errors) == 1 and "permission denied on" in errors[0] and str(out) in errors[0], err
    assert (s["committed_parts"], s["committed_rows"]) == (0, 0), s


def test_errors_from_ray_workers_are_recognised_by_their_traceback():
    """Ray Data re-raises an actor's error with the worker's traceback as text: the errno and path in
    it are enough (the exception objects of the chain do not survive pickling)."""
    cfg = build(QueryJobConfig, {"questions": "q", "archive": "/data/arc", "output": "/data/ans"})
    worker = ("ray.exceptions.RayTaskError(UserCodeException): ray::MapWorker() (pid=1)\n  File \"x.py\", line 3\n"
              "OSError: [Errno 28] No space left on device: '/data/ans/part-1.parquet.tmp-ab'\n\nThe above ...\n")
    assert "no space left writing /data/ans/part-1.parquet.tmp-ab" in store_failure(RuntimeError(worker), cfg)
    denied = "PermissionError: [Errno 13] Permission denied: '/data/arc/state/x.safetensors'"
    assert "permission denied on /data/arc/state" in store_failure(RuntimeError(denied), cfg)
    assert store_failure(FileNotFoundError(errno.ENOENT, "nope", "/elsewhere/corpus.jsonl"), cfg) is None
    assert store_failure(ValueError("a bug"), cfg) is None


@pytest.mark.slow
def test_disk_full_in_the_ingest_actors_is_one_line_and_exit_1(tmp_path):
    """The disk fills while the actors write states (their own processes, of the job's own local Ray):
    the driver still ends with one line naming the state file, the summary, exit 1, and a rerun with
    space again completes the archive."""
    import subprocess
    import sys
    import textwrap
    from conftest import REPO
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent('''
        import errno, os
        if os.environ.get("NB_TEST_ENOSPC"):
            from fsspec.implementations.local import LocalFileSystem
            _real = LocalFileSystem._open
            def _open(self, path, mode="rb", *a, **kw):
                if "w" in mode and os.environ["NB_TEST_ENOSPC"] in str(path):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                return _real(self, path, mode, *a, **kw)
            LocalFileSystem._open = _open
    '''))
    write_jsonl(tmp_path / "corpus.jsonl", [{"doc_id": f"d{i}", "text": f"Document {i}. " * 40} for i in range(2)])
    out = tmp_path / "out"
    args = ingest_args(tmp_path / "corpus.jsonl", out) + ["--set", "actors.num_actors=1", "--set", "ray.num_cpus=2"]
    import tempfile
    ray_tmp = tempfile.mkdtemp(prefix="nbsf-", dir="/tmp")      # short: Ray's socket paths must fit 107 bytes
    env = dict(os.environ, PYTHONPATH=f"{hook}{os.pathsep}{REPO}", NB_TEST_ENOSPC="/state/d1.", RAY_TMPDIR=ray_tmp)
    p = subprocess.run([sys.executable, "jobs/ingest.py", *args, "--json"], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env=env)
    errors = [l for l in p.stderr.splitlines() if l.startswith("error:")]
    assert p.returncode == 1, p.stderr[-3000:]
    assert len(errors) == 1 and "no space left writing" in errors[0] and "/state/d1." in errors[0], p.stderr[-3000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["status"] == "failed" and s["committed_docs"] == s["committed_groups"] <= 1, s
    del env["NB_TEST_ENOSPC"]
    p = subprocess.run([sys.executable, "jobs/ingest.py", *args, "--json"], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    s2 = json.loads(p.stdout.strip().splitlines()[-1])
    assert s2["docs_ok"] + s2["docs_skipped"] == 2 and s2["docs_ok"] >= 1, s2
    shutil.rmtree(ray_tmp, ignore_errors=True)
