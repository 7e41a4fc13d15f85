"""Guards for the output folders: one writer at a time, no paths that escape, no query output inside
an archive. Pure Python + fsspec (no Ray): usable from drivers, workers and tests alike.

Writer lease (`acquire_lease`)
    `<root>/_lease.json` names the run that writes into `<root>`: run id (uuid4), host, pid, start
    and heartbeat times and the caller's `run_info` (job name, command line, ...). A second writer is
    refused with `OutputBusy` naming the holder. A lease is *stale*, and taken over with a logged
    warning, when
      - it was written on this host and its pid is gone (`os.kill(pid, 0)` -> ProcessLookupError),
        or the pid now belongs to another process (Linux: the recorded process start time differs);
        this is what makes "kill -9 the driver, rerun it" work on one machine, or
      - its heartbeat is older than `ttl_s` (a crashed run on another host). Long runs must call
        `Lease.heartbeat()` more often than that, or `Lease.start_heartbeat()`.
    Atomicity: on a local (or NFS/shared POSIX) filesystem the record is created with
    `os.open(O_CREAT | O_EXCL)`, so of two racing writers exactly one wins; a stale lease is moved
    aside with an atomic rename and checked to be the one judged stale before it is deleted. On other
    fsspec filesystems it is created with `pipe_file(mode="create")` and then read back to check that
    we own it. That is atomic only where the backend implements conditional writes (e.g. an object
    store with If-None-Match); object stores without conditional writes only get best-effort
    protection: two writers starting within the same second or so can both believe they hold the
    lease (one of them notices at its next `heartbeat()`/`check()`, which raise OutputBusy).

Paths (`check_no_escape`, `check_query_output`) raise `UnsafePath` (a ValueError) with a message
naming the offending link or folder. They are checks made before writing, not a sandbox: a symlink
created after the check is not seen.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import ntpath
import os
import posixpath
import socket
import threading
import time
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger(__name__)

LEASE_NAME = "_lease.json"
LEASE_VERSION = 1


class OutputBusy(RuntimeError):
    """Another live run holds the writer lease of the output folder (or ours was taken over)."""


class UnsafePath(ValueError):
    """A path would make a write land outside its folder, or on top of an archive."""


# ---- helpers ------------------------------------------------------------------------------------
def _utc(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).isoformat(timespec="seconds")


def _is_local(fs) -> bool:
    return isinstance(fs, LocalFileSystem)


def _protocol(fs) -> str:
    p = fs.protocol
    return p[0] if isinstance(p, (tuple, list)) else p


def _proc_start(pid: int) -> str | None:
    """Start time of a process (Linux /proc, clock ticks since boot) to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return stat.rsplit(")", 1)[1].split()[19]          # field 22 (starttime)
    except (OSError, IndexError):
        return None


def _pid_state(pid) -> str:
    """'alive', 'dead' or 'unknown' for a pid on THIS host."""
    if not isinstance(pid, int) or pid <= 0:
        return "unknown"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "dead"
    except PermissionError:          # exists, owned by someone else
        return "alive"
    except OSError:
        return "unknown"
    return "alive"


def _describe(rec: dict) -> str:
    info = rec.get("run_info") or {}
    cmd = info.get("command") or info.get("cmd") or info.get("argv")
    if isinstance(cmd, (list, tuple)):
        cmd = " ".join(map(str, cmd))
    job = info.get("job") or info.get("job_name") or info.get("name")
    hb = rec.get("heartbeat_unix")
    age = f" ({time.time() - hb:.0f} s ago)" if isinstance(hb, (int, float)) else ""
    parts = [f"run {rec.get('run_id', '?')}", f"host {rec.get('host', '?')}", f"pid {rec.get('pid', '?')}",
             f"started {rec.get('started_at', '?')}", f"last heartbeat {rec.get('heartbeat_at', '?')}{age}"]
    if job:
        parts.append(f"job {job}")
    parts.append(f"command: {cmd}" if cmd else f"run info: {json.dumps(info, sort_keys=True, default=str)}")
    return ", ".join(parts)


