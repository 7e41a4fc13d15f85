"""RULER synthetic tasks (NVIDIA/RULER scripts/data/synthetic/{niah,common_words_extraction,
freq_words_extraction}.py, constants.py, scripts/synthetic.yaml), re-implemented for NoteBank.

Faithful to RULER: needle sentence, task templates and answer prefixes (including the singular
rewrite when one value is asked), ``num_needle_k = max(k, q)``, noise needles at random line
positions, essay needles at sentence boundaries at depths drawn from 40 evenly spaced depths,
query wording ("a, b, c, and d"), 7-digit numbers, uuid4 values, ``string_match_all`` scoring.

Deliberate differences (why):
* Sizing is arithmetic, not RULER's binary search: the project tokenizer's pre-tokenizer splits at
  spaces/newlines/punctuation, so token counts add up piece by piece; we tokenize each haystack
  unit once and size with prefix sums. A 1M-token example takes seconds. The *input*
  (context + question) is sized to within 1% of the target (RULER sizes input + generation
  budget <= target).
* Keys: adjective-noun pairs from our own word lists (RULER uses wonderwords' lists), split into
  disjoint train/test keys by a fixed seeded permutation, so trained backbones never saw a test key.
* Essay haystack: the shipped prose (from Debian's ``fortunes`` collection, see ``haystack``), not Paul Graham.
* The essay haystack starts at word 0 for the test split (as RULER) and at a seeded offset for the
  train split (more varied training prose).
"""
from __future__ import annotations

import math
import random
import re
import uuid
from dataclasses import dataclass

import numpy as np

from nbcore.tasks import haystack as hs

ADJECTIVES = tuple("""
able absent acidic active adorable agile airy alert amber ancient angry anxious arctic aromatic
ashamed awesome bald barren basic bitter blissful bold bony brave breezy brief bright brisk broad
bumpy busy calm careful cheerful chilly clever cloudy clumsy coarse cold colossal cool cosmic cozy
crazy creamy crisp crooked cruel curly curious damp dark dazzling deep delicate dense dizzy dry
dusty eager early earthy elated elegant empty enormous fancy fast fierce filthy flat fluffy foggy
fragile frantic fresh friendly frozen funny fuzzy gentle giant giddy glossy golden graceful grand
greasy green grumpy hairy handsome happy harsh hasty heavy hidden hollow honest hot huge humble
hungry icy idle jolly juicy keen kind lazy lean little lively lonely loud lucky lush mellow messy
mighty misty modern moist muddy narrow nasty neat nervous noble noisy odd oily old orange pale
plain playful polite proud purple quick quiet rapid rare raspy rich rigid ripe rough round rowdy
rusty sad salty sandy scary shaggy sharp shiny short shy silent silky silly sleepy slimy slow small
smooth soft solid sour spicy spiky spotty steep sticky stormy strange strong sturdy sunny sweet
swift tall tame tart tender thick thin thirsty tidy tiny tired tough upbeat vast velvet vivid warm
wary weak wet wicked wide wild windy wise witty wooden yellow young zany zealous
""".split())

NOUNS = tuple("""
acorn airport anchor ant apple apron arrow attic avocado badge bagel bakery balloon bamboo banana
banjo barn basket beach beacon bean bear beetle bell bench bicycle biscuit blanket boat bottle
boulder bracelet bread bridge broom bucket buffalo butter button cabin cactus camel candle canoe
canyon carpet carrot castle cat cave cherry chimney circus cloud clover coconut comet compass
cookie copper cottage crayon crow crystal cucumber curtain daisy desert diamond dolphin donkey
dragon drum eagle elbow engine falcon feather fence fiddle finger fjord flute forest fountain fox
garden garlic giraffe glacier goat guitar hammer harbor hat hedge helmet honey horse island jacket
jaguar jungle kettle kitten ladder lagoon lamp lantern lemon lizard lobster magnet mango marble
meadow melon mirror monkey moon mountain mushroom needle nest noodle oak ocean olive onion orchard
otter owl paddle panda parrot peach pebble pencil penguin pepper piano pigeon pillow pine planet
plum pocket pony potato pumpkin puzzle quilt rabbit radish raven ribbon river robot rocket saddle
salmon sandal scarf shadow shell shovel sled snail sparrow spider spoon squirrel statue storm
sugar sunflower swan table teapot temple thistle thunder tiger toast tomato tower tractor trumpet
tulip turtle umbrella valley violin volcano wagon walnut whale whistle willow window wizard wolf
yacht zebra
""".split())

