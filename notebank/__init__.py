"""The `notebank` namespace: the project's Ray layer, CLIs and on-disk schemas, installed as

    notebank.pipeline   <- pipeline/   (Ray Data ingest and query, sweeps, Ray Train, reporting)
    notebank.jobs       <- jobs/       (the CLIs behind the notebank-* console scripts)
    notebank.schemas    <- schemas/    (every on-disk format, versioned)

so that installing the project never adds generic top-level packages (`pipeline`, `jobs`,
`schemas`) that could clash with a user's own. `nbcore` (the pure-PyTorch library) stays a
top-level package of its own name.

In a checkout (and with `ray job submit --working-dir .`) the three folders sit beside this one at
the repository root, so the root joins this package's search path; an installed wheel carries them
inside `notebank/` instead (pyproject.toml's package-dir).
"""
import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "pipeline")) and _os.path.isfile(_os.path.join(_root, "pipeline", "__init__.py")):
    __path__.append(_root)   # noqa: F821 - a checkout: notebank.pipeline is <root>/pipeline
