"""The `notebank` namespace: the project's Ray layer, CLIs and on-disk schemas, installed as

    notebank.pipeline   <- pipeline/   (Ray Data ingest and query, sweeps, Ray Train, reporting)
    notebank.jobs       <- jobs/       (the CLIs behind the notebank-* console scripts)
    notebank.schemas    <- schemas/    (every on-disk format, versioned)

so that installing the project never adds generic top-level packages (`pipeline`, `jobs`,
`schemas`) that could clash with a user's own. `nbcore` (the pure-PyTorch library) stays a
top-level package of its own name.

In a checkout the three names are folder links beside this file (notebank/pipeline -> ../pipeline,
...): a static tool (pyright, jedi, an IDE) follows them like any package, there is one copy of each
module, and nothing else of the repository (nbcore, tests, lab) appears under `notebank`.
"""
