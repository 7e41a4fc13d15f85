"""pipeline.safety: writer lease, paths that cannot escape, query output never inside an archive."""
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import fsspec
import pytest

from notebank.pipeline.safety import (LEASE_NAME, Lease, OutputBusy, UnsafePath, acquire_lease, check_no_escape,
                             check_query_output)

REPO = Path(__file__).resolve().parents[1]
INFO = {"job": "ingest", "command": "python jobs/ingest.py -c configs/ingest.yaml"}


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "out")
    else:
        url = f"memory://safety-{uuid.uuid4().hex[:8]}/out"
        yield url
        fs, p = fsspec.core.url_to_fs(url)
        if fs.exists(p):
            fs.rm(p, recursive=True)


def lease_record(root_url):
    fs, p = fsspec.core.url_to_fs(root_url)
    return json.loads(fs.cat_file(p.rstrip("/") + "/" + LEASE_NAME))


def write_record(root_url, rec):
    fs, p = fsspec.core.url_to_fs(root_url)
    fs.makedirs(p, exist_ok=True)
    fs.pipe_file(p.rstrip("/") + "/" + LEASE_NAME, json.dumps(rec).encode())


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def foreign_record(**kw):
    now = time.time()
    rec = {"run_id": str(uuid.uuid4()), "host": socket.gethostname(), "pid": os.getpid(),
           "started_at": "2026-01-01T00:00:00+00:00", "heartbeat_at": "2026-01-01T00:00:00+00:00",
           "heartbeat_unix": now, "run_info": {"command": "python jobs/ingest.py (the other run)"}}
    rec.update(kw)
    return rec


# ---- lease --------------------------------------------------------------------------------------
def test_second_lease_is_refused_and_names_the_first(root):
    first = acquire_lease(root, INFO)
    rec = lease_record(root)
    assert rec["run_id"] == first.run_id and rec["pid"] == os.getpid() and rec["host"] == socket.gethostname()
    assert rec["run_info"] == INFO and rec["started_at"] and rec["heartbeat_at"]
    uuid.UUID(rec["run_id"])
    with pytest.raises(OutputBusy) as e:
        acquire_lease(root, {"job": "ingest-2"})
    msg = str(e.value)
    for part in (f"pid {os.getpid()}", socket.gethostname(), first.run_id, rec["started_at"], INFO["command"],
                 LEASE_NAME, "delete", "Wait"):
        assert part in msg, part
    assert isinstance(e.value, RuntimeError)
    assert first.release()
    second = acquire_lease(root, {"job": "ingest-2"})        # free again after release
    assert lease_record(root)["run_id"] == second.run_id
    second.release()


def test_context_manager_releases(root):
    with acquire_lease(root, INFO) as lease:
        assert isinstance(lease, Lease) and lease.is_ours()
    fs, p = fsspec.core.url_to_fs(root)
    assert not fs.exists(p.rstrip("/") + "/" + LEASE_NAME)
    assert lease.release() is False                           # idempotent


def test_stale_by_dead_pid_is_taken_over(root, caplog):
    pid = dead_pid()
    old = foreign_record(pid=pid)
    write_record(root, old)
    with caplog.at_level(logging.WARNING, logger="notebank.pipeline.safety"):
        lease = acquire_lease(root, INFO)
    assert lease.run_id != old["run_id"] and lease_record(root)["run_id"] == lease.run_id
    assert any("stale" in r.getMessage() and f"pid {pid}" in r.getMessage() for r in caplog.records)
    lease.release()


def test_dead_pid_on_another_host_is_not_stale(root):
    write_record(root, foreign_record(pid=dead_pid(), host="some-other-host"))
    with pytest.raises(OutputBusy, match="some-other-host"):
        acquire_lease(root, INFO)


def test_stale_by_heartbeat(root, caplog):
    old = foreign_record(host="some-other-host", pid=1, heartbeat_unix=time.time() - 1000)
    write_record(root, old)
    with caplog.at_level(logging.WARNING, logger="notebank.pipeline.safety"):
        lease = acquire_lease(root, INFO, ttl_s=600)
    assert lease_record(root)["run_id"] == lease.run_id
    assert any("heartbeat" in r.getMessage() for r in caplog.records)
    lease.release()