SPLIT_SEED = 20261129  # fixed: the train/test key split never changes
TEST_FRACTION = 0.2
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_HEAD = ("Some special magic {type_needle_v} are hidden within the following text. "
             "Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.")
NIAH_QUESTION = "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.")
CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_HEAD = ("Read the following coded text and track the frequency of each coded word. "
            "Find the three most frequently appeared coded words.")
FWE_QUESTION = ("Question: Do not provide any explanation. Please ignore the dots '....'. "
                "What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
DEPTHS = [int(x) for x in np.round(np.linspace(0, 100, num=40, endpoint=True))]


@dataclass(frozen=True)
class NiahSpec:
    """One RULER NIAH configuration (scripts/synthetic.yaml)."""
    haystack: str  # "noise" | "essay"
    type_k: str  # "words"
    type_v: str  # "numbers" | "uuids"
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1
    tokens_to_generate: int = 128


@dataclass(frozen=True)
class OtherSpec:
    kind: str  # "cwe" | "fwe"
    tokens_to_generate: int


TASKS: dict[str, NiahSpec | OtherSpec] = {
    "niah_single_1": NiahSpec("noise", "words", "numbers"),
    "niah_single_2": NiahSpec("essay", "words", "numbers"),
    "niah_single_3": NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": NiahSpec("essay", "words", "numbers", num_k=4),
    "niah_multivalue": NiahSpec("essay", "words", "numbers", num_v=4),
    "niah_multiquery": NiahSpec("essay", "words", "numbers", num_q=4),
    "cwe": OtherSpec("cwe", 120),
    "fwe": OtherSpec("fwe", 50),
}
PAPER_SIX = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
             "niah_multiquery", "niah_multivalue")


# ----------------------------------------------------------------------------------------------
# keys and values

def all_keys() -> tuple[str, ...]:
    return tuple(sorted({f"{a}-{n}" for a in ADJECTIVES for n in NOUNS}))


_SPLITS: dict[str, tuple[str, ...]] = {}


def split_keys(split: str) -> tuple[str, ...]:
    """Disjoint train/test key sets from one fixed seeded permutation."""
    if not _SPLITS:
        keys = list(all_keys())
        random.Random(SPLIT_SEED).shuffle(keys)
        n_test = int(len(keys) * TEST_FRACTION)
        _SPLITS["test"] = tuple(keys[:n_test])
        _SPLITS["train"] = tuple(keys[n_test:])
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return _SPLITS[split]


def _value(rng: random.Random, type_v: str) -> str:
    if type_v == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if type_v == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(type_v)


def _niah_texts(spec: NiahSpec, query: str) -> tuple[str, str]:
    """(head, question) with RULER's singular rewrite when exactly one value is asked."""
    tv = spec.type_v
    head, question = NIAH_HEAD, "\n" + NIAH_QUESTION + NIAH_PREFIX
    if spec.num_q * spec.num_v == 1:
        def sing(t: str) -> str:
            t = t.replace("Some", "A").replace("are all", "is").replace("are", "is")
            return t.replace("answers", "answer")
        head, question, tv = sing(head), sing(question), tv[:-1]
    return head.format(type_needle_v=tv), question.format(type_needle_v=tv, query=query)


def template_strings() -> list[str]:
    """Every fixed template text (used to train the tokenizer)."""
    out = [NEEDLE.format(type_needle_v=v, key="k", value="1") for v in ("numbers", "uuids")]
    for spec in TASKS.values():
        if isinstance(spec, NiahSpec):
            h, q = _niah_texts(spec, "x")
            out += [h, q]
    out += [CWE_HEAD, CWE_QUESTION + CWE_PREFIX, FWE_HEAD, FWE_QUESTION + FWE_PREFIX]
    return out


# ----------------------------------------------------------------------------------------------
# token counting (cached per tokenizer)

_COUNT_CACHE: dict[int, tuple[object, dict[str, int]]] = {}


def _counter(tokenizer) -> dict[str, int]:
    entry = _COUNT_CACHE.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = (tokenizer, {})
        _COUNT_CACHE[id(tokenizer)] = entry
    return entry[1]


def count_tokens(tokenizer, texts: list[str]) -> list[int]:
    """Token counts of ``texts`` (memoised; batch-encodes the unseen ones)."""
    cache = _counter(tokenizer)
    todo = list({t for t in texts if t not in cache})
    if todo:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the transformers wrapper costs 3x the encoding itself
            fast = getattr(backend, "encode_batch_fast", backend.encode_batch)
            lens = [len(e.ids) for e in fast(todo, add_special_tokens=False)]
        else:
            lens = [len(x) for x in tokenizer(todo, add_special_tokens=False)["input_ids"]]
        for t, n in zip(todo, lens):
            cache[t] = n
    return [cache[t] for t in texts]


