"""The Ray Data drivers: ingest (corpus -> archive) and query (questions -> answers dataset).

See pipeline/ingest.py and pipeline/query.py for the stage diagrams. What the driver holds: shard
URLs, per-row ids and hashes from the scans, the plan, and one small record per row. Never text,
notes or states.
"""
from __future__ import annotations

import json
import logging
import os
import posixpath
import socket
import sys
import time
from collections import defaultdict

import fsspec

from notebank.pipeline.archive import Archive, ArchiveError, FingerprintMismatch, fingerprint_digest
from notebank.pipeline.config import ConfigError
from notebank.pipeline.corpus import list_shards, shard_slug
from notebank.schemas import archive as S
from notebank.schemas.archive import doc_key

log = logging.getLogger(__name__)


class _NoBar:
    def update(self, n=1): pass
    def set_postfix(self, **kw): pass
    def close(self): pass


def progress_bar(enabled: bool, total: int, unit: str, desc: str):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, unit=unit, desc=desc, mininterval=1.0, dynamic_ncols=True)


def _is_process_local(url: str) -> bool:
    fs, _ = fsspec.core.url_to_fs(url)
    protos = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "memory" in protos


def _require_shared_store(url: str, what: str) -> None:
    if _is_process_local(url):
        raise ConfigError(f"{what}={url}: memory:// lives inside one process, and Ray actors write the archive "
                          f"themselves; use a local path or a shared store (s3://, gs://, ...)")


def _run_info(job: str) -> dict:
    return {"job": job, "argv": " ".join(sys.argv)[:500], "host": socket.gethostname(), "pid": os.getpid()}


def io_tasks(n_inputs: int):
    """Ray Data's compute for a scan or read stage over `n_inputs` items: up to 4 concurrent tasks (the
    callers give them 0 CPUs: they wait on I/O, and must run beside actors that hold every CPU of a
    small cluster). Never more tasks than inputs (Ray Data warns about a pool it cannot fill)."""
    import ray
    return ray.data.TaskPoolStrategy(size=max(1, min(4, n_inputs)))


def quiet_ray_data(progress: bool) -> None:
    """Our own progress bar (with totals) replaces Ray Data's per-operator bars and INFO lines."""
    import ray
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.verbose_stats_logs = False
    for name in ("ray.data", "ray.data._internal.execution.streaming_executor"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # its one notice that the bars we turned off just above are off
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)


def require_room_for_actor(num_cpus: float, num_gpus: float,
                           keys: tuple[str, str] = ("actors.num_cpus", "actors.num_gpus")) -> None:
    """Refuse at once (ConfigError) when no node of the Ray cluster has the CPUs and GPUs of one actor:
    Ray would otherwise queue the actor (and the job) forever without a word. Checked against the
    nodes alive now; an autoscaling cluster must start with one node that fits an actor. keys: the
    config keys that set num_cpus and num_gpus (named in the message)."""
    import ray
    need = {"CPU": float(num_cpus or 0), "GPU": float(num_gpus or 0)}
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if any(all(r.get(k, 0.0) >= v for k, v in need.items()) for r in nodes):
        return
    have = "; ".join(f"{r.get('CPU', 0):g} CPUs, {r.get('GPU', 0):g} GPUs" for r in nodes) or "no live node"
    raise ConfigError(f"each actor needs {need['CPU']:g} CPUs and {need['GPU']:g} GPUs ({keys[0]}, {keys[1]}), but "
                      f"no Ray node has that (nodes: {have}). Lower {keys[0]} / {keys[1]}, or start Ray with more "
                      f"(ray.num_cpus for a local Ray)")


def probe_model(model: dict, actors, memory: str = "notebank", mone_adapters: str | None = None,
                nb: dict | None = None) -> dict:
    """Load the memory backend once in a Ray task with the actors' resources -> fingerprint (the
    backend's: NoteBank's backbone, MoNe's files digest), tokenizer hash, memory and its write facts
    (family/channels, or the MoNe config). A bad checkpoint fails here, once, with one clear error
    (not one per actor restart)."""
    import ray
    require_room_for_actor(actors.num_cpus, actors.num_gpus)

    def _probe(model):
        from notebank.pipeline.actors import build_memory, memory_info
        try:
            backend, tok_fp = build_memory(model, memory, nb, mone_adapters=mone_adapters, torch_threads=1)
        except Exception as e:   # noqa: BLE001 - reported to the user as one line
            return {"error": f"{type(e).__name__}: {e}"}
        info = memory_info(backend, tok_fp)
        info["tokenizer_name"] = model.get("tokenizer") or model.get("path")
        return info

    opts = {"num_cpus": actors.num_cpus, "num_gpus": actors.num_gpus, "max_retries": 0}
    if actors.accelerator_type:
        opts["accelerator_type"] = actors.accelerator_type
    info = ray.get(ray.remote(_probe).options(**opts).remote(model))
    if "error" in info:
        raise ConfigError(f"{memory} model could not be loaded ({model.get('path') or model.get('hf_config', {}).get('model_type')}): "
                          f"{info['error']}")
    return info


