"""Drop one known-false error line from the job's stderr: Ray Data's actor-pool warning.

Every actor Ray Data starts for `map_batches(SomeClass, compute=ActorPoolStrategy(...))` makes the
driver's core worker log, at ERROR level (core_worker.cc):

    Actor with class name: 'MapWorker(MapBatches(IngestActor))' ... has constructor arguments in the
    object store and max_restarts > 0. If the arguments in the object store go out of scope or are
    lost, the actor restart will fail. See https://github.com/ray-project/ray/issues/53727

The cause is inside Ray Data, not in our actors' arguments: its ActorPoolMapOperator `ray.put`s
its DataContext and MapTransformer and passes the two ObjectRefs to every MapWorker constructor
(ray/data/_internal/execution/operators/{map_operator,actor_pool_map_operator}.py), and it sets
max_restarts=-1 so that a dead actor is restarted and its batch redone (which ingest relies on).
The operator holds both refs until the dataset has finished, so they cannot go out of scope while
an actor may restart: the line warns about a case that does not arise, once per actor. Ray offers
no switch for it (RAY_BACKEND_LOG_LEVEL would silence every C++ error of every Ray process), so the
job CLIs filter exactly this line out of their own stderr and pass everything else through.
"""
from __future__ import annotations

import atexit
import os
import re
import threading

# the whole line: "[<time> E <pid> <tid>] core_worker.cc:<n>: Actor with class name: 'MapWorker(...' ... details.\n"
RAY_DATA_RESTART_WARNING = re.compile(
    rb"\[[^\]\n]*\] core_worker\.cc:\d+: Actor with class name: 'MapWorker\([^\n]*has constructor arguments in "
    rb"the object store and max_restarts > 0\.[^\n]*\n")

_installed = False


def drop_ray_data_restart_warning() -> None:
    """Route this process's fd 2 through a pipe (a pseudo-terminal when stderr is a terminal, so that
    progress bars and colours still see one, of the same size) whose reader thread writes everything
    to the real stderr except RAY_DATA_RESTART_WARNING lines. Idempotent; undone (and drained) at exit."""
    global _installed
    if _installed:
        return
    _installed = True
    real_stderr = os.dup(2)
    if os.isatty(real_stderr):
        read_fd, write_fd = os.openpty()
        _mirror_terminal(real_stderr, write_fd)
    else:
        read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)

    def pump():
        while True:
            try:
                data = os.read(read_fd, 65536)
            except OSError:              # a pseudo-terminal whose last writer closed (EIO): the end
                break
            if not data:
                break
            data = RAY_DATA_RESTART_WARNING.sub(b"", data)
            while data:
                data = data[os.write(real_stderr, data):]

    reader = threading.Thread(target=pump, name="stderr-filter", daemon=True)
    reader.start()

    def restore():
        import sys
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(real_stderr, 2)        # closes the pipe's last write end held here: the reader drains and ends
        reader.join(timeout=5)

    atexit.register(restore)


def _mirror_terminal(real_fd: int, pty_fd: int) -> None:
    """The pseudo-terminal gets the real terminal's size, and writes bytes as they are (no "\n" to
    "\r\n" translation)."""
    import fcntl
    import termios
    try:
        fcntl.ioctl(pty_fd, termios.TIOCSWINSZ, fcntl.ioctl(real_fd, termios.TIOCGWINSZ, b"\0" * 8))
        attrs = termios.tcgetattr(pty_fd)
        attrs[1] &= ~termios.OPOST
        termios.tcsetattr(pty_fd, termios.TCSANOW, attrs)
    except OSError:
        pass
