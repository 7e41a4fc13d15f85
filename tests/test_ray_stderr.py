"""The job CLIs' stderr filter drops exactly Ray Data's known-false actor-restart line (see
pipeline/ray_stderr.py) and passes every other byte through, in order, up to the process's exit."""
from __future__ import annotations

import subprocess
import sys

from conftest import REPO

# as Ray 2.60 printed it in `make run`, behind the progress bar it interrupted
LINE = (b"[2026-12-06 19:15:43,007 E 14840 14840] core_worker.cc:2465: Actor with class name: "
        b"'MapWorker(MapBatches(IngestActor))' and ID: '71a9a9078ab636a2706c6b3a01000000' has constructor arguments "
        b"in the object store and max_restarts > 0. If the arguments in the object store go out of scope or are "
        b"lost, the actor restart will fail. See https://github.com/ray-project/ray/issues/53727 for more details.\n")
OTHER = b"[2026-12-06 19:15:43,007 E 14840 14840] core_worker.cc:100: some other error\n"


def test_regex_removes_only_the_restart_warning():
    from notebank.pipeline.ray_stderr import RAY_DATA_RESTART_WARNING as rx
    bar = b"ingest:   0%|          | 0/2 [00:00<?, ?doc/s]"
    assert rx.sub(b"", bar + LINE + OTHER) == bar + OTHER
    assert rx.sub(b"", OTHER) == OTHER
    other_class = LINE.replace(b"'MapWorker(MapBatches(IngestActor))'", b"'MyActor'")
    assert rx.sub(b"", other_class) == other_class        # only Ray Data's own MapWorker actors


def test_filter_in_a_process_passes_everything_else_until_exit():
    code = ("import os, sys\n"
            "from notebank.pipeline.ray_stderr import drop_ray_data_restart_warning\n"
            "drop_ray_data_restart_warning()\n"
            f"os.write(2, b'before\\n' + {LINE!r} + {OTHER!r})\n"
            "print('python stderr', file=sys.stderr)\n"
            "sys.stderr.write('x' * 200000 + '\\nend\\n')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stderr == b"before\n" + OTHER + b"python stderr\n" + b"x" * 200000 + b"\nend\n"


def test_filter_keeps_a_terminal_a_terminal():
    """stderr on a terminal: the job still sees a terminal of the same size (progress bars, colours),
    and the terminal gets the bytes unchanged but for the dropped line."""
    import fcntl
    import os
    import pty
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 111, 0, 0))
    code = ("import os, shutil, sys\n"
            "from notebank.pipeline.ray_stderr import drop_ray_data_restart_warning\n"
            "drop_ray_data_restart_warning()\n"
            f"os.write(2, b'a\\n' + {LINE!r} + b'b\\n')\n"
            "print(os.isatty(2), os.get_terminal_size(2).columns, file=sys.stderr)\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=slave, stdout=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    assert p.wait(60) == 0
    assert out.replace(b"\r\n", b"\n") == b"a\nb\nTrue 111\n", out