# The schema versions a NoteBank run fingerprint names. Frozen: they are part of every existing
# archive's manifest/_run.json (and its digest in each commit record), so changing them would make
# a rerun refuse every archive written so far.
RUN_SCHEMA_VERSIONS = {"notes": 1, "state": 1, "manifest": 1}


def run_fingerprint(model_fingerprint: str, family: str, n_channels: int, nb, tokenizer: str | None = None) -> dict:
    """What every NoteBank archive in an output folder is a pure function of (besides the documents).
    nb: the writer's NoteBankConfig."""
    return {
        "model": model_fingerprint,
        "tokenizer": tokenizer,
        "family": family,
        "n_channels": int(n_channels),
        "notebank": nb.to_dict(),
        "notebank_digest": nb.digest(),
        "projection_seed": nb.seed,
        "schema_versions": dict(RUN_SCHEMA_VERSIONS),
    }


def memory_run_fingerprint(cfg, info: dict) -> dict:
    """manifest/_run.json's fingerprint: what every state of the output is a pure function of (besides
    the texts), the memory's name included (a query with the other memory is refused)."""
    if cfg.memory == "mone":
        fp = {"memory": "mone", "model": info["fingerprint"], "tokenizer": info.get("tokenizer"),
              "mone": info["mone"], "schema_versions": {"state": 2, "documents": S.DOCUMENTS_VERSION}}
    else:
        fp = run_fingerprint(info["fingerprint"], info["family"], info["n_channels"], cfg.notebank,
                             info.get("tokenizer"))
        fp["memory"] = "notebank"
    fp["layout"] = 2
    return fp


def held_memory(run: dict) -> str:
    """The memory an archive holds (archives written before the fingerprint named it: notebank)."""
    return run["fingerprint"].get("memory", "notebank")


def _check_memory(store: Archive, run: dict | None, memory: str, job: str) -> None:
    if run is None:
        return
    held = held_memory(run)
    if held != memory:
        what = "NoteBank archives" if held == "notebank" else f"{held} memory states"
        raise FingerprintMismatch(f"{store.url} holds {what} ({store.url_of('manifest/_run.json')}), not "
                                  f"{memory}: set memory: {held}" + (", or use a new output folder" if job == "ingest"
                                                                     else ""))


def _portable_model(model: dict, memory: str, adapters: str | None) -> tuple[dict, str | None]:
    """MoNe: local checkpoint and adapter paths made absolute (actors may run in another directory)."""
    if memory != "mone":
        return model, adapters
    model = dict(model)
    if model.get("path") and "://" not in model["path"] and os.path.exists(model["path"]):
        model["path"] = os.path.abspath(model["path"])
    if adapters and "://" not in adapters and os.path.exists(adapters):
        adapters = os.path.abspath(adapters)
    return model, adapters


# ------------------------------------------------------------------------------------------------
# ingest

def committed_documents(store: Archive, verify: bool, repair: bool = True) -> tuple[dict, dict, list[str]]:
    """-> (valid commit records by group, {doc_id: latest ok/failed entry info}, problems).
    A group whose files do not match its record is taken out of the committed set (redone).
    A document's info holds its state's and notes parts' FileRef dicts (path, size, sha256): readers
    check the bytes against them."""
    commits, problems = store.load_commits()
    sizes = store.file_sizes() if commits else {}
    valid, damaged = {}, {}
    for g, rec in commits.items():
        bad = store.group_problems(rec, sizes, verify)
        if bad and repair:
            problems.append(f"group {g} is redone: " + "; ".join(bad[:3]))
            store.invalidate(g)
            continue
        if bad:
            # read-only (query): only the documents whose own files are damaged are left out
            shared = store.file_problems([r for r in (rec.notes, rec.documents_file) if r is not None], sizes, verify)
            for e in rec.documents:
                if e.status == "ok" and e.doc_id is not None:
                    own = list(shared.values()) + list(store.file_problems(e.state, sizes, verify).values())
                    if own:
                        damaged[e.doc_id] = "; ".join(own[:3])
            problems.append(f"group {g} is damaged: " + "; ".join(bad[:3]))
        valid[g] = rec
    return valid, documents_of(valid, damaged), problems


