"""Ingest throughput: NoteBank ingest vs plain prefill, 1 vs 2 actors, archive bytes vs paper Eq. 19.

    python bench/ingest_throughput.py                      # defaults: 6 docs x 8K tokens, small GDN
    python bench/ingest_throughput.py --docs 8 --doc-tokens 16384 --hidden 256 --layers 4

All numbers come from one run on a fresh local Ray:
  * NoteBank ingest (write=True: native features captured, notes selected, addresses built, archive
    and state serialised) vs plain prefill (write=False: the same blocks through the same backbone)
    on the SAME actors, same documents -> overhead ratio;
  * end-to-end `pipeline.ingest.run_ingest` (incl. manifest commits) with 1 and with 2 actors
    -> scaling ratio;
  * notes Parquet bytes per document vs Eq. 19, Storage = 2*N*J*d_rho + 4*U + 24*N bytes.
Results: bench/results/ingest_throughput-<UTC date>-<host>.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray  # noqa: E402

from nbcore import NoteBankConfig  # noqa: E402
from nbcore.testing import needle_text  # noqa: E402
from notebank.pipeline.config import ActorSpec, IngestJobConfig, ModelSpec  # noqa: E402
from notebank.pipeline.ingest import run_ingest  # noqa: E402
from notebank.pipeline.pool import dispatch, start_workers, stop_workers  # noqa: E402
from notebank.pipeline.store import ArchiveStore  # noqa: E402


def model_spec(a) -> ModelSpec:
    heads = max(1, a.hidden // 64)
    return ModelSpec(hf_config=dict(
        model_type="qwen3_5_text", vocab_size=262, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers, layer_types=["linear_attention"] * a.layers, linear_num_key_heads=heads,
        linear_num_value_heads=heads, linear_key_head_dim=64, linear_value_head_dim=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0), tokenizer="byte", device="cpu")


def timed(handles, docs, method, nb, block):
    t0 = time.perf_counter()
    out = []
    dispatch(handles, docs, lambda h, d: getattr(h, method).remote(*(
        ({"doc_id": d["doc_id"], "text": d["text"]}, nb, block) if method == "ingest_doc" else (d["text"], nb, block))),
        lambda d, r, e: out.append(r if e is None else {"error": str(e)}), max_in_flight=2)
    return time.perf_counter() - t0, out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--doc-tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--block-size", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=2, help="alternating NoteBank/plain passes per actor count")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = p.parse_args(argv)

    n_cpus = os.cpu_count() or 2
    ray.init(address="local", num_cpus=max(2, n_cpus), include_dashboard=False, log_to_driver=False)
    model = model_spec(a)
    nb = NoteBankConfig(chunk_size=a.chunk_size)
    docs = [{"doc_id": f"b{i}", "text": needle_text(a.doc_tokens, 4, seed=i)[0]} for i in range(a.docs)]
    tmp = tempfile.mkdtemp(prefix="nb-bench-")
    corpus = os.path.join(tmp, "corpus.jsonl")
    with open(corpus, "w") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    results = {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "host": socket.gethostname(), "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
               "cpus": n_cpus, "python": platform.python_version(), "ray": ray.__version__,
               "args": vars(a), "notebank": nb.to_dict(), "runs": {}}
    for n_actors in (1, 2):
        actors = ActorSpec(num_actors=n_actors, num_cpus=1, torch_threads=1)
        handles, infos = start_workers(model, actors)
        try:
            timed(handles, docs[:n_actors], "ingest_doc", nb.to_dict(), a.block_size)   # warm-up
            timed(handles, docs[:n_actors], "prefill_doc", nb.to_dict(), a.block_size)
            nb_s, pf_s, outs = [], [], None
            for _ in range(a.repeats):
                w, outs = timed(handles, docs, "ingest_doc", nb.to_dict(), a.block_size)
                nb_s.append(w)
                w, _ = timed(handles, docs, "prefill_doc", nb.to_dict(), a.block_size)
                pf_s.append(w)
            tokens = sum(o["n_tokens"] for o in outs)
            cfg = IngestJobConfig(corpus=corpus, output=os.path.join(tmp, f"out{n_actors}"), model=model,
                                  notebank=nb, block_size=a.block_size, actors=actors, progress=False)
            e2e = run_ingest(cfg, workers=(handles, infos))
        finally:
            stop_workers(handles)
        run = {"tokens": tokens, "notebank_s": min(nb_s), "plain_s": min(pf_s),
               "notebank_tok_s": tokens / min(nb_s), "plain_tok_s": tokens / min(pf_s),
               "overhead_ratio_notebank_over_plain": min(nb_s) / min(pf_s),
               "end_to_end": {k: e2e[k] for k in ("docs_ok", "tokens", "notes", "bytes", "wall_s", "tokens_per_s")}}
        if n_actors == 1:
            J = infos[0]["n_channels"]
            store = ArchiveStore(cfg.output)
            per_doc = []
            for key, rec in sorted(store.load_records().items()):
                eq19 = 2 * rec.n_notes * J * nb.addr_dim + 4 * rec.n_archived_tokens + 24 * rec.n_notes
                per_doc.append({"doc": key, "n_tokens": rec.n_tokens, "N": rec.n_notes, "U": rec.n_archived_tokens,
                                "J": J, "d_rho": nb.addr_dim, "eq19_bytes": eq19, "notes_parquet_bytes": rec.notes.size,
                                "state_bytes": rec.state.size})
            tot_eq = sum(d["eq19_bytes"] for d in per_doc)
            tot_pq = sum(d["notes_parquet_bytes"] for d in per_doc)
            results["archive_bytes"] = {"per_doc": per_doc, "eq19_total": tot_eq, "notes_parquet_total": tot_pq,
                                        "parquet_over_eq19": tot_pq / tot_eq if tot_eq else None}
        results["runs"][f"{n_actors}_actors"] = run
    r1, r2 = results["runs"]["1_actors"], results["runs"]["2_actors"]
    results["scaling_2_over_1_actors"] = {
        "notebank": r2["notebank_tok_s"] / r1["notebank_tok_s"], "plain": r2["plain_tok_s"] / r1["plain_tok_s"],
        "end_to_end": r2["end_to_end"]["tokens_per_s"] / r1["end_to_end"]["tokens_per_s"]}
    ray.shutdown()

    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"ingest_throughput-{results['date_utc'][:10]}-{results['host']}")
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    ab = results["archive_bytes"]
    md = [f"# Ingest throughput ({results['date_utc']}, {results['host']}, {n_cpus} CPUs, Ray {ray.__version__})", "",
          f"Command: `python bench/ingest_throughput.py {' '.join(argv or sys.argv[1:])}`  ",
          f"Model: random-init Qwen3.5 text, all linear_attention, hidden {a.hidden}, {a.layers} layers; "
          f"{a.docs} docs x ~{a.doc_tokens} tokens; NoteBank C={nb.chunk_size}, W={nb.write_budget}, "
          f"B={nb.note_budget}, d_rho={nb.addr_dim}; block {a.block_size}; 1 CPU and 1 torch thread per actor.", "",
          "| actors | NoteBank tok/s | plain prefill tok/s | NoteBank / plain time | end-to-end tok/s (with commits) |",
          "|---|---|---|---|---|"]
    for k, r in results["runs"].items():
        md.append(f"| {k.split('_')[0]} | {r['notebank_tok_s']:.0f} | {r['plain_tok_s']:.0f} | "
                  f"{r['overhead_ratio_notebank_over_plain']:.2f} | {r['end_to_end']['tokens_per_s']:.0f} |")
    s = results["scaling_2_over_1_actors"]
    md += ["", f"2 vs 1 actors: NoteBank x{s['notebank']:.2f}, plain x{s['plain']:.2f}, end-to-end x{s['end_to_end']:.2f}.",
           "", f"Archive bytes: notes Parquet {ab['notes_parquet_total']} B vs Eq. 19 {ab['eq19_total']} B "
           f"(ratio {ab['parquet_over_eq19']:.2f}; Parquet is zstd-compressed and carries schema metadata).", ""]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(md))
    print(json.dumps({"json": stem + ".json", "md": stem + ".md", **results["scaling_2_over_1_actors"],
                      "overhead_1_actor": r1["overhead_ratio_notebank_over_plain"],
                      "parquet_over_eq19": ab["parquet_over_eq19"]}))


if __name__ == "__main__":
    main()