def test_heartbeat_keeps_the_lease_live(root):
    lease = acquire_lease(root, INFO, ttl_s=0.5)
    time.sleep(0.7)
    lease.heartbeat()
    assert lease_record(root)["heartbeat_unix"] > lease_record(root)["started_unix"]
    with pytest.raises(OutputBusy):            # same process, pid alive, fresh heartbeat
        acquire_lease(root, INFO, ttl_s=0.5)
    time.sleep(0.7)                            # no heartbeat for > ttl: taken over
    other = acquire_lease(root, INFO, ttl_s=0.5)
    with pytest.raises(OutputBusy, match="lost the writer lease"):
        lease.heartbeat()
    assert lease.release() is False            # not ours any more: left alone
    assert lease_record(root)["run_id"] == other.run_id
    other.release()


def test_background_heartbeat(root):
    lease = acquire_lease(root, INFO, ttl_s=0.4)
    lease.start_heartbeat(0.05)
    time.sleep(0.8)
    with pytest.raises(OutputBusy):
        acquire_lease(root, INFO, ttl_s=0.4)
    assert lease.release()


def test_release_only_removes_own_lease(root):
    lease = acquire_lease(root, INFO)
    theirs = foreign_record(host="some-other-host")
    write_record(root, theirs)                 # someone replaced it (e.g. deleted by hand, then rerun)
    assert not lease.is_ours()
    assert lease.release() is False
    assert lease_record(root)["run_id"] == theirs["run_id"]


def test_ttl_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        acquire_lease(str(tmp_path), INFO, ttl_s=0)


HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from notebank.pipeline.safety import acquire_lease
    lease = acquire_lease({root!r}, {{"job": "holder", "command": "holder.py --sleep"}})
    print("HELD", lease.run_id, flush=True)
    time.sleep(120)
