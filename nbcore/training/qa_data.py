"""QA data for NB-LoRA: a JSONL/Parquet loader, the NQ long-data importer (App. C.4) and a
synthetic generator for the tiny models.

Row format everywhere: {"context": str, "question": str, "answers": [str, ...]} plus optional
"target" (the exact supervised continuation; synthetic rows use RULER's answer text), "id",
"task", "supported", "split". Extra fields are kept.

Validation (`validate_row`): question must be a non-empty string; answers a non-empty list of
non-empty strings (a bare string is accepted as one answer); context a string (it may be empty
or shorter than C: the trainer then reads with an empty archive, as the paper does). Bad rows are
skipped and counted (`on_bad="skip"`, the default; the reasons are reported) or raise
`ValueError` naming the row (`on_bad="error"`).

NQ importer (`import_nq`), App. C.4: source rows of emozilla/Long-Data-Collections-Fine-Tune
(the Parquet copy of togethercomputer/Long-Data-Collections' fine-tune split; columns `text`,
`prompt`, `completion`; the NQ rows come from `natural_questions_10_200_docs`). An NQ row's prompt
is an instruction, `Document [i](Title: ...) passage` blocks and `Question: ...`; the completion is
`Answer: <short>\nLong Answer: <long>\nGold Document ID: <i>`. We keep rows whose short answer has
1-24 words; context = the prompt before `Question:` capped at 16,000 characters (cut back to a
whitespace); the question becomes `Question: <q>\nAnswer:`; answers = [short answer] with the
`Long Answer` / `Gold Document ID` trailer removed. `supported` = the answer string occurs in the
capped context (case-insensitive) or the gold passage survives the cap; no-support rows are kept
with their gold answers (the paper's 1,698 of 5,855). Rows that are not NQ-shaped (e.g. booksum)
are skipped and counted. Splits: a `split` column is preserved if present (else "train").
`select` draws the paper's 2,400 examples: shuffled once with seed 0, without replacement.

Synthetic (`synthetic_qa`): RULER NIAH examples from `nbcore.tasks.ruler` on the *train* key
split (disjoint from evaluation keys), target = RULER's answer continuation, which is exactly
what the tiny backbones were trained to emit.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

NQ_MAX_CONTEXT_CHARS = 16_000
NQ_MIN_WORDS, NQ_MAX_WORDS = 1, 24


@dataclass
class QAData:
    rows: list
    n_bad: int = 0
    reasons: dict = field(default_factory=dict)   # reason -> count
    source: str = ""

    def __len__(self) -> int:
        return len(self.rows)


def validate_row(row, where: str = "") -> dict:
    """-> normalised row, or ValueError with a clear reason."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: row is not an object")
    q = row.get("question")
    if not isinstance(q, str) or not q.strip():
        raise ValueError(f"{where}: missing or empty 'question'")
    ans = row.get("answers", row.get("answer"))
    if isinstance(ans, str):
        ans = [ans]
    if ans is not None and not isinstance(ans, list):
        try:
            ans = list(ans)                       # numpy arrays from Parquet
        except TypeError:
            ans = None
    if not ans or not all(isinstance(a, str) for a in ans):
        raise ValueError(f"{where}: 'answers' must be a non-empty list of strings")
    ans = [a for a in ans if a.strip()]
    if not ans:
        raise ValueError(f"{where}: empty answer")
    ctx = row.get("context", "")
    if ctx is None:
        ctx = ""
    if not isinstance(ctx, str):
        raise ValueError(f"{where}: 'context' must be a string")
    tgt = row.get("target")
    if tgt is not None and (not isinstance(tgt, str) or not tgt.strip()):
        raise ValueError(f"{where}: empty 'target'")
    out = dict(row)
    out.update(context=ctx, question=q, answers=ans)
    out.pop("answer", None)
    return out


def _open(src: str, mode: str = "rb"):
    import fsspec
    if src.endswith(".zst"):
        try:
            import zstandard  # noqa: F401
        except ImportError as e:
            raise ImportError(f"{src}: reading .zst needs the 'zstandard' package "
                              "(or pass the Parquet copy)") from e
    return fsspec.open(src, mode, compression="infer")


