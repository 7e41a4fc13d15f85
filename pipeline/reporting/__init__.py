"""Reports of the evaluation jobs: summary.json, report.md and PNG plots from the rows of results.parquet.

* :mod:`pipeline.reporting.ruler` - RULER sweeps: a short report.md (headline with 95% bootstrap
  intervals and n, where NoteBank loses, routers, cost relative to Plain), report-appendix.md (every
  table), results.json (schemas/results.py) beside summary.json;
* :mod:`pipeline.reporting.longbench` - LongBench v1 / v2 and MemoryAgentBench;
* :mod:`pipeline.reporting.mone` - MoNe vs ICL vs RAG (with cost.json, rag_by_k.json);
* :mod:`pipeline.reporting.cost` - analytical FLOPs and bytes (nbcore.cost) beside the measured ones;
* :mod:`pipeline.reporting.common` - length labels, the method colour palette, matplotlib on Agg, panel
  grids, summary.json / report.md.

Scores come from the rows (nbcore.evals computed them); a report only averages and draws.
"""