""")


def _start_holder(root_url):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=str(REPO), root=root_url)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("HELD"), line
    return proc, line.split()[1]


def test_two_processes_second_refused_then_takeover_after_sigkill(tmp_path):
    root_url = str(tmp_path / "out")
    proc, run_id = _start_holder(root_url)
    try:
        with pytest.raises(OutputBusy) as e:
            acquire_lease(root_url, INFO)
        assert f"pid {proc.pid}" in str(e.value) and run_id in str(e.value) and "holder.py --sleep" in str(e.value)
    finally:
        proc.send_signal(signal.SIGKILL)       # the driver killed hard: its lease is left behind
        proc.wait()
        proc.stdout.close()
    assert lease_record(root_url)["run_id"] == run_id
    with acquire_lease(root_url, INFO) as lease:   # the rerun on this host takes it over (dead pid)
        assert lease_record(root_url)["run_id"] == lease.run_id


def test_racing_processes_exactly_one_wins(tmp_path):
    root_url = str(tmp_path / "out")
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from notebank.pipeline.safety import acquire_lease, OutputBusy
        while time.time() < float(sys.argv[1]): pass
        try:
            acquire_lease({root_url!r}, {{}}); print("WON", flush=True); time.sleep(3)
        except OutputBusy:
            print("BUSY", flush=True)
    """)
    start = str(time.time() + 1.5)
    procs = [subprocess.Popen([sys.executable, "-c", code, start], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert sorted(outs) == ["BUSY", "BUSY", "WON"], outs


# ---- paths that cannot escape ---------------------------------------------------------------------
def test_symlinked_subfolder_is_refused(tmp_path):
    root = tmp_path / "archive"
    elsewhere = tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / "notes").symlink_to(elsewhere)
    with pytest.raises(UnsafePath) as e:
        check_no_escape(str(root), ["state/a.safetensors", "notes/a.parquet"])
    msg = str(e.value)
    assert str(root / "notes") in msg and str(elsewhere) in msg and "symlink" in msg
    with pytest.raises(UnsafePath, match="symlink"):       # any link that leaves, named in `rels` or not
        check_no_escape("file://" + str(root), ["state/a.safetensors"])
    (root / "notes").unlink()
    check_no_escape("file://" + str(root), ["state/a.safetensors", "notes/a.parquet"])


def test_dangling_and_file_symlinks_are_refused(tmp_path):
    root = tmp_path / "archive"
    (root / "state").mkdir(parents=True)
    (root / "state" / "a.safetensors").symlink_to(tmp_path / "not-there-yet.bin")
    with pytest.raises(UnsafePath, match="a.safetensors"):
        check_no_escape(str(root), ["state/a.safetensors"])


def test_symlink_inside_root_and_symlinked_root_are_fine(tmp_path):
    real = tmp_path / "real"
    (real / "data").mkdir(parents=True)
    (real / "notes").symlink_to(real / "data")          # points inside: fine
    link_root = tmp_path / "link-root"
    link_root.symlink_to(real)                           # the root itself may be a link
    check_no_escape(str(real), ["notes/a.parquet"])
    check_no_escape(str(link_root), ["notes/a.parquet", "new/dir/file"])
    (real / "up").symlink_to(tmp_path)
    with pytest.raises(UnsafePath):
        check_no_escape(str(link_root), ["up/x"])


@pytest.mark.parametrize("rel", ["../x", "notes/../../x", "/etc/passwd", "a/..", "..\\x", "C:\\x", "s3://b/x"])
@pytest.mark.parametrize("where", ["local", "memory"])
def test_dotdot_and_absolute_are_refused(rel, where, tmp_path):
    root = str(tmp_path) if where == "local" else "memory://safety/root"
    with pytest.raises(UnsafePath):
        check_no_escape(root, ["notes/ok.parquet", rel])


def test_non_local_has_only_lexical_checks():
    check_no_escape("memory://safety/root", ["notes/a.parquet", "./state/b.safetensors"])


# ---- query output vs archive ---------------------------------------------------------------------
def test_query_output_inside_archive_is_refused(tmp_path):
    arc = tmp_path / "archive"
    (arc / "manifest" / "docs").mkdir(parents=True)
    for out in [arc, arc / "manifest" / "docs" / "doc1.json", arc / "answers", str(arc) + "/"]:
        with pytest.raises(UnsafePath, match="archive") as e:
            check_query_output(str(out), str(arc))
        assert "overwrite" in str(e.value)
    check_query_output(str(tmp_path / "answers"), str(arc))
    check_query_output(str(tmp_path / "archive-answers"), str(arc))       # a name prefix is not inside
    check_query_output(str(arc / ".." / "answers"), str(arc))


def test_query_output_through_symlink_is_refused(tmp_path):
    arc = tmp_path / "archive"
    arc.mkdir()
    (tmp_path / "alias").symlink_to(arc)
    with pytest.raises(UnsafePath):
        check_query_output(str(tmp_path / "alias" / "answers.parquet"), str(arc))
    with pytest.raises(UnsafePath):
        check_query_output("file://" + str(arc / "x"), str(arc))


def test_archive_inside_output_is_refused(tmp_path):
    with pytest.raises(UnsafePath, match="inside the query output"):
        check_query_output(str(tmp_path), str(tmp_path / "archive"))
    with pytest.raises(UnsafePath, match="inside the query output"):
        check_query_output("memory://a", "memory://a/b")


def test_query_output_fsspec_urls():
    with pytest.raises(UnsafePath):
        check_query_output("memory://a/b", "memory://a")
    with pytest.raises(UnsafePath):
        check_query_output("memory://a/manifest/docs/d.json", "memory://a/")
    with pytest.raises(UnsafePath):
        check_query_output("memory://a/./x/../b", "memory://a")
    check_query_output("memory://ab", "memory://a")
    check_query_output("memory://a", "/a")                               # other filesystem


# ---- links at any depth, checked before anything is written ------------------------------------
def test_symlink_at_depth_pointing_outside_is_refused(tmp_path):
    root, outside = tmp_path / "archive", tmp_path / "elsewhere"
    (root / "manifest").mkdir(parents=True)
    outside.mkdir()
    (root / "manifest" / "commits").symlink_to(outside)
    for rels in (["manifest", "notes"], [], ["notes/a.parquet"]):     # found by the walk, named or not
        with pytest.raises(UnsafePath) as e:
            check_no_escape(str(root), rels)
        assert str(root / "manifest" / "commits") in str(e.value) and str(outside) in str(e.value)
    (root / "manifest" / "commits").unlink()
    (root / "state" / "deep" / "er").mkdir(parents=True)
    (root / "state" / "deep" / "er" / "x.safetensors").symlink_to(tmp_path / "not-there")
    with pytest.raises(UnsafePath, match="dangling"):
        check_no_escape(str(root), ["manifest"])
    (root / "state" / "deep" / "er" / "x.safetensors").unlink()
    (root / "state" / "deep" / "in").symlink_to(root / "manifest")      # points inside: fine
    check_no_escape(str(root), ["manifest", "state"])
    (root / "state" / "deep" / "up").symlink_to(root / ".." / "elsewhere")   # '..' that leaves
    with pytest.raises(UnsafePath, match="outside the output folder"):
        check_no_escape(str(root), [])


def _archive_marks(folder):
    (folder / "manifest").mkdir(parents=True)
    (folder / "manifest" / "_run.json").write_text("{}")


def test_query_output_inside_any_ingest_output_is_refused(tmp_path):
    from notebank.pipeline.safety import enclosing_archive
    read, other = tmp_path / "read", tmp_path / "other"
    _archive_marks(read)
    _archive_marks(other)
    for out in (other, other / "answers", other / "notes" / "deep" / "answers"):
        assert enclosing_archive(str(out)) == str(other)
        with pytest.raises(UnsafePath, match=f"inside the ingest output {other}"):
            check_query_output(str(out), str(read))
        with pytest.raises(UnsafePath, match="inside the ingest output"):
            check_query_output(str(out))                           # one-pass mode: no archive read
    (tmp_path / "alias").symlink_to(other)
    with pytest.raises(UnsafePath):
        check_query_output(str(tmp_path / "alias" / "answers"), str(read))
    check_query_output(str(tmp_path / "answers"), str(read))
    assert enclosing_archive(str(tmp_path / "answers")) is None
    # commit records alone (the run record lost) still mark an ingest output; so do other filesystems
    import fsspec
    fs = fsspec.filesystem("memory")
    fs.pipe("/safety-any/arc/manifest/commits/g.json", b"{}")
    with pytest.raises(UnsafePath, match="memory://"):
        check_query_output("memory://safety-any/arc/answers", "memory://safety-any/other")
    check_query_output("memory://safety-any/answers", "memory://safety-any/arc")


def _job(args, tmp_path, timeout=60):
    import os
    env = dict(os.environ, RAY_TMPDIR=str(tmp_path / "ray-tmp"))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                       env=env)
    return p, time.perf_counter() - t0