def _iter_raw(src: str):
    """Yield (where, row) from a JSONL/JSON-lines or Parquet file (local path or fsspec URL)."""
    base = re.sub(r"\.(gz|bz2|xz|zst)$", "", src)
    if base.endswith(".parquet"):
        from notebank.schemas._base import open_parquet_file
        with _open(src) as f:
            pf = open_parquet_file(f)
            i = 0
            for batch in pf.iter_batches(batch_size=256, use_threads=False):
                for row in batch.to_pylist():
                    i += 1
                    yield f"{src}:row {i}", row
        return
    with _open(src) as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{src}:{i}", e
                continue
            yield f"{src}:{i}", row


def expand_sources(src) -> list[str]:
    """A path/URL, a glob, a directory (its .jsonl/.json/.parquet files) or a list of those."""
    import fsspec
    if isinstance(src, (list, tuple)):
        return [s for x in src for s in expand_sources(x)]
    src = os.fspath(src)
    fs, path = fsspec.core.url_to_fs(src)
    proto = src.split("://", 1)[0] + "://" if "://" in src else ""
    if any(c in path for c in "*?["):
        files = sorted(fs.glob(path))
    elif fs.isdir(path):
        files = sorted(p for p in fs.find(path) if re.search(r"\.(jsonl|json|parquet)(\.(gz|zst|bz2|xz))?$", p))
    else:
        if not fs.exists(path):
            raise FileNotFoundError(f"QA data {src!r} not found")
        files = [path]
    if not files:
        raise FileNotFoundError(f"no .jsonl/.json/.parquet files under {src!r}")
    return [f if (not proto or f.startswith(proto)) else proto + f for f in files]


def load_qa(src, limit: int | None = None, on_bad: str = "skip") -> QAData:
    """Load QA rows (see module docstring). on_bad: "skip" (count and report) or "error"."""
    if on_bad not in ("skip", "error"):
        raise ValueError(f"on_bad must be 'skip' or 'error', got {on_bad!r}")
    rows, reasons, n_bad = [], {}, 0
    files = expand_sources(src)
    for f in files:
        for where, raw in _iter_raw(f):
            try:
                if isinstance(raw, Exception):
                    raise ValueError(f"{where}: invalid JSON ({raw.msg})")
                row = validate_row(raw, where)
            except ValueError as e:
                if on_bad == "error":
                    raise
                n_bad += 1
                reason = str(e).split(": ", 1)[-1]
                reasons[reason] = reasons.get(reason, 0) + 1
                continue
            row.setdefault("id", where)
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
        if limit is not None and len(rows) >= limit:
            break
    if n_bad:
        log.warning("load_qa(%s): skipped %d bad rows: %s", src, n_bad, reasons)
    return QAData(rows, n_bad, reasons, ",".join(files))


def write_jsonl(rows, dest: str) -> str:
    import fsspec
    dest = os.fspath(dest)
    fs, path = fsspec.core.url_to_fs(dest)
    parent = os.path.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fsspec.open(dest, "w", compression="infer") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return dest


def select(rows: list, n: int, seed: int = 0) -> list:
    """The paper's draw: shuffle once with `seed`, take the first n (without replacement)."""
    idx = list(range(len(rows)))
    random.Random(seed).shuffle(idx)
    return [rows[i] for i in idx[:n]]


# ---------------------------------------------------------------------------------------------
# NQ (Long-Data-Collections fine-tune) importer

_DOC_RE = re.compile(r"Document \[(\d+)\]")
_ANS_RE = re.compile(r"Answer:\s*(.*?)\s*(?=\n\s*Long Answer:|\n\s*Gold Document ID:|Gold Document ID:|$)", re.S)
_GOLD_RE = re.compile(r"Gold Document ID:\s*(\d+)")
_TRAILER_RE = re.compile(r"\s*(?:\(?\s*Gold Document ID:\s*\d+\s*\)?|\[\s*Document\s*\d+\s*\])\s*$")