def documents_of(valid: dict, damaged: dict | None = None) -> dict:
    """{doc_id: latest generation's facts} of a set of committed groups; `damaged`: {doc_id: why}
    for documents whose files are damaged (a read-only caller leaves them out)."""
    docs: dict[str, dict] = {}
    for g, rec in valid.items():
        for e in rec.documents:
            if e.status != "ok" or e.doc_id is None:
                continue
            cur = docs.get(e.doc_id)
            if cur is None or e.generation > cur["generation"]:
                docs[e.doc_id] = {"group": g, "generation": e.generation, "key": e.key, "n_tokens": e.n_tokens,
                                  "state": [r.__dict__ for r in e.state], "shas": set(),
                                  "notes_files": [], "source": e.source}
    for doc_id, why in (damaged or {}).items():
        docs.setdefault(doc_id, {"shas": set(), "notes_files": []})["damaged"] = \
            f"document {doc_id!r} cannot be read from the archive: {why}"
    for g, rec in valid.items():   # every generation's notes part and text hash
        for e in rec.documents:
            if e.status == "ok" and e.doc_id in docs:
                docs[e.doc_id]["shas"].add(e.text_sha256)
                if rec.notes is not None and e.n_notes and \
                        all(f["path"] != rec.notes.path for f in docs[e.doc_id]["notes_files"]):
                    docs[e.doc_id]["notes_files"].append(dict(rec.notes.__dict__))
    return docs


def groups_to_retry(scans: list[dict], valid: dict, cfg) -> tuple[dict, list[str]]:
    """Committed groups to redo because a row that failed in them now reads differently: it was
    unreadable (bad JSON, bad UTF-8) and now reads, or its text changed (a failed entry records the
    text's sha256). A row that still fails to read, or reads the same text, is not retried (it would
    fail the same way). -> ({group: {"retried": [rows], "rewritten": [rows ok before]}}, notes)."""
    G = cfg.docs_per_group
    failed_at: dict[tuple, object] = {}
    for g, rec in valid.items():
        for e in rec.documents:
            if e.status == "failed" and e.source and "row" in e.source:
                failed_at[(g, int(e.source["row"]))] = e
    redo: dict[str, dict] = {}
    notes: list[str] = []
    if not failed_at:
        return redo, notes
    n_rows = 0
    for sc in scans:
        slug = shard_slug(sc["shard"])
        for row, doc_id, sha, err, _at in json.loads(sc["rows"]):
            if cfg.limit is not None and n_rows >= cfg.limit:
                break
            n_rows += 1
            if sc["shard_error"]:
                continue                      # a shard not readable to its end: its groups stay as committed
            gid = f"{slug}-{row // G:06d}"
            e = failed_at.get((gid, row))
            if e is None or err or doc_id is None or doc_key(doc_id)[1]:
                continue                      # not a failed row, or still unreadable / an unusable id
            if e.text_sha256 is not None and e.text_sha256 == sha and e.doc_id == doc_id:
                continue                      # the same text: it would fail the same way
            redo.setdefault(gid, {"retried": [], "rewritten": []})["retried"].append(row)
    # a document of a redone group with a later generation elsewhere (appended since) would be
    # re-planned against the wrong previous state: such a group is left as it is
    later: dict[str, int] = {}
    for g, rec in valid.items():
        for e in rec.documents:
            if e.status == "ok" and e.doc_id is not None:
                later[e.doc_id] = max(later.get(e.doc_id, -1), e.generation)
    for g in list(redo):
        stuck = [e.doc_id for e in valid[g].documents if e.status == "ok" and later.get(e.doc_id, -1) > e.generation]
        if stuck:
            notes.append(f"group {g}: a failed row reads differently now, but {stuck[:3]} were appended to since; "
                         "not redone (re-ingest into a new output folder to include it)")
            del redo[g]
            continue
        redo[g]["rewritten"] = [int(e.source["row"]) for e in valid[g].documents
                                if e.status in ("ok", "skipped") and e.source and "row" in e.source]
    return redo, notes