def test_output_linked_outside_at_depth_exits_2_before_ray_or_model(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"doc_id": "d0", "text": "A sentence."}\n')
    out, outside = tmp_path / "archive", tmp_path / "outside"
    (out / "manifest").mkdir(parents=True)
    outside.mkdir()
    (out / "manifest" / "commits").symlink_to(outside)
    # model.path names a checkpoint that loads only in Ray: a model load would need Ray first
    p, wall = _job(["jobs/ingest.py", "-c", "configs/ingest.yaml", "--set", f"corpus={corpus}",
                    "--set", f"output={out}"], tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert str(out / "manifest" / "commits") in p.stderr and "symlink" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr                 # one line, no traceback
    assert not (tmp_path / "ray-tmp").exists() and "Ray" not in p.stderr + p.stdout
    assert wall < 60 and list(outside.iterdir()) == [] and not (out / "_lease.json").exists()


def test_query_output_inside_unrelated_archive_exits_2_before_ray(tmp_path):
    qs = tmp_path / "q.jsonl"
    qs.write_text('{"question_id": "q0", "doc_id": "d0", "question": "?", "answers": ["x"]}\n')
    read, other = tmp_path / "read", tmp_path / "other"
    _archive_marks(read)
    _archive_marks(other)
    p, wall = _job(["jobs/query.py", "-c", "configs/query.yaml", "--set", f"questions={qs}",
                    "--set", f"archive={read}", "--set", f"output={other / 'answers'}"], tmp_path)
    assert p.returncode == 2 and f"inside the ingest output {other}" in p.stderr, p.stderr
    assert not (other / "answers").exists() and not (tmp_path / "ray-tmp").exists()