def _cap(text: str, n: int) -> str:
    if len(text) <= n:
        return text
    cut = text[:n]
    ws = max(cut.rfind(" "), cut.rfind("\n"))
    return cut[:ws] if ws > n // 2 else cut


def parse_nq(row: dict) -> dict | None:
    """One Long-Data-Collections row -> {"question", "answer", "docs_text", "gold_id", "gold_passage"}
    or None when the row is not NQ-shaped."""
    prompt, completion = row.get("prompt"), row.get("completion")
    if not (isinstance(prompt, str) and isinstance(completion, str)):
        text = row.get("text")
        if not isinstance(text, str):
            return None
        q = text.rfind("Question:")
        if q < 0:
            return None
        a = text.find("Answer:", q)
        if a < 0:
            return None
        prompt, completion = text[:a], text[a:]
    q = prompt.rfind("Question:")
    if q < 0 or not _DOC_RE.search(prompt[:q]):
        return None
    docs_text = prompt[:q].rstrip()
    question = prompt[q + len("Question:"):]
    question = re.sub(r"\s*Answer:\s*$", "", question).strip()
    m = _ANS_RE.search(completion)
    if not question or not m:
        return None
    answer = _TRAILER_RE.sub("", m.group(1)).strip()
    g = _GOLD_RE.search(completion)
    gold_id = int(g.group(1)) if g else None
    gold_passage = None
    if gold_id is not None:
        marks = list(_DOC_RE.finditer(docs_text))
        for i, mk in enumerate(marks):
            if int(mk.group(1)) == gold_id:
                end = marks[i + 1].start() if i + 1 < len(marks) else len(docs_text)
                gold_passage = docs_text[mk.start():end].strip()
                break
    return {"question": question, "answer": answer, "docs_text": docs_text, "gold_id": gold_id,
            "gold_passage": gold_passage}


def nq_example(parsed: dict, max_context_chars: int = NQ_MAX_CONTEXT_CHARS) -> dict:
    ctx = _cap(parsed["docs_text"], max_context_chars)
    ans = parsed["answer"]
    gp = parsed["gold_passage"]
    supported = ans.lower() in ctx.lower() or (gp is not None and gp in ctx)
    return {"context": ctx, "question": f"Question: {parsed['question']}\nAnswer:", "answers": [ans],
            "supported": bool(supported), "gold_doc_id": parsed["gold_id"]}


def import_nq(src, dest: str | None = None, max_context_chars: int = NQ_MAX_CONTEXT_CHARS,
              min_words: int = NQ_MIN_WORDS, max_words: int = NQ_MAX_WORDS, n_select: int | None = None,
              seed: int = 0) -> dict:
    """Build the NQ-derived pool (and optionally the n_select draw). Returns stats and rows."""
    pool, stats = [], {"rows": 0, "not_nq": 0, "answer_words_out_of_range": 0, "kept": 0,
                       "supported": 0, "no_support": 0}
    for f in expand_sources(src):
        for where, raw in _iter_raw(f):
            stats["rows"] += 1
            if isinstance(raw, Exception):
                stats["not_nq"] += 1
                continue
            p = parse_nq(raw)
            if p is None:
                stats["not_nq"] += 1
                continue
            nw = len(p["answer"].split())
            if not min_words <= nw <= max_words:
                stats["answer_words_out_of_range"] += 1
                continue
            ex = nq_example(p, max_context_chars)
            ex["id"] = where
            ex["split"] = raw.get("split", "train") if isinstance(raw, dict) else "train"
            pool.append(ex)
            stats["kept"] += 1
            stats["supported" if ex["supported"] else "no_support"] += 1
    rows = select(pool, n_select, seed) if n_select else pool
    if n_select:
        stats["selected"] = len(rows)
        stats["selected_supported"] = sum(r["supported"] for r in rows)
    if dest:
        write_jsonl(rows, dest)
    return {"stats": stats, "rows": rows}


