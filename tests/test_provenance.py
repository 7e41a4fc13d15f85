"""Provenance (git commit, versions, date, the job's model and config) rides beside what records are
checked by: an archive's run record keeps its fingerprint, results.json its config hashes."""
import json

from notebank.schemas.manifest import parse_run_record, run_record
from notebank.schemas.provenance import provenance, set_job


def test_provenance_fields():
    set_job(job="IngestJobConfig", model={"path": "models/tiny-gdn"}, config={"corpus": "c"})
    try:
        p = provenance()
    finally:
        set_job()
    assert p["git"]["commit"] is None or len(p["git"]["commit"]) == 40
    assert {"python", "torch", "transformers", "ray", "notebank"} <= set(p["versions"])
    assert p["date"].endswith("Z") and p["model"] == {"path": "models/tiny-gdn"} and p["config"] == {"corpus": "c"}


def test_run_record_keeps_the_fingerprint_apart():
    fp = {"model": "abc", "notebank": {"chunk_size": 512}}
    rec = parse_run_record(run_record(fp, "2026-01-01T00:00:00Z"), "x")
    assert rec["fingerprint"] == fp and "git" in rec["provenance"] and "versions" in rec["provenance"]
    # a record written before provenance existed still reads
    old = json.dumps({"schema": rec["schema"], "schema_version": rec["schema_version"], "fingerprint": fp,
                      "created_at": "2026-01-01T00:00:00Z"}).encode()
    assert parse_run_record(old, "x")["fingerprint"] == fp


def test_results_document_provenance_outside_config_hashes():
    from notebank.schemas.results import SummaryEntry, config_hash, results_document, validate_results
    cfg = {"method": "plain", "model": "m"}
    h = config_hash(cfg)
    e = SummaryEntry(metric="m", value=50.0, stderr=1.0, n=10, ci=(40.0, 60.0), model="m", config_hash=h)
    kw = dict(benchmark="ruler", bootstrap={}, versions={})
    with_p = results_document({"m/plain/4K": e}, {h: cfg}, provenance=provenance(), **kw)
    without = results_document({"m/plain/4K": e}, {h: cfg}, **kw)
    assert with_p["provenance"]["git"] and "provenance" not in without
    assert with_p["configs"] == without["configs"] and validate_results(with_p).keys() == {"m/plain/4K"}
