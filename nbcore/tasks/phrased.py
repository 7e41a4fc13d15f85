"""Phrased needle tasks: RULER-style single- and multi-key retrieval with needles and questions in
several natural phrasings and natural-prose haystacks, split into TRAIN and HELD-OUT phrasings and
prose sources.

Why: the shipped tiny models were trained on RULER's exact needle sentence ("One of the special
magic numbers for {key} is: {value}.") and read little else. These tasks measure (and the lab's
``phrasings`` curriculum trains) reading a fact stated in other words, inside other prose.

Everything but the wording and the haystack is RULER's (``nbcore.tasks.ruler``): adjective-noun keys
from its fixed train/test key split (``split``), 7-digit values, needles at sentence boundaries at
depths drawn from its 40 depths, the input (context + question) sized to the target token count
with the same arithmetic, the same example fields (``context``, ``question``, ``answers``,
``needle_spans``, ``queries``, ``keys``, ``n_tokens``, ...) and ``string_match_all`` scoring. Two
fields are added: ``phrasing`` (the family name) and ``prose`` (``fortunes`` or ``python-docs``).

* A *phrasing family* is a needle template, a question and an answer prefix; the question ends with
  the prefix, so a model answers by continuing it with the value (as RULER's does). There is no
  "special magic" header: the context is the prose with the needle(s) in it. The family of an
  example is ``families[index % len(families)]``, so n examples cover the families evenly.
* TRAIN phrasings (8) may be trained on; HELD-OUT phrasings (4) differ in wording throughout (no
  word trigram of a held-out template, with the placeholders as words, occurs in a TRAIN template
  or in RULER's; checked by the tests), and two of the twelve state the value before the key.
* TRAIN prose is the project prose (``haystack.essay_text``, Debian's fortunes, which every shipped
  model and the tokenizer were trained on); HELD-OUT prose is CPython documentation text
  (``docprose``), which no shipped model has seen. As in RULER, the test split starts the haystack at
  word 0 and the train split at a seeded offset.

Tasks (``TASKS``; ``nbcore.tasks.ruler.generate`` / ``score`` find them by name, so the ``ruler``
benchmark of jobs/evaluate.py and the lab curricula use them like RULER's own):

* ``phrased_niah_train``: one needle, TRAIN phrasings, TRAIN prose (what training sees);
* ``phrased_niah_heldout``: one needle, HELD-OUT phrasings, HELD-OUT prose (the generalisation test);
* ``phrased_niah_heldout_phrasing``: HELD-OUT phrasings in TRAIN prose (the phrasing alone);
* ``phrased_niah_heldout_prose``: RULER's own niah_single_2 format (header, needle, question) in
  HELD-OUT prose (the prose alone);
* ``phrased_multikey_train`` / ``phrased_multikey_heldout``: four needles of one family with four
  keys, one asked (RULER's niah_multikey_1 shape).

Only ``TRAIN_TASKS`` may appear in a training curriculum (lab/train_backbone.py refuses the others).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np

from nbcore.tasks import docprose
from nbcore.tasks import haystack as hs
from nbcore.tasks import ruler


@dataclass(frozen=True)
class Phrasing:
    """One phrasing family: ``needle`` has {key} and {value}; ``question`` and ``prefix`` have {key};
    ``prefix`` (starting with a space) is the start of the answer the model continues."""
    name: str
    needle: str
    question: str
    prefix: str


TRAIN_PHRASINGS: tuple[Phrasing, ...] = (
    Phrasing("access-code", "Remember: the access code for {key} is {value}.",
             "What is the access code for {key}?", " The access code for {key} is"),
    Phrasing("locker", "{key}'s locker combination reads {value}.",
             "What does the locker combination of {key} read?", " The locker combination of {key} reads"),
    Phrasing("ticket", "For the record, {key} was assigned ticket number {value}.",
             "Which ticket number was {key} assigned?", " {key} was assigned ticket number"),
    Phrasing("catalogue", "The archive lists {value} as the catalogue number of {key}.",   # value first
             "What catalogue number does the archive list for {key}?", " The catalogue number of {key} is"),
    Phrasing("extension", "Note that the phone extension of {key} is {value}.",
             "What is the phone extension of {key}?", " The phone extension of {key} is"),
    Phrasing("password", "If anyone asks, the secret password of {key} is {value}.",
             "What is the secret password of {key}?", " The secret password of {key} is"),
    Phrasing("ledger", "In the ledger, {key} has account {value}.",
             "Which account does {key} have in the ledger?", " In the ledger, {key} has account"),
    Phrasing("parcel", "The parcel addressed to {key} carries tracking number {value}.",
             "What tracking number does the parcel addressed to {key} carry?",
             " The parcel addressed to {key} carries tracking number"),
)

HELDOUT_PHRASINGS: tuple[Phrasing, ...] = (
    Phrasing("dial", "Whoever finds {key} should dial {value} to return it.",
             "Which number should be dialled to return {key}?", " To return {key}, dial"),
    Phrasing("crate", "According to the inventory, crate {key} holds serial {value}.",
             "What serial does crate {key} hold according to the inventory?", " Crate {key} holds serial"),
    Phrasing("vault", "Only {value} opens the vault that belongs to {key}.",                 # value first
             "Which code opens the vault of {key}?", " The vault of {key} opens with"),
    Phrasing("badge", "The badge issued to {key} on arrival was stamped {value}.",
             "What was stamped on the badge issued to {key}?", " The badge issued to {key} was stamped"),
)



# VARIED phrasings: many TRAIN-side families composed from a small grammar (a thing named by a
# noun phrase, a needle pattern, a question pattern and an answer prefix), so that a curriculum
# cannot learn one template per family and has to learn "the value stated with the key". Built
# once, deterministically (fixed seed); any family sharing a word trigram with a HELD-OUT
# template is dropped, so the held-out wording stays unseen (tests/test_phrased_tasks.py).
_THINGS = ("access code", "locker combination", "ticket number", "catalogue number", "phone extension",
           "secret password", "account number", "tracking number", "pin", "room number", "membership number",
           "order number", "licence number", "reference code", "postal code", "flight number", "seat number",
           "invoice number", "case number", "batch number", "record number", "file number", "entry code",
           "gate code", "locker number", "voucher code", "permit number", "registration number", "docket number",
           "shelf number", "table number", "desk number", "plot number", "unit number", "claim number",
           "lucky number", "door code", "safe combination", "customer number", "station number")
_INTROS = ("Please note", "For reference", "As agreed", "Officially", "By the way", "Importantly",
           "To be clear", "For the file", "As you may know", "Keep in mind")
_NEEDLES = ("The {th} of {key} is {value}.", "{key}'s {th} is {value}.", "{intro}, the {th} for {key} is {value}.",
            "{value} is the {th} of {key}.", "The {th} assigned to {key} is {value}.", "{key} has {th} {value}.",
            "We gave {key} the {th} {value}.", "Write down {value} as the {th} of {key}.",
            "The records show that the {th} of {key} is {value}.", "{intro}: {key} uses {th} {value}.",
            "{value}, that is the {th} we chose for {key}.", "The {th} {value} goes with {key}.",
            "The label on {key} reads {value}.", "{key} keeps {value} as its {th}.",
            "Our list shows {key} next to {value}.", "{intro}, {key} is marked {value}.",
            "Anyone looking for {key} needs {value}.", "{value} was written on the card of {key}.",
            "{key} carries the {th} {value}, {intro}.", "To reach {key}, use {value}.")
_QUESTIONS = ("What is the {th} of {key}?", "Which {th} does {key} have?", "Tell me the {th} of {key}.",
              "What {th} was given to {key}?", "Do you know the {th} for {key}?", "{key}: what is its {th}?",
              "Which number goes with {key}?", "What is written for {key}?", "How do we reach {key}?",
              "What does the list show for {key}?", "Which value is {key} marked with?")
_PREFIXES = (" The {th} of {key} is", " {key}'s {th} is", " It is", " The answer is", " The {th} is",
             " The {th} for {key} is",
             # endings other than "is": a reader has to answer after any lead-in, not after "is"
             " {key} uses", " Use", " For {key}, enter", " {key} was given", " The label reads", " Answer:",
             " {key} got", " It says", " Try", " {key} goes with", " The list shows", " {key} is marked",
             " To reach {key}, use", " Write down", " {key} needs", " The card of {key} shows")


def _words3(text: str) -> set:
    w = re.findall(r"\{\w+\}|[A-Za-z']+", text.lower())
    return {tuple(w[i:i + 3]) for i in range(len(w) - 2)}


def _heldout_trigrams() -> set:
    """Every word trigram of the HELD-OUT templates: a TRAIN-side family sharing one is dropped."""
    return set().union(*(_words3(t) for f in HELDOUT_PHRASINGS for t in (f.needle, f.question, f.prefix)))


def _word_sampler(rng: random.Random, vocab: tuple[str, ...]):
    """-> words(lo, hi): between lo and hi words drawn from vocab with rng."""
    def words(lo: int, hi: int) -> list[str]:
        return [rng.choice(vocab) for _ in range(rng.randint(lo, hi))]
    return words


def _varied_phrasings(n: int = 600, seed: int = 0) -> tuple[Phrasing, ...]:
    held = _heldout_trigrams()
    rng = random.Random(f"varied-phrasings|{seed}")
    out, seen = [], set()
    while len(out) < n:
        th, intro = rng.choice(_THINGS), rng.choice(_INTROS)
        needle = rng.choice(_NEEDLES).format(th=th, intro=intro, key="{key}", value="{value}")
        needle = needle[0].upper() + needle[1:] if needle[0] != "{" else needle
        question = rng.choice(_QUESTIONS).format(th=th, key="{key}")
        prefix = rng.choice(_PREFIXES).format(th=th, key="{key}")
        if (needle, question, prefix) in seen or any(_words3(t) & held for t in (needle, question, prefix)):
            continue
        seen.add((needle, question, prefix))
        out.append(Phrasing(f"varied-{len(out)}", needle, question, prefix))
    return tuple(out)


#: 600 grammar-built TRAIN-side families (``_varied_phrasings``)
VARIED_PHRASINGS: tuple[Phrasing, ...] = _varied_phrasings()


# RANDOM phrasings: TRAIN-side families whose wording is random words of the TRAINING prose (its
# 2,000 most frequent words) around the key and the value, value first in about a third of them.
# The only thing such a family shares with any other is "a key, then (near it) a value": a reader
# trained on them cannot lean on a template or a grammar, only on that association. Same trigram
# filter against the HELD-OUT templates as the varied families.
def _prose_vocabulary(n: int = 2000) -> tuple[str, ...]:
    counts: dict[str, int] = {}
    for w in hs.essay_words():
        if w.isalpha() and w.isascii():
            counts[w.lower()] = counts.get(w.lower(), 0) + 1
    return tuple(sorted(counts, key=lambda w: (-counts[w], w))[:n])


def _random_phrasings(n: int = 1000, seed: int = 0) -> tuple[Phrasing, ...]:
    held = _heldout_trigrams()
    rng = random.Random(f"random-phrasings|{seed}")
    words = _word_sampler(rng, _prose_vocabulary())

    def sentence(parts: list[str], end: str) -> str:
        text = " ".join(p for p in parts if p)
        return text[0].upper() + text[1:] + end if text[0] != "{" else text + end

    out: list[Phrasing] = []
    while len(out) < n:
        first, second = ("{value}", "{key}") if rng.random() < 0.35 else ("{key}", "{value}")
        needle = sentence([*words(1, 4), first, *words(1, 3), second, *words(0, 3)], ".")
        question = sentence([*words(1, 4), "{key}", *words(0, 3)], "?")
        lead = words(1, 3)
        if rng.random() < 0.5:
            lead.insert(rng.randint(0, len(lead)), "{key}")
        prefix = " " + " ".join(lead)
        if any(_words3(t) & held for t in (needle, question, prefix)):
            continue
        out.append(Phrasing(f"random-{len(out)}", needle, question, prefix))
    return tuple(out)


#: 1,000 random-word TRAIN-side families (``_random_phrasings``)
RANDOM_PHRASINGS: tuple[Phrasing, ...] = _random_phrasings()


# ECHO phrasings: random training-prose words as above, key first, and the answer prefix ends with
# the 1-3 words that stand right before the value in the needle ("... {key} w w ECHO {value} ...",
# prefix " ... {key} ... ECHO"). What a reader learns from them is induction: find where the words it
# has just read were written, and copy what followed. Natural answer prefixes often repeat the
# needle's verb ("... should dial {value}" / "To return {key}, dial"); RULER's and the fixed TRAIN
# families' do so in one template each. Same trigram filter against the HELD-OUT templates.
def _echo_phrasings(n: int = 1000, seed: int = 0) -> tuple[Phrasing, ...]:
    held = _heldout_trigrams()
    rng = random.Random(f"echo-phrasings|{seed}")
    words = _word_sampler(rng, _prose_vocabulary())

    out: list[Phrasing] = []
    while len(out) < n:
        echo = words(1, 3)
        needle = " ".join([*words(1, 4), "{key}", *words(0, 3), *echo, "{value}", *words(0, 3)])
        needle = needle[0].upper() + needle[1:] + "."
        question = " ".join([*words(1, 4), "{key}", *words(0, 3)])
        question = question[0].upper() + question[1:] + "?"
        lead = [*words(0, 2), "{key}", *words(0, 2)] if rng.random() < 0.7 else words(0, 2)
        prefix = " " + " ".join([*lead, *echo])
        if any(_words3(t) & held for t in (needle, question, prefix)):
            continue
        out.append(Phrasing(f"echo-{len(out)}", needle, question, prefix))
    return tuple(out)


#: 1,000 random-word TRAIN-side families whose answer prefix repeats the words before the value
ECHO_PHRASINGS: tuple[Phrasing, ...] = _echo_phrasings()


def _ruler_phrasing() -> Phrasing:
    _, q = ruler._niah_texts(ruler.TASKS["niah_single_2"], "{key}")   # "\nWhat is ...? The ... is"
    question, prefix = q[1:].split("?", 1)
    return Phrasing("ruler", ruler.NEEDLE.replace("{type_needle_v}", "numbers"), question + "?", prefix)


#: RULER's niah_single_2 format (its header, needle and question), for the prose-only control.
RULER_PHRASING = _ruler_phrasing()

PHRASINGS = {"train": TRAIN_PHRASINGS, "heldout": HELDOUT_PHRASINGS, "ruler": (RULER_PHRASING,),
             "varied": VARIED_PHRASINGS, "random": RANDOM_PHRASINGS, "echo": ECHO_PHRASINGS}
PROSE_NAMES = {"train": "fortunes", "heldout": "python-docs"}


@dataclass(frozen=True)
class PhrasedSpec:
    phrasings: str   # "train" | "heldout" | "ruler" | "varied" (TRAIN-side, grammar-built) | "random" | "echo"
    prose: str       # "train" | "heldout"
    num_k: int = 1   # needles (distinct keys, one family); one of them is asked


TASKS: dict[str, PhrasedSpec] = {
    "phrased_niah_train": PhrasedSpec("train", "train"),
    "phrased_niah_heldout": PhrasedSpec("heldout", "heldout"),
    "phrased_niah_heldout_phrasing": PhrasedSpec("heldout", "train"),
    "phrased_niah_heldout_prose": PhrasedSpec("ruler", "heldout"),
    "phrased_multikey_train": PhrasedSpec("train", "train", num_k=4),
    "phrased_multikey_heldout": PhrasedSpec("heldout", "heldout", num_k=4),
    "phrased_niah_varied": PhrasedSpec("varied", "train"),
    "phrased_multikey_varied": PhrasedSpec("varied", "train", num_k=4),
    "phrased_niah_random": PhrasedSpec("random", "train"),
    "phrased_multikey_random": PhrasedSpec("random", "train", num_k=4),
    "phrased_niah_echo": PhrasedSpec("echo", "train"),
    "phrased_multikey_echo": PhrasedSpec("echo", "train", num_k=4),
}
#: the tasks a training curriculum may use (TRAIN phrasings in TRAIN prose only)
TRAIN_TASKS = tuple(t for t, s in TASKS.items() if s.phrasings in ("train", "varied", "random", "echo") and s.prose == "train")
#: the trainable tasks with the 8 fixed TRAIN phrasings (the ``phrasings`` curriculum's)
FIXED_TRAIN_TASKS = ("phrased_niah_train", "phrased_multikey_train")


# ----------------------------------------------------------------------------------------------
# prose corpora, sized like ruler's essay haystack (prefix sums of per-word token counts)

def prose_words(prose: str) -> tuple[str, ...]:
    if prose == "train":
        return hs.essay_words()
    if prose == "heldout":
        return docprose.docs_words()
    raise ValueError(f"prose must be 'train' or 'heldout', got {prose!r}")


_CUMSUM: dict[tuple[str, int], tuple[object, np.ndarray]] = {}


def _cumsum(prose: str, tokenizer) -> np.ndarray:
    """cum[i] = tokens of the first i corpus words, each counted as ' ' + word."""
    hit = _CUMSUM.get((prose, id(tokenizer)))
    if hit is None or hit[0] is not tokenizer:
        words = prose_words(prose)
        uniq = sorted(set(words))
        counts = dict(zip(uniq, ruler.count_tokens(tokenizer, [" " + w for w in uniq])))
        per = np.array([counts[w] for w in words], dtype=np.int64)
        hit = (tokenizer, np.concatenate([[0], np.cumsum(per)]))
        _CUMSUM[(prose, id(tokenizer))] = hit
    return hit[1]


def words_for_budget(prose: str, tokenizer, start: int, budget: int) -> int:
    """Largest word count whose ' '-joined tokens from word ``start`` (cycling) fit ``budget``."""
    cum = _cumsum(prose, tokenizer)
    n, total = len(cum) - 1, int(cum[-1])
    start %= n
    first = int(cum[n] - cum[start])
    if budget < first:
        return max(int(np.searchsorted(cum, cum[start] + budget, side="right") - 1 - start), 0)
    m = n - start
    budget -= first
    full = budget // total
    m += full * n
    budget -= full * total
    m += int(np.searchsorted(cum, budget, side="right") - 1)
    return max(m, 0)


def prose_slice(prose: str, n_words: int, start: int = 0) -> str:
    """``n_words`` words of the corpus from word ``start``, cycling through it as needed."""
    return hs.cycle_slice(prose_words(prose), n_words, start)


def needle_regex(fam: Phrasing) -> re.Pattern:
    """A needle of family ``fam``: groups key (adjective-noun) and value (7 digits)."""
    pat = re.escape(fam.needle).replace(r"\{key\}", "(?P<key>[a-z]+-[a-z]+)")
    return re.compile(pat.replace(r"\{value\}", "(?P<value>[0-9]{7})"))


# ----------------------------------------------------------------------------------------------
# examples

def family_of(task: str, index: int) -> Phrasing:
    fams = PHRASINGS[TASKS[task].phrasings]
    return fams[index % len(fams)]


def _texts(spec: PhrasedSpec, fam: Phrasing, query: str) -> tuple[str | None, str]:
    """(header or None, question incl. the leading newline and the answer prefix)."""
    if spec.phrasings == "ruler":
        return ruler._niah_texts(ruler.TASKS["niah_single_2"], query)
    return None, "\n" + fam.question.format(key=query) + fam.prefix.format(key=query)


def generate(task: str, n_tokens_target: int, index: int, tokenizer, seed: int = 0,
             split: str = "test") -> dict:
    """One example; identical for identical (task, target, index, seed, split, tokenizer)."""
    spec = TASKS[task]
    keys_pool = ruler.split_keys(split)  # validates split
    fam = family_of(task, index)
    target = n_tokens_target
    rng = random.Random(f"phrased|{task}|{target}|{index}|{seed}|{split}")
    keys = rng.sample(keys_pool, spec.num_k)
    values = [ruler._value(rng, "numbers") for _ in keys]
    needles = [fam.needle.format(key=k, value=v) for k, v in zip(keys, values)]
    asked = rng.randrange(spec.num_k)
    query, answers = keys[asked], [values[asked]]
    head, question = _texts(spec, fam, query)
    fixed = ruler.count_tokens(tokenizer, [question])[0]
    if head is not None:
        fixed += ruler.count_tokens(tokenizer, [head])[0] + 1  # +1: "\n" after the header
    t_needles = ruler.count_tokens(tokenizer, [" " + nd for nd in needles])
    words = prose_words(spec.prose)
    start = 0 if split == "test" else rng.randrange(len(words))
    n_words = words_for_budget(spec.prose, tokenizer, start, target - fixed - sum(t_needles))
    sents = hs.split_sentences(prose_slice(spec.prose, n_words, start))
    body = ruler.insert_needles(sents, needles, rng)
    context = body if head is None else head + "\n" + body
    ex = ruler._finish(task, context, question, answers, target, tokenizer, needles=needles,
                       extra={"queries": [query], "keys": keys, "phrasing": fam.name,
                              "prose": PROSE_NAMES[spec.prose]})
    ex["index"] = index
    return ex