_NUMDOT = re.compile(r"[0-9]+\.?")


def _digits_are_single(tokenizer) -> bool:
    """True when ' ' + digits + '.' is one token per character (the project tokenizer)."""
    probe = [" 9081726354.", " 1.", " 42"]
    return count_tokens(tokenizer, probe) == [len(p) - 1 for p in probe]


def n_tokens(tokenizer, text: str) -> int:
    """Exact token count of ``text`` without tokenizing it whole.

    The pre-tokenizer never joins pieces across a newline or before a single space, so the count
    is the sum of memoised counts of each line's first word and of every ' ' + word; a line with
    doubled/edge spaces is counted directly. 1M tokens take well under a second (tokenizing them
    whole takes ~30 s on this tokenizer).
    """
    lines = text.split("\n")
    total = len(lines) - 1  # the newline tokens
    firsts, rest, odd = [], [], []
    for line in lines:
        if not line:
            continue
        words = line.split(" ")
        if "" in words:
            odd.append(line)
            continue
        firsts.append(words[0])
        rest.extend(words[1:])
    total += sum(count_tokens(tokenizer, firsts)) + sum(count_tokens(tokenizer, odd))
    uniq: dict[str, int] = {}
    for w in rest:
        uniq[w] = uniq.get(w, 0) + 1
    if _digits_are_single(tokenizer):  # CWE's "12345." entries: one token per character
        for w in [w for w in uniq if _NUMDOT.fullmatch(w)]:
            total += len(w) * uniq.pop(w)
    keys = list(uniq)
    for w, c in zip(keys, count_tokens(tokenizer, [" " + w for w in keys])):
        total += c * uniq[w]
    return total


_ESSAY_PREFIX: dict[int, tuple[object, np.ndarray]] = {}


def _essay_cumsum(tokenizer) -> np.ndarray:
    """cum[i] = tokens of the first i corpus words, each counted as ' ' + word."""
    hit = _ESSAY_PREFIX.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        words = hs.essay_words()
        uniq = sorted(set(words))
        counts = dict(zip(uniq, count_tokens(tokenizer, [" " + w for w in uniq])))
        per = np.array([counts[w] for w in words], dtype=np.int64)
        hit = (tokenizer, np.concatenate([[0], np.cumsum(per)]))
        _ESSAY_PREFIX[id(tokenizer)] = hit
    return hit[1]


def _essay_words_for_budget(tokenizer, start: int, budget: int) -> int:
    """Largest word count whose ' '-joined tokens starting at word ``start`` fit ``budget``."""
    cum = _essay_cumsum(tokenizer)
    n, total = len(cum) - 1, int(cum[-1])
    start %= n
    # tokens of words [start, start+m) in the cyclic corpus, via prefix sums
    first = int(cum[n] - cum[start])  # rest of the first cycle
    if budget < first:
        return int(np.searchsorted(cum, cum[start] + budget, side="right") - 1 - start)
    m = n - start
    budget -= first
    full = budget // total
    m += full * n
    budget -= full * total
    m += int(np.searchsorted(cum, budget, side="right") - 1)
    return max(m, 0)


# ----------------------------------------------------------------------------------------------
# NIAH

