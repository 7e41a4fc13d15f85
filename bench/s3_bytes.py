"""Bytes written per document on S3: the old commit protocol (every file under a temporary name, then
`mv`) against the current one (data files once under their final names, create-only commit record),
counted by the server, in one run.

    .venv/bin/python bench/s3_bytes.py                       # writes bench/results/s3_bytes.{json,md}
    .venv/bin/python bench/s3_bytes.py --docs 2 --out /tmp/s3b.json      # quick

The endpoint is moto's S3 server on 127.0.0.1 (tests/s3_server.py), which counts the body bytes of
every PUT/POST it receives and the size of every server-side copy (what s3fs sends for `mv`: a copy
is the store writing the bytes again). The same documents (nbcore.testing.needle_text, --chars each)
are ingested with the checkpoint --model by

  before   pipeline.actors.IngestActor in this process, its store replaced by `TempRenameArchive`
           (the write path as it was before: temporary name + `mv` for states, parts and records);
  after    the same actor with the store as shipped;
  job      the whole ingest job (pipeline.dataplane on a local Ray: lease, run record, shard scan),
           as shipped, for the overhead the job adds around the actor's writes.

Per document: bytes the server received (PUT bodies + copies) / documents, and the ratio to the
documents' files (their states, and the notes and documents parts of their groups). The bar: after
<= 1.1.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import posixpath
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench.common import machine, today, write_json  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "results" / "s3_bytes.json"
NB = {"chunk_size": 128, "write_budget": 2, "note_budget": 32, "window": 16, "tail": 8, "addr_dim": 8}
DATA = ("notes/", "documents/", "state/")


def temp_rename_archive():
    """The write path before this change: every file written under a temporary name, then moved."""
    from notebank.pipeline.archive import TMP_MARK, Archive, sha256
    from notebank.schemas import archive as S

    class TempRenameArchive(Archive):
        def atomic_write(self, rel, data):
            final = self.path(rel)
            self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
            tmp = f"{final}{TMP_MARK}{uuid.uuid4().hex[:12]}"
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, final)
            return S.FileRef(path=rel, size=len(data), sha256=sha256(data))

        def _atomic_stream(self, rel, chunks):
            final = self.path(rel)
            self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
            tmp = f"{final}{TMP_MARK}{uuid.uuid4().hex[:12]}"
            h, n = hashlib.sha256(), 0
            with self.fs.open(tmp, "wb") as f:
                for buf in chunks:
                    f.write(buf)
                    h.update(buf)
                    n += len(buf)
            self.fs.mv(tmp, final)
            return S.FileRef(path=rel, size=n, sha256=h.hexdigest())

        def write_commit(self, rec):
            self.atomic_write(self.rel_commit(rec.group), rec.to_bytes())
            return rec

    return TempRenameArchive


def docs_for(n: int, chars: int) -> list[dict]:
    from nbcore.testing import needle_text
    return [{"doc_id": f"doc{i}", "text": needle_text(chars + 101 * i, 2, seed=i)[0]} for i in range(n)]


def file_bytes(fs, root: str) -> int:
    """Sum of the data files (notes, documents, state) under an archive root."""
    n = 0
    for sub in DATA:
        if fs.exists(root + "/" + sub):
            n += sum(int(i["size"]) for i in fs.find(root + "/" + sub, detail=True).values())
    return n


def measure(srv, prefix: str, fs, files_root: str, n_docs: int) -> dict:
    # the server was reset before the run: every request since is the run's (DeleteObjects is a POST
    # to the bucket, not to a key under the prefix)
    c = srv.counters()
    rows = srv.requests(prefix)
    data = [r for r in rows if r["method"] in ("PUT", "POST") and r["path"].split(prefix, 1)[1].lstrip("/")
            .startswith(DATA)]
    files = file_bytes(fs, files_root)
    written = c["put_bytes"] + c["copy_bytes"]
    return {"documents": n_docs, "files_bytes": files, "put_bytes": c["put_bytes"], "copy_bytes": c["copy_bytes"],
            "copies": c["copies"], "put_requests": c["put_requests"], "deletes": c["deletes"],
            "data_put_bytes": sum(r["body_bytes"] for r in data),
            "temporary_names": sum(".tmp-" in r["path"] for r in rows if r["method"] == "PUT"),
            "written_bytes": written, "written_per_doc": round(written / n_docs, 1),
            "files_per_doc": round(files / n_docs, 1), "ratio_to_files": round(written / files, 4)}


def actor_run(srv, model: dict, docs: list[dict], group_size: int, store_cls, name: str) -> dict:
    from notebank.pipeline.actors import IngestActor
    url = srv.url(name)
    fs = srv.fs()
    actor = IngestActor(model=model, nb=NB, block_size=512, output=url, fp_digest="bench", tokenizer_name=None)
    actor.store = store_cls(url)
    prefix = url.split("://", 1)[1].split("/", 1)[1]
    srv.reset()
    t0 = time.perf_counter()
    for g in range(0, len(docs), group_size):
        batch = [{"row": i, "shard": "bench.jsonl", "action": "ingest", "reason": None, "doc_id": d["doc_id"],
                  "key": d["doc_id"], "generation": 0, "group_id": f"g{g // group_size}", "text": d["text"],
                  "metadata": {}} for i, d in enumerate(docs[g:g + group_size], start=g)]
        recs = actor.ingest_group(f"g{g // group_size}", batch)
        assert all(r["status"] == "ok" for r in recs), recs
    out = measure(srv, prefix, fs, url.split("://", 1)[1], len(docs))
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


def job_run(srv, model: dict, docs: list[dict], group_size: int) -> dict:
    from notebank.pipeline.config import IngestJobConfig, build
    from notebank.pipeline.ingest import run_ingest
    fs = srv.fs()
    base = srv.url("job")
    fs.pipe_file(base.split("://", 1)[1] + "/corpus.jsonl", "".join(json.dumps(d) + "\n" for d in docs).encode())
    out = base + "/archive"
    prefix = out.split("://", 1)[1].split("/", 1)[1]
    cfg = build(IngestJobConfig, {"corpus": base + "/corpus.jsonl", "output": out, "model": model, "notebank": NB,
                                  "actors": {"num_actors": 1, "num_cpus": 0.0, "torch_threads": 1},
                                  "progress": False, "block_size": 512, "docs_per_group": group_size}).validate()
    srv.reset()
    t0 = time.perf_counter()
    s = run_ingest(cfg)
    assert s["docs_ok"] == len(docs), s
    res = measure(srv, prefix, fs, out.split("://", 1)[1], len(docs))
    res["wall_s"] = round(time.perf_counter() - t0, 2)
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/tiny-gdn-v5", help="checkpoint dir (default %(default)s)")
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--chars", type=int, default=6000)
    ap.add_argument("--group-size", type=int, default=3, help="documents per group (default %(default)s)")
    ap.add_argument("--no-job", action="store_true", help="skip the whole-job run (no Ray)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    from notebank.pipeline.archive import Archive
    from s3_server import S3Server, aws_env

    model = {"path": str((REPO / args.model).resolve()) if not os.path.isabs(args.model) else args.model,
             "device": "cpu"}
    docs = docs_for(args.docs, args.chars)
    with S3Server() as srv:
        before = actor_run(srv, model, docs, args.group_size, temp_rename_archive(), "before")
        after = actor_run(srv, model, docs, args.group_size, Archive, "after")
        job = None
        if not args.no_job:
            import ray
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": str(REPO), **aws_env(srv.port)}})
            try:
                job = job_run(srv, model, docs, args.group_size)
            finally:
                ray.shutdown()
    res = {"what": "bytes the S3 server received per document: old temp+mv protocol vs write-once + create-only "
                   "commit", "date": today(), "machine": machine(), "model": args.model, "documents": args.docs,
           "chars_per_doc": args.chars, "docs_per_group": args.group_size,
           "command": "python bench/s3_bytes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "before": before, "after": after, "job": job, "bar": "after.ratio_to_files <= 1.1",
           "bar_met": after["ratio_to_files"] <= 1.1 and (job is None or job["ratio_to_files"] <= 1.1)}
    write_json(args.out, res)
    md = Path(args.out).with_suffix(".md")
    md.write_text(render(res))
    print(json.dumps({k: res[k] for k in ("bar_met",)} | {k: res[k] and res[k]["ratio_to_files"]
                                                         for k in ("before", "after", "job")}))
    return res


def render(res: dict) -> str:
    rows = [("before (temp + mv)", res["before"]), ("after (write once, create-only commit)", res["after"])]
    if res["job"]:
        rows.append(("after, whole ingest job (lease, run record, scan)", res["job"]))
    lines = [f"# Bytes written per document on S3 ({res['date']})", "",
             f"`{res['command']}` -- {res['documents']} documents of ~{res['chars_per_doc']} characters, "
             f"{res['docs_per_group']} per group, model `{res['model']}`, on {res['machine']}. Bytes counted by the "
             "S3 server (moto on 127.0.0.1, tests/s3_server.py): PUT/POST bodies plus the size of every "
             "server-side copy (`mv` on S3 is a copy and a delete).", "",
             "| protocol | files / doc | written / doc | x files | PUT bytes, all | copies (bytes) | temp names | deletes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['files_per_doc']:,.0f} | {r['written_per_doc']:,.0f} | {r['ratio_to_files']:.3f} | "
                     f"{r['put_bytes']:,} | {r['copies']} ({r['copy_bytes']:,}) | {r['temporary_names']} | "
                     f"{r['deletes']} |")
    lines += ["", f"Bar: after <= 1.1x the documents' files: **{'met' if res['bar_met'] else 'NOT met'}**. What is "
              "above 1.0x after: the commit records (and, for the job, the run record, the lease and its "
              "heartbeats).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
