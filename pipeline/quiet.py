"""Quiet by default: third-party notices that say nothing about a normal run are filtered unless a
job runs with --verbose. On CPU the project's own kernels run, so transformers' "falling back to
its reference PyTorch implementation ... much slower" notices do not apply; weight-loading bars
print raw ANSI codes into logs; library UserWarnings / FutureWarnings are about their internals.
Set through the environment, so the local Ray's worker processes (started after this) inherit it."""
from __future__ import annotations

import os
import warnings

QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",             # transformers' logger: errors only
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",           # weight-loading / download bars (transformers follows it)
    "PYTHONWARNINGS": "ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning",
}


def quiet_third_party() -> None:
    """Apply QUIET_ENV (keeping any value the user set) and the same warning filters here."""
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    for cat in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=cat)


FALLBACK_NOTICE = "falling back to its reference PyTorch implementation"


class _DropKernelFallback:
    """A logging filter: drops transformers' kernel-fallback notices (on CPU the project's own kernels
    run, so "correct but much slower" does not describe what happens)."""

    def filter(self, record) -> bool:
        return FALLBACK_NOTICE not in record.getMessage()


def quiet_in_process() -> None:
    """For a notebook (open_archive(...).ask): the same notices filtered in this process only, without
    touching the environment or the user's warning filters: transformers' kernel-fallback notices and
    its weight-loading bars."""
    import logging
    try:
        from transformers.utils import logging as tlog
    except ImportError:
        return
    tlog.disable_progress_bar()
    for name in ("transformers", "transformers.integrations.hub_kernels"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, _DropKernelFallback) for f in lg.filters):
            lg.addFilter(_DropKernelFallback())