def plan_groups(scans: list[dict], committed_groups: dict, committed: dict, cfg,
                retried: dict | None = None) -> tuple[dict, dict]:
    """-> ({shard: {group: {row: [action, reason, extra]}}}, counters). Decides every row before any
    model work: ingest / append / skip (same text committed) / fail (bad row, duplicate, other text).
    `retried`: {group: rows that failed in an earlier run} (marked in their records)."""
    G = cfg.docs_per_group
    retried = retried or {}
    plan: dict[str, dict] = {}
    counts = defaultdict(int)
    seen: dict[str, str] = {}
    seeks: dict = {}
    n_rows = 0
    for sc in scans:
        shard, rows = sc["shard"], json.loads(sc["rows"])
        slug = shard_slug(shard)
        groups: dict[str, dict] = {}
        incomplete_from = None
        if sc["shard_error"]:
            # only whole groups before the failure point are committed; the rest waits for a fixed shard
            last = rows[-1][0] + 1 if rows else 0
            incomplete_from = (last // G) * G
        for row, doc_id, sha, err, at in rows:
            if cfg.limit is not None and n_rows >= cfg.limit:
                break
            n_rows += 1
            gid = f"{slug}-{row // G:06d}"
            if gid in committed_groups:
                counts["rows_in_committed_groups"] += 1
                for e in committed_groups[gid].documents:
                    if e.source and e.source.get("row") == row:
                        counts["skipped" if e.status in ("ok", "skipped") else "failed_before"] += 1
                continue
            if incomplete_from is not None and row >= incomplete_from:
                counts["deferred"] += 1
                continue
            key, kerr = doc_key(doc_id) if doc_id is not None else (None, None)
            decision: list
            if err or kerr:
                decision = ["fail", err or kerr, {"doc_id": doc_id if not kerr else doc_id}]
            elif doc_id in seen:
                decision = ["fail", f"duplicate doc_id (first seen at {seen[doc_id]})", {"doc_id": doc_id}]
            else:
                seen[doc_id] = f"{shard}:{row}"
                prev = committed.get(doc_id)
                if prev is not None and sha in prev["shas"]:
                    decision = ["skip", None, {"doc_id": doc_id, "key": key}]
                elif prev is not None and cfg.mode != "append":
                    decision = ["fail", "already archived with different text; use a new output folder, or "
                                        "mode: append to add this text to the document", {"doc_id": doc_id}]
                elif prev is not None:
                    decision = ["append", None, {"doc_id": doc_id, "key": key, "generation": prev["generation"] + 1,
                                                 "previous": {k: prev[k] for k in ("state", "notes_files", "generation",
                                                                                   "n_tokens")}}]
                elif cfg.mode == "append":
                    decision = ["fail", "mode: append, but the document is not archived yet (ingest it first)",
                                {"doc_id": doc_id}]
                else:
                    decision = ["ingest", None, {"doc_id": doc_id, "key": key, "generation": 0}]
            if decision[0] == "fail" and sha is not None:
                decision[2]["text_sha256"] = sha          # a rerun retries the row only if its text changes
            if row in retried.get(gid, ()):
                decision[2]["retried"] = True
            decision[2]["group_id"] = gid
            if gid not in groups:
                seeks[(shard, gid)] = at               # where the group's first planned row starts
            groups.setdefault(gid, {})[str(row)] = decision
            counts[decision[0]] += 1
        if groups:
            plan[shard] = groups
    counts["rows"] = n_rows
    counts["seeks"] = seeks
    return plan, dict(counts)


def ingest_dataset(cfg, on_commit=None) -> dict:
    import ray

    from notebank.pipeline.safety import acquire_lease, check_no_escape
    t_start = time.perf_counter()
    _require_shared_store(cfg.output, "output")
    fs, shard_paths = list_shards(cfg.corpus)                  # a bad corpus path fails here, first
    shards = [fs.unstrip_protocol(p) for p in shard_paths]
    store = Archive(cfg.output)
    from notebank.pipeline.ingest import OUTPUT_WRITES
    check_no_escape(cfg.output, list(OUTPUT_WRITES))
    store.check_layout()
    with acquire_lease(cfg.output, _run_info("ingest")) as lease:
        lease.start_heartbeat()              # a background thread: the lease stays live on long jobs
        quiet_ray_data(cfg.progress)
        store.clean_tmp()
        spec = _model_dict(cfg.model)
        model, adapters = _portable_model(spec, cfg.memory, cfg.mone_adapters)
        _check_memory(store, store.read_run(), cfg.memory, "ingest")
        info = probe_model(model, cfg.actors, cfg.memory, adapters, cfg.notebank.to_dict())
        info["tokenizer_name"] = spec.get("tokenizer") or spec.get("path")     # as configured
        fp = memory_run_fingerprint(cfg, info)
        store.check_or_write_run(fp, defaults={"memory": "notebank"})
        valid, committed, problems = committed_documents(store, cfg.verify)
        # files no commit names (a write that never committed, a group just taken out) are deleted
        # now; a group redone below writes them again
        orphans = store.clean_unreferenced(valid, store.file_sizes(), lease)
        if orphans:
            problems.append(f"deleted {len(orphans)} data files that no commit record names (e.g. "
                            f"{store.url_of(orphans[0])}): left by a write that did not commit")
        for p in problems:
            log.warning("%s", p)
        scans = (ray.data.from_items([{"shard": s} for s in shards])
                 .map(_scan_corpus, num_cpus=0, compute=io_tasks(len(shards))).take_all())
        order = {s: i for i, s in enumerate(shards)}
        scans.sort(key=lambda sc: order[sc["shard"]])
        redo, notes = groups_to_retry(scans, valid, cfg) if getattr(cfg, "retry_failed", True) else ({}, [])
        for n in notes:
            log.warning("%s", n)
        problems += notes
        if redo:
            # a redone group is planned like one never committed: its record is set aside first (commit
            # records are create-only, pipeline/archive.py), and its files are written again at its commit
            for g in redo:
                store.invalidate(g)
            valid = {g: rec for g, rec in valid.items() if g not in redo}
            committed = documents_of(valid)
        plan, counts = plan_groups(scans, valid, committed, cfg, {g: r["retried"] for g, r in redo.items()})
        stats = dict(docs_ok=0, docs_skipped=counts.get("skipped", 0), docs_failed=0, tokens=0, notes=0, bytes=0,
                     groups=sum(len(g) for g in plan.values()), shards=len(shards), shards_failed=0,
                     docs_retried=sum(len(r["retried"]) for r in redo.values()),
                     docs_retried_ok=0,
                     docs_rewritten=sum(len(r["rewritten"]) for r in redo.values()),
                     groups_redone=len(redo))
        failures = []
        for sc in scans:
            if sc["shard_error"]:
                stats["shards_failed"] += 1
                failures.append({"shard": sc["shard"], "error": f"shard unreadable: {sc['shard_error']}",
                                 "doc_id": None, "source": {"shard": sc["shard"]}})
                store.atomic_write(f"manifest/shards/{shard_slug(sc['shard'])}.json", json.dumps(
                    {"shard": sc["shard"], "status": "failed", "error": sc["shard_error"],
                     "rows_read": len(json.loads(sc["rows"]))}, indent=1).encode())
        total = sum(len(rows) for g in plan.values() for rows in g.values())
        bar = progress_bar(cfg.progress, total, "doc", "ingest")
        if plan:
            # one read task and one block per group: the actor pool gets as many inputs as groups
            items = [{"shard": s, "group": g, "seek": json.dumps(counts["seeks"][(s, g)]), "plan": json.dumps(rows)}
                     for s, groups in plan.items() for g, rows in groups.items()]
            ds = ray.data.from_items(items, override_num_blocks=len(items))
            ds = ds.flat_map(_read_groups, num_cpus=0, compute=io_tasks(len(items)))
            # Ray Data restarts dead actors and retries their batches without limit (its defaults)
            remote = {"accelerator_type": cfg.actors.accelerator_type} if cfg.actors.accelerator_type else {}
            from notebank.pipeline.actors import IngestActor
            ds = ds.map_batches(
                IngestActor, batch_size=1, compute=ray.data.ActorPoolStrategy(size=cfg.actors.num_actors), num_cpus=cfg.actors.num_cpus,
                num_gpus=cfg.actors.num_gpus or None,
                fn_constructor_kwargs=dict(model=model, nb=cfg.notebank.to_dict(), block_size=cfg.block_size,
                                           output=cfg.output, fp_digest=fingerprint_digest(fp),
                                           tokenizer_name=info.get("tokenizer_name"),
                                           torch_threads=cfg.actors.torch_threads or max(1, int(cfg.actors.num_cpus)),
                                           piece_bytes=int(cfg.state_piece_mib) << 20,
                                           expect_fingerprint=info["fingerprint"], memory=cfg.memory,
                                           mone_adapters=adapters),
                **remote)
            for batch in ds.iter_batches(batch_size=None, batch_format="pandas"):
                for rec in batch.to_dict("records"):
                    _tally(stats, failures, rec)
                    bar.update(1)
                    if on_commit:
                        on_commit(rec)
                el = time.perf_counter() - t_start
                bar.set_postfix(tokens=stats["tokens"], tok_s=f"{stats['tokens'] / max(el, 1e-9):.0f}", refresh=False)
        bar.close()
        # every batch is committed: temporaries left now are orphans of an actor killed mid-write
        # (Ray Data retried its batch elsewhere); the run holds the lease, so no writer is live
        store.clean_tmp()
    wall = time.perf_counter() - t_start
    return {**stats, "docs_deferred": counts.get("deferred", 0), "memory": cfg.memory, "wall_s": round(wall, 3),
            "tokens_per_s": round(stats["tokens"] / wall, 1) if wall > 0 else 0.0, "output": cfg.output,
            "problems": problems[:20], "failures": failures[:20]}


def _tally(stats: dict, failures: list, rec: dict) -> None:
    st = rec["status"]
    if st == "ok" and rec.get("retried"):
        stats["docs_retried_ok"] += 1
    if st == "ok":
        stats["docs_ok"] += 1
        stats["tokens"] += int(rec["n_tokens"] or 0)
        stats["notes"] += int(rec["n_notes"] or 0)
    elif st == "skipped":
        stats["docs_skipped"] += 1
    else:
        stats["docs_failed"] += 1
        if len(failures) < 20:
            failures.append({"doc_id": rec["doc_id"], "error": rec["error"],
                             "source": {"shard": rec["source_shard"], "row": int(rec["source_row"])}})
    stats["bytes"] += int(rec["bytes"] or 0)


def _scan_corpus(item):
    from notebank.pipeline.corpus import scan_corpus_shard
    return scan_corpus_shard(item)


def _read_groups(item):
    from notebank.pipeline.corpus import read_corpus_group
    return read_corpus_group(item)


def _model_dict(spec) -> dict:
    import dataclasses
    return dataclasses.asdict(spec)


# ------------------------------------------------------------------------------------------------
# query

def existing_answers(out: Archive) -> tuple[set, dict, list[str]]:
    """-> (pairs answered ok, {failed pair: [parts holding its failed rows]}, problems) of the answers
    dataset; (question_id, method) pairs. A pair answered ok anywhere counts as ok. Unreadable parts
    are set aside (their answers are redone)."""
    from notebank.schemas._base import read_parquet_file
    ok, failed, problems = set(), defaultdict(list), []
    if not out.fs.exists(out.root):
        return ok, {}, problems
    for p in sorted(out.fs.ls(out.root, detail=False)):
        name = p.rsplit("/", 1)[-1]
        if not (name.startswith("part-") and name.endswith(".parquet")):
            continue
        try:
            with out.fs.open(p, "rb") as f:
                t = read_parquet_file(f, columns=["question_id", "method", "status"])
        except Exception as e:  # noqa: BLE001 - a damaged part: recomputed
            problems.append(f"{out.fs.unstrip_protocol(p)}: unreadable ({type(e).__name__}), its answers are redone")
            out.fs.mv(p, p + ".damaged")
            continue
        for q, m, st in zip(t.column("question_id").to_pylist(), t.column("method").to_pylist(),
                            t.column("status").to_pylist()):
            if st == "ok":
                ok.add((q, m))
            elif p not in failed[(q, m)]:
                failed[(q, m)].append(p)
    return ok, {k: v for k, v in failed.items() if k not in ok}, problems


def plan_questions(scans: list[dict], done: set, committed: dict, methods: list[str]):
    """-> ({shard: {row: [methods]}}, rejected rows, counters, {(question_id, method) pairs planned
    (to answer or to record as rejected)})."""
    keep: dict[str, dict] = {}
    rejected, seen = [], {}
    counts = defaultdict(int)
    planned: set = set()

    def reject(r: dict) -> None:
        rejected.append(r)
        planned.update((str(r["question_id"]), m) for m in (r.get("methods") or ["-"]))

    for sc in scans:
        shard = sc["shard"]
        if sc["shard_error"]:
            reject({"question_id": f"<{shard}>", "doc_id": "", "error": f"shard unreadable: {sc['shard_error']}",
                    "source_shard": shard, "source_row": -1})
        for row, qid, did, err in json.loads(sc["rows"]):
            counts["rows"] += 1
            src = {"source_shard": shard, "source_row": row}
            if err:
                if (qid or f"<row {row}>", "-") in done:
                    continue
                reject({"question_id": qid or f"<row {row}>", "doc_id": did or "",
                        "error": f"bad question row ({shard}:{row}): {err}", **src})
                continue
            if qid in seen:
                if (qid, "-") in done:
                    continue                                # recorded by an earlier run
                reject({"question_id": qid, "doc_id": did, "error": f"duplicate question_id (first seen at "
                        f"{seen[qid]}); this row was not answered", **src})
                continue
            seen[qid] = f"{shard}:{row}"
            missing = [m for m in methods if (qid, m) not in done]
            if not missing:
                counts["already_answered"] += 1
                continue
            if did not in committed or "damaged" in committed[did]:
                why = committed[did]["damaged"] if did in committed else \
                    f"document {did!r} is not archived (or failed at ingest)"
                reject({"question_id": qid, "doc_id": did, "methods": missing, "error": why, **src})
                continue
            keep.setdefault(shard, {})[str(row)] = missing
            planned.update((qid, m) for m in missing)
            counts["to_answer"] += 1
    return keep, rejected, dict(counts), planned


def drop_failed_rows(out: Archive, failed: dict, pairs: set) -> int:
    """Remove the failed rows of `pairs` from the answers parts that hold them (a part left empty is
    deleted) -> rows removed. Done before the pairs are answered again, so the dataset never holds
    two rows for one pair; a run killed in between leaves the pairs missing, and the next run answers
    them like any missing pair."""
    import pyarrow as pa
    from notebank.schemas._base import read_parquet_file

    from notebank.schemas._base import table_to_parquet_bytes
    by_part: dict[str, set] = defaultdict(set)
    for pair in pairs:
        for part in failed.get(pair, ()):
            by_part[part].add(pair)
    removed = 0
    for part, drop in sorted(by_part.items()):
        with out.fs.open(part, "rb") as f:
            t = read_parquet_file(f)
        q, m, st = (t.column(c).to_pylist() for c in ("question_id", "method", "status"))
        mask = pa.array([not (s != "ok" and (a, b) in drop) for a, b, s in zip(q, m, st)])
        kept = t.filter(mask)
        removed += t.num_rows - kept.num_rows
        rel = posixpath.relpath(part, out.root)
        if kept.num_rows:
            out.atomic_write(rel, table_to_parquet_bytes(kept))     # the part's own schema (v2 or v3) kept
        else:
            out.fs.rm_file(part)
    return removed


def query_dataset(cfg) -> dict:
    import ray

    from notebank.pipeline.actors import QueryActor
    from notebank.pipeline.query import write_rejected
    from notebank.pipeline.safety import acquire_lease, check_no_escape, check_query_output
    t_start = time.perf_counter()
    _require_shared_store(cfg.output, "output")
    check_no_escape(cfg.output, ["_lease.json"])
    check_query_output(cfg.output, cfg.archive or None)
    fs, q_paths = list_shards(cfg.questions)
    qshards = [fs.unstrip_protocol(p) for p in q_paths]
    if cfg.onepass:
        # one-pass: no archive; a run record of what the answers depend on (the writer config)
        fs_c, c_paths = list_shards(cfg.corpus)
        cshards = [fs_c.unstrip_protocol(p) for p in c_paths]
        store = None
        run = {"fingerprint": {"notebank": cfg.notebank.to_dict() if cfg.memory == "notebank" else None}}
    else:
        _require_shared_store(cfg.archive, "archive")
        store = Archive(cfg.archive)
        store.check_layout()
        run = store.read_run()
        if run is None:
            raise FileNotFoundError(f"{cfg.archive}: not an ingest output (no manifest/_run.json)")
        _check_memory(store, run, cfg.memory, "query")
    out = Archive(cfg.output)
    with acquire_lease(cfg.output, _run_info("query")) as lease:
        lease.start_heartbeat()
        quiet_ray_data(cfg.progress)
        out.clean_tmp()
        model, adapters = _portable_model(_model_dict(cfg.model), cfg.memory, cfg.mone_adapters)
        nb = run["fingerprint"].get("notebank")
        info = probe_model(model, cfg.actors, cfg.memory, adapters, nb)
        for what, mine in (("model", info["fingerprint"]), ("tokenizer", info.get("tokenizer"))):
            theirs = run["fingerprint"].get(what, mine)
            if mine != theirs:
                raise FingerprintMismatch(f"{store.url_of('manifest/_run.json')}: archives were written with {what} "
                                          f"{theirs!r}, but the configured {what} is {mine!r}")
        if cfg.onepass:
            committed, problems = corpus_locations(cshards), []
        else:
            _valid, committed, problems = committed_documents(store, verify=False, repair=False)
        ok_pairs, failed, p2 = existing_answers(out)
        problems += p2
        retry = getattr(cfg, "retry_failed", True)
        done = ok_pairs if retry else ok_pairs | set(failed)
        scans = ray.data.from_items([{"shard": s} for s in qshards]).map(_scan_questions, num_cpus=0,
                                                                         compute=io_tasks(len(qshards))).take_all()
        order = {s: i for i, s in enumerate(qshards)}
        scans.sort(key=lambda sc: order[sc["shard"]])
        methods = list(cfg.methods)
        keep, rejected, counts, planned = plan_questions(scans, done, committed, methods)
        # failed pairs answered again: their old rows go first (one row per pair, at every moment)
        retried = planned & set(failed)
        if retried:
            n = drop_failed_rows(out, failed, retried)
            log.info("retrying %d failed (question_id, method) pairs (%d old rows removed)", len(retried), n)
        provenance = {"archive": cfg.archive or None, "model_fingerprint": info["fingerprint"],
                      "notebank": json.dumps(nb, sort_keys=True) if nb is not None else None}
        stats = {"questions_ok": 0, "questions_failed": 0, "rows": 0, "already_answered": counts.get("already_answered", 0),
                 "questions_retried": len({q for q, _ in retried})}
        per_method: dict[str, list] = defaultdict(list)
        q_status: dict[str, bool] = {}
        if rejected:
            rows = write_rejected(out, rejected, methods, provenance, retried)
            for r in rows:
                q_status[r["question_id"]] = False
            stats["rows"] += len(rows)
        bar = progress_bar(cfg.progress, counts.get("to_answer", 0), "q", "query")
        if keep:
            needed, row_doc = {}, {}
            for sc in scans:
                for row, qid, did, err in json.loads(sc["rows"]):
                    if str(row) in keep.get(sc["shard"], {}) and did in committed:
                        row_doc[(sc["shard"], str(row))] = did
                        c = committed[did]
                        needed[did] = ({"text_at": c["text_at"]} if cfg.onepass else
                                       {k: c[k] for k in ("state", "notes_files", "generation", "n_tokens")})
            docs_ref = ray.put(needed)
            read = {k: v for k, v in _rc_fields(cfg.read).items() if k != "method"}
            if cfg.memory == "mone":                 # of `read`, MoNe uses these
                from nbcore.memory import MONE_READ_KEYS
                read = {k: v for k, v in read.items() if k in MONE_READ_KEYS}
            remote = {"accelerator_type": cfg.actors.accelerator_type} if cfg.actors.accelerator_type else {}
            again: dict[str, dict] = defaultdict(dict)      # {shard: {row: [methods retried]}}
            for sc in scans:
                for row, qid, did, err in json.loads(sc["rows"]):
                    ms = keep.get(sc["shard"], {}).get(str(row))
                    if ms and any((qid, m) in retried for m in ms):
                        again[sc["shard"]][str(row)] = [m for m in ms if (qid, m) in retried]
            # One row per document (all its question rows, as JSON), grouped by the read tasks from the
            # driver's plan (question ids only): no shuffle. A Ray Data groupby's hash shuffle runs
            # beside the actor pool and, on a small cluster (ray.num_cpus=1), waits forever for the
            # CPUs the actors hold.
            reads = document_reads(keep, row_doc)
            docs = (ray.data.from_items([{"reads": json.dumps(r), "retried": json.dumps({s: again.get(s, {}) for s in r})}
                                         for r in reads], override_num_blocks=len(reads))
                    .flat_map(_read_document_questions, num_cpus=0, compute=io_tasks(len(reads))))
            ds = docs.map_batches(
                QueryActor, batch_size=1, compute=ray.data.ActorPoolStrategy(size=cfg.actors.num_actors),
                num_cpus=cfg.actors.num_cpus, num_gpus=cfg.actors.num_gpus or None,
                fn_constructor_kwargs=dict(model=model, archive=cfg.archive, output=cfg.output, read=read, nb=nb,
                                           docs_ref=[docs_ref], provenance=provenance,
                                           torch_threads=cfg.actors.torch_threads or max(1, int(cfg.actors.num_cpus)),
                                           memory=cfg.memory, mone_adapters=adapters, block_size=cfg.block_size),
                **remote)
            seen_q = set()
            for batch in ds.iter_batches(batch_size=None, batch_format="pandas"):
                for rec in batch.to_dict("records"):
                    stats["rows"] += 1
                    ok = rec["status"] == "ok"
                    q_status[rec["question_id"]] = q_status.get(rec["question_id"], True) and ok
                    if rec.get("score") is not None and rec["score"] == rec["score"]:
                        per_method[rec["method"]].append(float(rec["score"]))
                    if rec["question_id"] not in seen_q:
                        seen_q.add(rec["question_id"])
                        bar.update(1)
        bar.close()
    stats["questions_ok"] = sum(q_status.values())
    stats["questions_failed"] = sum(not v for v in q_status.values())
    return {**stats, "wall_s": round(time.perf_counter() - t_start, 3), "output": cfg.output,
            "metric": "nbcore.tasks.ruler.string_match_all" if per_method else None,
            "mean_score": {m: round(sum(v) / len(v), 4) for m, v in sorted(per_method.items())},
            "n_scored": {m: len(v) for m, v in sorted(per_method.items())}, "problems": problems[:20],
            "failures": [{"question_id": r["question_id"], "error": r["error"]} for r in rejected[:20]]}


def corpus_locations(shards: list[str]) -> dict:
    """One-pass mode: {doc_id: {"text_at": {shard, seek, row}}} of a corpus (first row of each id wins);
    rows without a usable id or text are left out (their questions get error rows)."""
    import ray
    scans = ray.data.from_items([{"shard": s} for s in shards]).map(_scan_corpus, num_cpus=0,
                                                                                compute=io_tasks(len(shards))).take_all()
    order = {s: i for i, s in enumerate(shards)}
    scans.sort(key=lambda sc: order[sc["shard"]])
    out: dict = {}
    for sc in scans:
        for row, doc_id, sha, err, at in json.loads(sc["rows"]):
            if doc_id is not None and not err and doc_id not in out:
                out[doc_id] = {"text_at": {"shard": sc["shard"], "seek": at, "row": row}, "shas": {sha}}
    return out


def _rc_fields(rc) -> dict:
    import dataclasses
    d = dataclasses.asdict(rc)
    d["stop"] = list(d.get("stop") or ())
    return d


def document_reads(keep: dict, row_doc: dict) -> list[dict]:
    """The read items of a query: {shard: {row: methods}} each, such that every document's planned
    rows are in exactly one item. One item per shard for the documents whose questions are all in
    that shard; one more for the documents whose questions span shards (it reads those shards)."""
    shards_of: dict = defaultdict(set)
    for (shard, row), did in row_doc.items():
        shards_of[did].add(shard)
    per_shard: dict = defaultdict(dict)
    spanning: dict = defaultdict(dict)
    for shard, rows in keep.items():
        for row, methods in rows.items():
            did = row_doc.get((shard, row))
            if did is None:
                continue
            (per_shard[shard] if len(shards_of[did]) == 1 else spanning[shard])[row] = methods
    items = [{s: rows} for s, rows in per_shard.items()]
    return items + ([dict(spanning)] if spanning else [])


def _read_document_questions(item) -> list[dict]:
    """One read item -> one row per document: doc_id + all its planned question rows as JSON."""
    from notebank.pipeline.corpus import read_question_rows
    by_doc: dict = defaultdict(list)
    again = json.loads(item.get("retried") or "{}")       # {shard: {row: [methods retried]}}
    for shard, rows in json.loads(item["reads"]).items():
        for q in read_question_rows({"shard": shard, "keep": json.dumps(rows),
                                     "retried": json.dumps(again.get(shard, {}))}):
            by_doc[q["doc_id"]].append(q)
    return [{"doc_id": d, "questions": json.dumps(qs)} for d, qs in by_doc.items()]


def _scan_questions(item):
    from notebank.pipeline.corpus import scan_question_shard
    return scan_question_shard(item)


