"""pipeline/allocator.py: glibc malloc thresholds for CPU workers, checked in fresh processes by
what they are for (page faults of a repeated large temporary), and the ways to opt out."""
import os
import subprocess
import sys
import textwrap

import pytest

from notebank.pipeline import allocator

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings: Linux only")

PROBE = textwrap.dedent("""
    import json, resource, numpy as np
    from notebank.pipeline.allocator import tune_cpu_malloc

    def faults(n=8, size=48 << 20):        # a forward's pattern: the same big temporary, again and again
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(n):
            a = np.ones(size // 8)
            del a
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0

    before = faults()
    tuned = tune_cpu_malloc()
    print(json.dumps({"before": before, "tuned": tuned, "after": faults(), "again": tune_cpu_malloc()}))
""")


def _probe(**env_over):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "NB_MALLOC"}
    env.update(env_over)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_thresholds_stop_refaulting_a_repeated_temporary():
    r = _probe()
    assert r["tuned"] is True and r["again"] is True
    # default: a 48 MiB block is mapped and faulted in on every use; tuned: the heap keeps it
    assert r["after"] * 3 < r["before"], r


@glibc
@pytest.mark.parametrize("env", [{"NB_MALLOC": "default"}, {"MALLOC_ARENA_MAX": "2"}])
def test_opt_out_and_users_own_settings_win(env):
    r = _probe(**env)
    assert r["tuned"] is False and r["again"] is False


def test_runs_on_cpu():
    import torch
    assert allocator.runs_on_cpu({"device": "cpu"}) is True
    assert allocator.runs_on_cpu({"device": "cuda"}) is False
    assert allocator.runs_on_cpu({"path": "x"}) is (not torch.cuda.is_available())
