"""Start, inspect and stop a NoteBank Ray head with token authentication on (logic: pipeline/cluster.py).

    source .venv/bin/activate
    python jobs/cluster.py head                 # token in ~/.ray/auth_token (0600), dashboard on 127.0.0.1:8265
    RAY_AUTH_MODE=token RAY_API_SERVER_ADDRESS=http://127.0.0.1:8265 \\
      ray job submit --working-dir . -- python jobs/ingest.py -c configs/ingest.yaml ...
    python jobs/cluster.py worker --node-manager-port P --object-manager-port Q   # a 2nd node here
    python jobs/cluster.py status
    python jobs/cluster.py stop                 # this head and its worker nodes only (never a bare `ray stop`)

`python jobs/cluster.py token [--show]` creates the token without starting anything (e.g. on the
machine that runs `ray up ray_cluster.yaml`). `--help` on each subcommand lists its options.
Exit status: 0 ok, 1 not running (status/stop), 2 refused (wrong python, head already running,
bad token file) or failed to start.
"""
from __future__ import annotations

import os
import sys

if not __package__:   # run as a script from a checkout (or ray job submit): the repo root holds notebank/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from notebank.pipeline.cluster import main  # noqa: E402  (standard library only: runs under any python)

if __name__ == "__main__":
    sys.exit(main())
