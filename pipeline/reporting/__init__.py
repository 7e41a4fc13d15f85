"""Reports of the evaluation jobs: summary.json, report.md and PNG plots from the rows of results.parquet.

* :mod:`pipeline.reporting.ruler` - RULER sweeps (accuracy vs length, coverage, routers and native
  addressing, headline checks, the LoRA 2x2, cost);
* :mod:`pipeline.reporting.longbench` - LongBench v1 / v2 and MemoryAgentBench;
* :mod:`pipeline.reporting.mone` - MoNe vs ICL vs RAG (with cost.json, rag_by_k.json);
* :mod:`pipeline.reporting.cost` - analytical FLOPs and bytes (nbcore.cost) beside the measured ones;
* :mod:`pipeline.reporting.common` - length labels, matplotlib on Agg, panel grids, summary.json / report.md.

Scores come from the rows (nbcore.evals computed them); a report only averages and draws.
"""