# ---- the lease ------------------------------------------------------------------------------------
class Lease:
    """The writer lease of one output folder, held by this process. Use as a context manager, or call
    `release()`; call `heartbeat()` (or `start_heartbeat()`) more often than `ttl_s`."""

    def __init__(self, root_url: str, fs, path: str, record: dict, ttl_s: float):
        self.root_url = root_url
        self.fs = fs
        self.path = path
        self.url = fs.unstrip_protocol(path) if not _is_local(fs) else path
        self.record = record
        self.ttl_s = float(ttl_s)
        self.released = False
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    @property
    def run_id(self) -> str:
        return self.record["run_id"]

    def __repr__(self) -> str:
        return f"Lease({self.url!r}, run_id={self.run_id!r}, released={self.released})"

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- ownership ----------------------------------------------------------------------------
    def current(self) -> dict | None:
        """The record now on disk (None if absent; {} if unreadable)."""
        return _read_record(self.fs, self.path)

    def is_ours(self) -> bool:
        cur = self.current()
        return bool(cur) and cur.get("run_id") == self.run_id

    def check(self) -> None:
        """Raise OutputBusy unless the lease on disk is still this one."""
        if self.released:
            raise OutputBusy(f"{self.url}: this lease (run {self.run_id}) was released")
        cur = self.current()
        if not cur or cur.get("run_id") != self.run_id:
            who = _describe(cur) if cur else "nobody (the lease file is gone)"
            raise OutputBusy(f"lost the writer lease of {self.root_url} ({self.url}): it is now held by {who}. "
                             "Another run took it over (our heartbeat was older than its ttl, or the file was "
                             "deleted); stop writing here.")

    def heartbeat(self) -> None:
        """Refresh heartbeat_at (atomic rewrite). Raises OutputBusy if the lease is no longer ours."""
        with self._lock:
            self.check()
            now = time.time()
            rec = dict(self.record, heartbeat_at=_utc(now), heartbeat_unix=now)
            data = json.dumps(rec, indent=1, sort_keys=True).encode()
            if _is_local(self.fs):
                # `.tmp-` like the store's temporaries, so Archive.clean_tmp removes an orphan;
                # if clean_tmp removes ours before the rename, write it again.
                for attempt in range(3):
                    tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:12]}"
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    try:
                        os.replace(tmp, self.path)
                        break
                    except FileNotFoundError:
                        if attempt == 2:
                            raise
            else:
                self.fs.pipe_file(self.path, data)       # one PUT: readers see old or new, never half
            self.record = rec

    def start_heartbeat(self, interval_s: float | None = None) -> None:
        """Heartbeat from a daemon thread every `interval_s` (default ttl_s / 4) until release()."""
        if self._thread is not None:
            return
        interval = float(interval_s) if interval_s else max(self.ttl_s / 4.0, 0.05)
        self._stop = threading.Event()

        def loop():
            while not self._stop.wait(interval):
                try:
                    self.heartbeat()
                except OutputBusy as e:
                    log.error("%s", e)
                    return
                except Exception as e:  # transient I/O: try again next time
                    log.warning("lease heartbeat on %s failed: %s: %s", self.url, type(e).__name__, e)

        self._thread = threading.Thread(target=loop, name=f"lease-heartbeat-{self.run_id[:8]}", daemon=True)
        self._thread.start()

    def release(self) -> bool:
        """Delete the lease file if it is still ours. Returns whether it was removed. Idempotent."""
        if self._stop is not None:
            self._stop.set()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=10)
        with self._lock:
            if self.released:
                return False
            self.released = True
            cur = self.current()
            if not cur or cur.get("run_id") != self.run_id:
                log.warning("not removing %s: it is no longer ours (held by %s)", self.url,
                            _describe(cur) if cur else "nobody")
                return False
            try:
                self.fs.rm_file(self.path)
            except FileNotFoundError:
                return False
            return True


def _read_record(fs, path: str, retries: int = 5) -> dict | None:
    """None if absent, {} if present but unreadable (e.g. still being written), else the record."""
    for i in range(retries):
        try:
            data = fs.cat_file(path)
        except FileNotFoundError:
            return None
        try:
            rec = json.loads(data)
            if isinstance(rec, dict) and rec.get("run_id"):
                return rec
        except ValueError:
            pass
        if i + 1 < retries:
            time.sleep(0.1)      # an O_EXCL create is visible before its bytes are
    return {}


