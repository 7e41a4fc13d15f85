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