def _make_niah(task: str, spec: NiahSpec, target: int, rng: random.Random, tokenizer,
               split: str) -> dict:
    num_k = max(spec.num_k, spec.num_q)
    keys = rng.sample(split_keys(split), num_k)
    needles, values = [], []
    for key in keys:
        vals = [_value(rng, spec.type_v) for _ in range(spec.num_v)]
        values.append(vals)
        needles += [NEEDLE.format(type_needle_v=spec.type_v, key=key, value=v) for v in vals]
    rng.shuffle(needles)
    idx = rng.sample(range(num_k), spec.num_q)
    queries = [keys[i] for i in idx]
    answers = [a for i in idx for a in values[i]]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    head, question = _niah_texts(spec, query)
    fixed = sum(count_tokens(tokenizer, [head, question])) + 1  # +1: "\n" after head

    if spec.haystack == "noise":
        t_noise, *t_needles = count_tokens(tokenizer, [hs.NOISE] + needles)
        # lines joined by "\n": N noise lines + needles -> (N + n - 1) newline tokens
        budget = target - fixed - sum(t_needles) - (len(needles) - 1)
        n_lines = max(budget // (t_noise + 1), len(needles))
        lines = [hs.NOISE] * n_lines
        for pos, nd in zip(sorted(rng.sample(range(n_lines), len(needles)), reverse=True), needles):
            lines.insert(pos, nd)
        body = "\n".join(lines)
    else:
        t_needles = count_tokens(tokenizer, [" " + nd for nd in needles])
        start = 0 if split == "test" else rng.randrange(len(hs.essay_words()))
        budget = target - fixed - sum(t_needles)
        n_words = _essay_words_for_budget(tokenizer, start, budget)
        sents = hs.split_sentences(hs.essay_slice(n_words, start))
        body = insert_needles(sents, needles, rng)
    context = head + "\n" + body
    return _finish(task, context, question, answers, target, tokenizer, needles=needles,
                   extra={"queries": queries, "keys": keys})


def insert_needles(sents: list[str], needles: list[str], rng) -> str:
    """The sentences with each needle after the sentence at a depth drawn from DEPTHS (RULER's
    sentence-boundary insertion), space-joined."""
    cuts = [0] + sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
    cuts.append(len(sents))
    parts = []
    for i in range(1, len(cuts)):
        chunk = " ".join(sents[cuts[i - 1]:cuts[i]])
        if chunk:
            parts.append(chunk)
        if i - 1 < len(needles):
            parts.append(needles[i - 1])
    return " ".join(parts)


def _finish(task, context, question, answers, target, tokenizer, needles=(), extra=None) -> dict:
    spans = []
    for nd in needles:  # needles are unique strings (distinct keys/values), find in order
        s = context.find(nd)
        spans.append([s, s + len(nd)])
    spans.sort()
    ex = {"task": task, "context": context, "question": question, "answers": list(answers),
          "length_target": target, "n_tokens": n_tokens(tokenizer, context + question),
          "needle_spans": spans}
    if extra:
        ex.update(extra)
    return ex


# ----------------------------------------------------------------------------------------------
# CWE / FWE

def _cwe_vocab() -> tuple[str, ...]:
    """Distinct lowercase words: the prose vocabulary, then the key words (RULER: wonderwords)."""
    words = set()
    if hs.essay_available():
        words = {w for w in re.findall(r"(?<![A-Za-z'-])[a-z]{3,}(?![A-Za-z'-])", hs.essay_text())}
    words |= set(ADJECTIVES) | set(NOUNS)
    return tuple(sorted(words))


def _cwe_list(rng: random.Random, vocab, n_words: int, rep_c: int, rep_u: int, n_common=10,
              order=None):
    """RULER's list: 10 common words x rep_c + the rest x rep_u, shuffled; ``order`` is a fixed
    permutation of the pool (so word choice for n is a prefix, which makes sizing arithmetic)."""
    pool = vocab if n_words <= len(vocab) else all_keys()
    chosen = list(order[:n_words]) if order is not None else rng.sample(pool, min(n_words, len(pool)))
    common, uncommon = chosen[:n_common], chosen[n_common:]
    lst = common * rep_c + uncommon * rep_u
    rng.shuffle(lst)
    return lst, common


def _numbered(lst) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst))


def _digits_upto(m: int) -> int:
    """Total decimal digits of 1..m."""
    total, d, lo = 0, 1, 1
    while lo <= m:
        hi = min(m, lo * 10 - 1)
        total += (hi - lo + 1) * d
        d, lo = d + 1, lo * 10
    return total


def _make_cwe(task, spec, target, rng, tokenizer, split) -> dict:
    vocab = _cwe_vocab()
    small = target < 4096
    shot_args = (20, 3, 1) if small else (40, 10, 3)
    rep_c, rep_u = (6, 1) if small else (30, 3)
    shot_list, shot_ans = _cwe_list(rng, vocab, *shot_args)
    shot = (CWE_HEAD + "\n" + _numbered(shot_list) + "\n" + CWE_QUESTION + CWE_PREFIX + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_ans)))
    head = shot + "\n" + CWE_HEAD
    question = "\n" + CWE_QUESTION + CWE_PREFIX
    budget = target - n_tokens(tokenizer, head + "\n" + question)
    # entry i is " {i}. {word}": digits + "." + tokens(" " + word); choose n by bisection on the
    # closed form (prefix sums over one fixed permutation of the pool)
    big = budget // 3 > len(vocab)
    pool = list(all_keys() if big else vocab)
    rng.shuffle(pool)
    tw = np.array(count_tokens(tokenizer, [" " + w for w in pool]), dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(tw)])

    def cost(n):
        m = 10 * rep_c + (n - 10) * rep_u
        return _digits_upto(m) + m + rep_c * int(cum[10]) + rep_u * int(cum[n] - cum[10])

    lo, hi = 11, len(pool)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
    lst, answers = _cwe_list(rng, vocab, lo, rep_c, rep_u, order=pool)
    context = head + "\n" + _numbered(lst)
    return _finish(task, context, question, answers, target, tokenizer)