def _create_excl_local(path: str, data: bytes) -> bool:
    """Create `path` with `data` iff it does not exist (atomic on POSIX filesystems)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _create_best_effort(fs, path: str, data: bytes, run_id: str) -> bool:
    """Create-if-absent on a non-local fsspec filesystem, then read back to check we own it."""
    try:
        fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        return False
    except TypeError:                      # backend without `mode=`: check, then write
        if fs.exists(path):
            return False
        fs.pipe_file(path, data)
    except OSError as e:                   # some backends report a failed precondition this way
        if fs.exists(path):
            return False
        raise e
    time.sleep(0.05)                       # let a racing writer's PUT land before we read back
    rec = _read_record(fs, path, retries=1)
    return bool(rec) and rec.get("run_id") == run_id


def _stale_reason(rec: dict, fs, path: str, ttl_s: float) -> str | None:
    """Why a lease record is stale (None: it is live)."""
    now = time.time()
    if not rec:      # unreadable: judge by the file's age
        try:
            mtime = fs.modified(path).timestamp()
        except Exception:
            return None
        return f"unreadable lease file not modified for {now - mtime:.0f} s (> ttl {ttl_s:.0f} s)" \
            if now - mtime > ttl_s else None
    if rec.get("host") == socket.gethostname():
        state = _pid_state(rec.get("pid"))
        if state == "dead":
            return f"its process (pid {rec.get('pid')} on this host) is gone"
        if state == "alive" and rec.get("pid_start") and _proc_start(rec["pid"]) not in (None, rec["pid_start"]):
            return f"its pid {rec.get('pid')} now belongs to another process (the run is gone)"
    hb = rec.get("heartbeat_unix")
    if isinstance(hb, (int, float)) and now - hb > ttl_s:
        return f"its last heartbeat is {now - hb:.0f} s old (> ttl {ttl_s:.0f} s)"
    return None


def _remove_stale_local(path: str, stale: dict) -> None:
    """Move the stale lease aside atomically and delete it, unless another run replaced it meanwhile
    (then put that one back)."""
    grave = f"{path}.stale-{uuid.uuid4().hex[:12]}"
    try:
        os.rename(path, grave)
    except FileNotFoundError:
        return                                    # someone else removed it: just retry
    with open(grave, "rb") as f:
        data = f.read()
    try:
        moved = json.loads(data)
    except ValueError:
        moved = {}
    if (moved.get("run_id") if isinstance(moved, dict) else None) == (stale.get("run_id") if stale else None):
        os.remove(grave)
        return
    # A newer lease appeared between our read and our rename: restore it (never overwrite a third).
    if not _create_excl_local(path, data):
        log.error("lease race on %s: could not restore the lease of %s (another run created one)", path,
                  _describe(moved) if moved else "?")
    os.remove(grave)


def acquire_lease(root_url: str, run_info: dict, ttl_s: float = 600.0) -> Lease:
    """Take the writer lease of `root_url` (creating the folder if needed) -> Lease.

    Raises OutputBusy (naming the other run and how to proceed) if a live run holds it; takes over
    (with a warning) a stale one: same host and dead pid, or a heartbeat older than `ttl_s`."""
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    fs, root = fsspec.core.url_to_fs(root_url.rstrip("/") or root_url)
    root = root.rstrip("/") or "/"
    local = _is_local(fs)
    fs.makedirs(root, exist_ok=True)
    path = posixpath.join(root, LEASE_NAME) if not local else os.path.join(root, LEASE_NAME)
    shown = path if local else fs.unstrip_protocol(path)

    for _ in range(20):
        now = time.time()
        pid = os.getpid()
        rec = {"version": LEASE_VERSION, "run_id": str(uuid.uuid4()),
               "host": socket.gethostname(), "pid": pid, "pid_start": _proc_start(pid),
               "started_at": _utc(now), "started_unix": now, "heartbeat_at": _utc(now), "heartbeat_unix": now,
               "ttl_s": float(ttl_s), "root": root_url, "run_info": dict(run_info or {})}
        data = json.dumps(rec, indent=1, sort_keys=True, default=str).encode()
        won = _create_excl_local(path, data) if local else _create_best_effort(fs, path, data, rec["run_id"])
        if won:
            return Lease(root_url, fs, path, rec, ttl_s)
        cur = _read_record(fs, path)
        if cur is None:
            continue                               # released meanwhile: try again
        reason = _stale_reason(cur, fs, path, ttl_s)
        if reason is None:
            what = _describe(cur) if cur else "an unreadable lease record (being written, or corrupt)"
            raise OutputBusy(
                f"refusing to write into {root_url}: another run holds its writer lease ({shown}): {what}. "
                "Two writers in one folder would interleave manifest records and data files. Wait for that "
                "run to finish (its lease is released when it exits, and taken over automatically once its "
                f"process is gone (same host) or it has not heartbeated for {ttl_s:.0f} s); if you are sure "
                f"it is dead, delete {shown} and rerun.")
        log.warning("taking over the stale writer lease %s (%s): %s", shown, reason,
                    _describe(cur) if cur else "unreadable record")
        if local:
            _remove_stale_local(path, cur)
        else:
            again = _read_record(fs, path, retries=1)
            if again is None or (again.get("run_id") if again else None) == (cur.get("run_id") if cur else None):
                try:
                    fs.rm_file(path)
                except FileNotFoundError:
                    pass
    raise OutputBusy(f"could not take the writer lease of {root_url} ({shown}): it changed hands 20 times "
                     "while we tried; another writer is racing for it")


# ---- paths ----------------------------------------------------------------------------------------
def _split_rel(rel: str) -> list[str]:
    if not isinstance(rel, str):
        raise UnsafePath(f"relative path must be a string, got {type(rel).__name__}")
    if "\x00" in rel:
        raise UnsafePath(f"relative path {rel!r} contains a NUL byte")
    if rel.startswith(("/", "\\")) or ntpath.isabs(rel) or ntpath.splitdrive(rel)[0] or "://" in rel:
        raise UnsafePath(f"relative path {rel!r} is absolute: it would be written outside the output folder")
    parts = [p for p in rel.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafePath(f"relative path {rel!r} contains '..': it could be written outside the output folder")
    return parts


def _within(base: str, p: str) -> bool:
    try:
        return os.path.commonpath([base, p]) == base
    except ValueError:                 # different drives
        return False


def check_no_escape(root_url: str, rels: list[str] = ()) -> None:
    """Refuse (UnsafePath) writes that could land outside `root_url`, before anything is written:
      - relative paths that are absolute or contain '..' (`rels`: what the job will write), and,
        on local filesystems,
      - any symlink in the existing folder tree, at any depth, that points outside the real root
        or points nowhere (a dangling link is followed by the first write through it), e.g.
        `<output>/manifest/commits -> /elsewhere`; and any existing prefix of `rels` that resolves
        outside the root.
    Symlinks are not followed while walking (a link to a folder inside the root is checked as a
    link, not walked twice). Non-local filesystems have no symlinks: only the lexical checks apply."""
    fs, root = fsspec.core.url_to_fs(root_url)
    split = [(rel, _split_rel(rel)) for rel in rels]
    if not _is_local(fs):
        return
    root = root.rstrip("/") or "/"
    real_root = os.path.realpath(root)
    if os.path.isdir(real_root):
        _walk_for_links(root_url, root, real_root)
    checked: set[str] = set()
    for rel, parts in split:
        cur = root
        for part in parts:
            cur = os.path.join(cur, part)
            if cur in checked:
                continue
            if not os.path.lexists(cur):
                break                                   # nothing below exists yet: created inside
            real = os.path.realpath(cur)
            if not _within(real_root, real) or (os.path.islink(cur) and not os.path.exists(cur)):
                _refuse_link(root_url, root, cur, real, real_root, what=f"write {rel!r}")
            checked.add(cur)


def _walk_for_links(root_url: str, root: str, real_root: str) -> None:
    """Every symlink under the real root (not followed): it must resolve inside it, to something."""
    for dirpath, dirnames, filenames in os.walk(real_root, followlinks=False):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                continue
            real = os.path.realpath(p)
            if not os.path.exists(p) or not _within(real_root, real):
                shown = os.path.join(root, os.path.relpath(p, real_root))
                _refuse_link(root_url, root, shown, real, real_root, what="write into it",
                             link=p)


def _refuse_link(root_url, root, cur, real, real_root, what: str, link: str | None = None):
    link = link or _first_link(root, cur)
    if link:
        shown = os.path.join(root, os.path.relpath(link, real_root)) if _within(real_root, link) else link
        where = f"{shown} is a symlink to {os.readlink(link)!r} (resolved: {real})"
    else:
        where = f"{cur} resolves to {real}"
    if link and not os.path.exists(link):
        why = "which does not exist (a dangling link: the first write through it creates its target)"
    else:
        why = f"outside the output folder {real_root}"
    raise UnsafePath(
        f"refusing to {what} under {root_url}: {where}, {why}. Writing through it would put files "
        "elsewhere; remove the link (or replace it by a real folder) or use another output folder.")


def _first_link(root: str, path: str) -> str | None:
    rel = os.path.relpath(path, root)
    cur = root
    for part in rel.split(os.sep):
        cur = os.path.join(cur, part)
        if os.path.islink(cur):
            return cur
    return None


def _norm(url: str) -> tuple[str, str, bool]:
    """(protocol, normalised absolute path, local?) of a URL or plain path."""
    fs, path = fsspec.core.url_to_fs(url)
    if _is_local(fs):
        return "file", os.path.realpath(path or "/"), True
    path = posixpath.normpath("/" + path.lstrip("/")) if path else "/"
    return _protocol(fs), path, False


ARCHIVE_MARKS = ("manifest/_run.json", "manifest/commits")   # what makes a folder an ingest output


def enclosing_archive(url: str) -> str | None:
    """The ingest output (a folder holding manifest/_run.json or manifest/commits) that `url` is, or
    lies inside, at any height; None if there is none. Local paths are resolved (symlinks) first."""
    proto, path, local = _norm(url)
    fs = fsspec.filesystem("file") if local else fsspec.core.url_to_fs(url)[0]
    cur = path
    while True:
        for mark in ARCHIVE_MARKS:
            probe = os.path.join(cur, mark) if local else posixpath.join(cur, mark).lstrip("/")
            try:
                if fs.exists(probe):
                    return cur if local else fs.unstrip_protocol(cur.lstrip("/"))
            except (OSError, ValueError):
                pass       # an unreadable ancestor (permissions, no bucket listing): not ours to judge
        parent = os.path.dirname(cur) if local else posixpath.dirname(cur)
        if parent == cur or (not local and parent in ("", "/")):
            return None
        cur = parent


def check_query_output(output_url: str, archive_url: str | None = None) -> None:
    """Refuse (UnsafePath) a query output that is an ingest output or lies inside one -- the archive
    being read or any other (answers written there would overwrite or mix with archive records, and
    a later ingest rerun would see foreign files) -- and an archive inside the query output."""
    other = enclosing_archive(output_url)
    if other is not None and archive_url:
        p_o, o, _ = _norm(other)
        p_a, a, _ = _norm(archive_url)
        same = p_o == p_a and o == a
    else:
        same = False
    if other is not None and not same:
        raise UnsafePath(
            f"query output {output_url} is inside the ingest output {other} (it holds manifest/_run.json or "
            "manifest/commits): writing answers there would mix them with that archive's records (manifest/, "
            "notes/, state/). Choose an output outside every archive.")
    if not archive_url:
        return
    p_out, out, local = _norm(output_url)
    p_arc, arc, _ = _norm(archive_url)
    if p_out != p_arc:
        return
    inside = _within if local else (lambda base, p: base == "/" or p == base or p.startswith(base + "/"))
    if inside(arc, out):
        same = "is the archive folder" if out == arc else "is inside the archive folder"
        raise UnsafePath(
            f"query output {output_url} {same} {archive_url} (resolved: {out} in {arc}): writing answers "
            "there would overwrite or mix with the archive's records (manifest/, notes/, state/). "
            "Choose an output outside the archive.")
    if inside(out, arc):
        raise UnsafePath(
            f"archive {archive_url} is inside the query output {output_url} (resolved: {arc} in {out}): "
            "writing answers there could overwrite the archive's records, and replacing the output "
            "would delete the archive. Choose an output outside the archive.")