# ---------------------------------------------------------------------------------------------
# synthetic QA for the tiny backbones

def synthetic_example(tokenizer, i: int, tasks=None, lengths=(1024,), split: str = "train", seed: int = 0) -> dict:
    """Example i of the synthetic set (deterministic in (i, tasks, lengths, split, seed))."""
    from nbcore.tasks import ruler
    tasks = tuple(tasks or ruler.PAPER_SIX)
    task = tasks[i % len(tasks)]
    length = int(lengths[(i // len(tasks)) % len(lengths)])
    ex = ruler.generate(task, length, i, tokenizer, seed=seed, split=split)
    return {"id": f"{split}-{task}-{length}-{i}", "task": task, "length": length,
            "context": ex["context"], "question": ex["question"], "answers": list(ex["answers"]),
            "target": ruler.answer_text(ex["answers"]), "split": split}


class SyntheticRows(Sequence):
    """n synthetic examples generated on first access (workers touch only the rows they train on)."""

    def __init__(self, tokenizer, n: int, tasks=None, lengths=(1024,), split: str = "train", seed: int = 0):
        self.tokenizer, self.n, self.tasks, self.lengths = tokenizer, int(n), tasks, tuple(lengths)
        self.split, self.seed = split, seed
        self._cache: dict[int, dict] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        i %= self.n
        if i not in self._cache:
            self._cache[i] = synthetic_example(self.tokenizer, i, self.tasks, self.lengths, self.split, self.seed)
        return self._cache[i]


def synthetic_qa(tokenizer, n: int, tasks=None, lengths=(1024,), split: str = "train", seed: int = 0,
                 lazy: bool = False):
    """n RULER NIAH examples (round-robin over tasks, then lengths) on `split` keys."""
    try:
        from nbcore.tasks import ruler  # noqa: F401
    except ImportError:                         # pragma: no cover - ruler ships with nbcore
        return _simple_needles(n, lengths, split, seed)
    rows = SyntheticRows(tokenizer, n, tasks, lengths, split, seed)
    return rows if lazy else list(rows)


def _simple_needles(n, lengths, split, seed):   # pragma: no cover - fallback only
    from nbcore.testing import needle_text
    rows = []
    for i in range(n):
        L = lengths[i % len(lengths)]
        text, needles = needle_text(L, 1, seed=hash((seed, split, i)) & 0xFFFF)
        key, val = needles[0]
        q = f"\nWhat is the special magic number for {key}? The special magic number for {key} is"
        rows.append({"id": f"{split}-simple-{i}", "context": text, "question": q, "answers": [val],
                     "target": f" {val}.", "split": split})
    return rows


def main(argv=None) -> int:
    """python -m nbcore.training.qa_data nq SRC DEST [--select 2400 --seed 0]   (App. C.4 pool / draw)"""
    import argparse
    p = argparse.ArgumentParser(description="NB-LoRA QA data tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    nq = sub.add_parser("nq", help="import NQ-derived rows of emozilla/Long-Data-Collections-Fine-Tune")
    nq.add_argument("src", nargs="+", help="Parquet/JSONL files, folders or globs (fsspec URLs)")
    nq.add_argument("dest", help="output JSONL (fsspec URL)")
    nq.add_argument("--select", type=int, default=None, help="draw this many (paper: 2400), seed --seed")
    nq.add_argument("--seed", type=int, default=0)
    nq.add_argument("--max-context-chars", type=int, default=NQ_MAX_CONTEXT_CHARS)
    args = p.parse_args(argv)
    out = import_nq(args.src, args.dest, max_context_chars=args.max_context_chars, n_select=args.select,
                    seed=args.seed)
    print(json.dumps(out["stats"]))
    return 0


__all__ = ["QAData", "load_qa", "validate_row", "write_jsonl", "expand_sources", "select", "parse_nq",
           "nq_example", "import_nq", "synthetic_qa", "synthetic_example", "SyntheticRows", "NQ_MAX_CONTEXT_CHARS"]


if __name__ == "__main__":
    raise SystemExit(main())