def _make_fwe(task, spec, target, rng, tokenizer, split, alpha=2.0, wordlen=6) -> dict:
    budget_all = target - spec.tokens_to_generate
    vocab_size = max(budget_all // 50, 10)
    vocab = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=wordlen)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = "..."  # RULER: the top-ranked word is noise
    zeta = math.pi ** 2 / 6 if alpha == 2.0 else sum(k ** -alpha for k in range(1, 100000))
    ranks = np.arange(1, len(vocab) + 1, dtype=np.float64)
    t_words = np.array(count_tokens(tokenizer, [" " + w for w in vocab]), dtype=np.int64)
    question = "\n" + FWE_QUESTION + FWE_PREFIX
    fixed = sum(count_tokens(tokenizer, [FWE_HEAD, question]))
    budget = target - fixed

    def counts(n):
        return (n * ranks ** -alpha / zeta).astype(np.int64)

    lo, hi = 1, budget * 4
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int((counts(mid) * t_words).sum()) <= budget:
            lo = mid
        else:
            hi = mid - 1
    words = [w for w, c in zip(vocab, counts(lo)) for _ in range(int(c))]
    rng.shuffle(words)
    context = FWE_HEAD + " " + " ".join(words)
    return _finish(task, context, question, vocab[1:4], target, tokenizer)


# ----------------------------------------------------------------------------------------------
# public API

#: Task families outside RULER that reuse its keys, values, sizing and scoring. Each module has
#: ``TASKS`` (name -> spec) and ``generate(task, n_tokens_target, index, tokenizer, seed, split)``;
#: ``generate`` / ``score`` / ``is_task`` below find their tasks by name, so the ``ruler`` benchmark
#: (jobs/evaluate.py) and the lab curricula run them like RULER's own. RULER's ``TASKS`` stay as
#: they are (its examples do not change).
FAMILY_MODULES = ("nbcore.tasks.phrased",)


def _families():
    import importlib
    return [importlib.import_module(m) for m in FAMILY_MODULES]


def family_of(task: str):
    """The family module that defines ``task`` (not a RULER task); KeyError for an unknown name."""
    for mod in _families():
        if task in mod.TASKS:
            return mod
    raise KeyError(f"unknown task {task!r}: RULER tasks are {sorted(TASKS)}, others {sorted(other_tasks())}")


def other_tasks() -> list[str]:
    """Task names of the other families, in their modules' order."""
    return [t for mod in _families() for t in mod.TASKS]


def is_task(task: str) -> bool:
    """A RULER task or a task of another registered family."""
    return task in TASKS or task in other_tasks()


def generate(task: str, n_tokens_target: int, index: int, tokenizer, seed: int = 0,
             split: str = "test") -> dict:
    """One example; identical for identical (task, target, index, seed, split, tokenizer)."""
    if task not in TASKS:
        return family_of(task).generate(task, n_tokens_target, index, tokenizer, seed=seed, split=split)
    spec = TASKS[task]
    split_keys(split)  # validates split
    rng = random.Random(f"ruler|{task}|{n_tokens_target}|{index}|{seed}|{split}")
    if isinstance(spec, NiahSpec):
        ex = _make_niah(task, spec, n_tokens_target, rng, tokenizer, split)
    elif spec.kind == "cwe":
        ex = _make_cwe(task, spec, n_tokens_target, rng, tokenizer, split)
    else:
        ex = _make_fwe(task, spec, n_tokens_target, rng, tokenizer, split)
    ex["index"] = index
    return ex


def string_match_all(preds, refs) -> float:
    """RULER's metric: mean over references of case-insensitive substring presence, x100.

    ``refs`` is a list of reference lists (one per prediction); a flat list of strings is taken as
    the references of a single prediction.
    """
    if refs and isinstance(refs[0], str):
        refs = [refs]
    total = sum(sum(r.lower() in p.lower() for r in ref) / len(ref) for p, ref in zip(preds, refs))
    return round(total / len(preds) * 100, 2)


def score(task: str, prediction: str, answers) -> float:
    """0-100 score of one prediction (every RULER task here, and every other family's, uses
    string_match_all)."""
    if task not in TASKS:
        family_of(task)
    return string_match_all([prediction], [list(answers)])


def answer_text(answers) -> str:
    """Target continuation used for training after the answer prefix (e.g. ' 123, 456.')."""
    return " " + ", ".join(answers) + "."
