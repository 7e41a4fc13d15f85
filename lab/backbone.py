"""Lab (not installed): train the tiny shipped backbones (pure Gated DeltaNet and Mamba-2) on CPU.

Research code for the tiny checkpoints in models/ (curricula, built circuits, growth, model cards).
The product (nbcore, pipeline) never imports it; lab/train_backbone.py is its CLI.

Why it works at all on 2 cores: the initialisation. With stock inits the answer loss of a tiny
recurrent model sits at chance for hundreds of steps on needle retrieval. Two inits fix it
(shared/notes/tiny-model-training.md, measured for GDN):
* long-memory decay: per-token decay close to 1 (GDN ``g = -exp(A_log)*softplus(a+dt_bias)``
  near 0; Mamba-2 ``exp(-exp(A_log)*dt)`` near 1), so a needle survives a 2K haystack;
* induction init: the key path starts as a copy of the query path and its short conv reads token
  t-1 while query and value read token t, so the state stores (previous token -> current token)
  and querying with the current token returns what followed it last time: an induction head,
  which is exactly "find the key, copy the value". Here q, k, v and out_proj start as identity
  slices of the hidden state rather than a small random matrix: measured on this machine (same
  data, 60 steps of 4K tokens), a random std-0.02 q=k copy was still at chance (answer CE 2.10)
  while the identity version had left it (1.49) -- Adam's first updates are as large as the
  0.02-scale weights and wipe a random q=k copy out, an O(1) identity survives them. For Mamba-2,
  B plays the key, C the query and x the value (the same recipe on ``in_proj`` / ``conv1d``;
  not ablated).

Data: RULER NIAH formats (train-split keys, fresh random values) over noise and prose haystacks
plus plain prose LM, generated on the fly at <= 2K tokens with a length curriculum that advances
when the teacher-forced answer exact match passes a threshold (or at a time cap). The ``phrasings``
curriculum also draws needles in other wordings (nbcore/tasks/phrased.py: its TRAIN phrasings in the
training prose only; the HELD-OUT phrasings and prose are never trained on). Loss = answer CE + 0.5 x LM CE on all other tokens.
Pure torch + transformers; no ray here (lab/train_backbone.py is the CLI).
"""
from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from nbcore.tasks import haystack as hs
from nbcore.tasks import phrased, ruler

NIAH_TRAIN_TASKS = ruler.PAPER_SIX
# training-only variant of niah_single_3 (never evaluated): the uuid's hex digits come from a
# random 4-8 symbol subset, so the k-gram contexts inside the value recur often. The shipped
# Mamba-2's uuid misses are induction collisions (the piece after another occurrence of the same
# 1-/2-gram in the value; lab/probes/uuid_copy_errors.py), and in real uuids a 2-gram recurs at only
# ~5% of positions, too rarely to teach the model to key on longer contexts.
COLLIDE_TASK = "niah_single_3_collide"
UUID_GROUPS = (8, 4, 4, 4, 12)


def collide_uuid(rng: random.Random) -> str:
    """A uuid-shaped string (8-4-4-4-12 hex) drawn from a small random hex alphabet."""
    alphabet = rng.sample("0123456789abcdef", rng.randint(4, 8))
    return "-".join("".join(rng.choice(alphabet) for _ in range(n)) for n in UUID_GROUPS)


def generate_train(task: str, length: int, index: int, tok, seed: int) -> dict:
    """A training example (train-split keys): a RULER task, a TRAIN phrased task
    (``phrased.TRAIN_TASKS``; held-out ones are refused), or COLLIDE_TASK (a niah_single_3 example
    whose uuid is replaced, in the needle and the answer, by ``collide_uuid``)."""
    if task in phrased.TASKS and task not in phrased.TRAIN_TASKS:
        raise ValueError(f"{task} uses held-out phrasings or prose: it is never trained on "
                         f"(trainable phrased tasks: {list(phrased.TRAIN_TASKS)})")
    if task != COLLIDE_TASK:
        return ruler.generate(task, length, index, tok, seed=seed, split="train")
    ex = ruler.generate("niah_single_3", length, index, tok, seed=seed, split="train")
    old = ex["answers"][0]
    new = collide_uuid(random.Random(f"collide|{seed}|{length}|{index}"))
    if ex["context"].count(old) != 1:
        raise RuntimeError("the needle's uuid is not in the context exactly once")
    return {**ex, "context": ex["context"].replace(old, new), "answers": [new]}


@dataclass
class ModelConfig:
    family: str = "gdn"              # gdn (Qwen3.5 all linear_attention) | mamba2
    hidden: int = 128                # hidden size
    layers: int = 4                  # number of layers
    heads: int = 4                   # GDN key/value heads per layer; Mamba-2 has 2*hidden/head_dim heads
                                     # whatever this says (it only scales bigram_heads there)
    head_dim: int = 32               # head dimension
    mlp: int = 256                   # GDN MLP width
    state: int = 64                  # Mamba-2 state size per B/C group; grown from a smaller state, the new
                                     # dims start near 0 (see grow_from, train.new_state_scale)
    groups: int = 1                  # Mamba-2 B/C groups (n_groups, must divide the heads): heads/groups heads
                                     # share one key (B) / query (C) code; every group gets the same init, and
                                     # grown from fewer groups each copies its source group
    conv: int = 4                    # short-conv kernel size
    emb_std: float = 0.02            # std of the (tied) embeddings at init
    identity_init: bool = True       # q/k/v/out projections start as identity slices (see _init_gdn)
    bigram_heads: int = 0            # GDN heads per layer whose induction init matches (t-1, t) bigrams
                                     # (_init_gdn); Mamba-2: bigram_heads/heads of the shared B/C state dims
    window_heads: int = 0            # GDN heads per layer whose q/k convs read a bag of the last `conv` tokens
    offset_heads: tuple[tuple[int, int], ...] = ()  # [[q lag, k lag], ...] per GDN head after the window
                                     # heads, e.g. [[6, 3]]: offset induction (_init_gdn); Mamba-2: one per
                                     # *layer* from the first (all B/C dims; dt gate fitted when grown)


# in_proj rows of grown Mamba-2 state dims (B and C each), relative to the fresh induction init (rows
# of norm 1; tiny-mamba2-v4's trained rows have norm ~2). Measured on v4 (state 64 -> 128): at 0.01 the
# logits move <= 0.1 but after 820 steps (lr 3e-4) the new rows had only reached norm 0.06-0.11, i.e.
# their B x C term was ~0.3% of the old dims' and the added capacity unused; at 0.3 the grown model
# still reads single_3 / multikey / multiquery / single_1 90 / 65 / 87.5 / 100 at 1K (N=20; v4 at N=50:
# 80 / 72 / 91 / 100), so training starts from v4's answers with the new dims already in play.
NEW_STATE_SCALE = 0.3


@dataclass
class TrainConfig:
    minutes: float = 60.0            # wall-clock training budget (resumed runs add up)
    seed: int = 0                    # batches are a pure function of (seed, step, phase)
    lr: float = 3e-3                 # AdamW peak lr (warm-up, then cosine to min_lr_frac x)
    min_lr_frac: float = 0.1         # final lr as a fraction of lr
    warmup_steps: int = 30           # linear lr warm-up steps
    tokens_per_step: int = 4096      # tokens per optimizer step (batch = tokens_per_step // length)
    weight_decay: float = 0.01       # AdamW weight decay
    lm_weight: float = 0.5           # loss = answer CE + lm_weight x LM CE on the other tokens
    prose_frac: float = 0.1          # fraction of sequences that are plain prose LM
    threads: int = 2                 # torch threads
    ckpt_every_s: float = 180.0      # seconds between checkpoints (runs/<name>/ckpt.pt + the HF dir)
    max_steps: int | None = None     # stop after this many steps even with budget left (the lr schedule
                                     # still follows `minutes`); null: the budget alone
    device: str = "cpu"              # cpu | cuda (a GPU lease; fla kernels for GDN when installed)
    # curriculum phases: (min len, max len, tasks, advance when teacher-forced answer EM (EMA)
    # exceeds this, or at the latest at this fraction of the time budget). Performance-gated:
    # on a loaded 2-core machine a time-only schedule moved on before the answer loss had left
    # chance level. (Untyped items: pipeline.config checks a tuple type's items against its first
    # argument only, so the mixed (int, int, tasks, float, float) rows are normalised by the CLI.)
    phases: list = field(default_factory=lambda: list(PHASES["scratch"]))  # [[min len, max len, [tasks],
                                     # advance at teacher-forced EM, or at this budget fraction], ...];
                                     # usually set by name with the CLI's `curriculum` key
    init_from: str | None = None     # HF model dir to grow (grow_from: same family and tokenizer) instead
                                     # of a fresh init; same shapes = a continuation
    grow_prepend: int = 0            # with init_from: new layers placed before the source's layers
    new_layer_lr_mult: float = 1.0   # with init_from: lr multiplier of the new layers' read-out (see train)
    freeze_new_mixer: bool = False   # with init_from: keep the new layers' q/k/v/conv/gates at their init
                                     # (only their read-out trains: out_proj, gate, MLP)
    freeze_mixer_layers: tuple[int, ...] = ()  # keep these layers' q/k/v/conv/gates as loaded (a built
                                     # circuit), e.g. [0]
    new_state_scale: float = NEW_STATE_SCALE  # with init_from and a larger Mamba-2 state: the new state
                                     # dims' in_proj rows, x the fresh init
    product_layer: str = ""          # Mamba-2, fresh or grown with grow_prepend=1: build layer 0 as a bigram
                                     # product layer, a PRODUCT_LAGS name (lag1 | lag12; _init_mamba2_product);
                                     # "" = the usual init
    phrasings_frac: float = 0.5      # in a phase listing both phrased (nbcore.tasks.phrased) and RULER tasks:
                                     # the fraction of its needle sequences drawn from the phrased ones
                                     # (draw_task); no effect on phases without phrased tasks


# Length curricula. "scratch": from a fresh init. "grow": continue a grown shipped model at the
# training lengths, with the two tasks the first models missed (multikey binding, uuid copies)
# drawn twice as often (a task listed twice is drawn twice as often).
PHASES = {
    "scratch": [
        (128, 256, ("niah_single_1",), 0.8, 0.35),
        (128, 512, ("niah_single_1", "niah_single_2", "niah_single_3"), 0.7, 0.50),
        (256, 1024, NIAH_TRAIN_TASKS, 0.6, 0.80),
        (512, 2048, NIAH_TRAIN_TASKS, 2.0, 1.0),
    ],
    "grow": [
        (256, 2048, NIAH_TRAIN_TASKS + ("niah_multikey_1", "niah_single_3"), 2.0, 1.0),
    ],
    # multi-key only: does a grown model learn to use a built key-binding head at all?
    "bind": [
        (256, 1024, ("niah_multikey_1",), 2.0, 1.0),
    ],
}
# ... then the "grow" mix for the second half, so the other tasks come back
PHASES["bind-grow"] = [PHASES["bind"][0][:4] + (0.5,), PHASES["grow"][0]]
# continue a model that misses only uuid copies (one wrong BPE piece in ~30 fails the example):
# uuids are 5 of 11 NIAH draws, multi-key stays in so the binding is not forgotten
PHASES["uuid"] = [
    (256, 2048, NIAH_TRAIN_TASKS + ("niah_single_3",) * 4 + ("niah_multikey_1",), 2.0, 1.0),
]
# the same mix at the upper half of the training lengths only (tried on Mamba-2 v4 because it read
# 80 at 1K and 68 at 2K; the misses turned out not to depend on length: 72 at 384 tokens)
PHASES["uuid-long"] = [(1024, 2048) + PHASES["uuid"][0][2:]]
# the uuid mix with 3 of its 5 uuid draws replaced by collision-rich uuids (COLLIDE_TASK)
PHASES["uuid-collide"] = [
    (256, 2048, NIAH_TRAIN_TASKS + ("niah_single_3",) + (COLLIDE_TASK,) * 3 + ("niah_multikey_1",), 2.0, 1.0),
]
# continue a shipped reader on the uuid mix plus needles in other wordings: TRAIN phrasings in the
# training prose (nbcore/tasks/phrased.py TRAIN_TASKS: one needle, and four keys with one asked),
# train.phrasings_frac (default 0.5) of the needle sequences; the rest is exactly the uuid mix, so
# RULER reading is kept while the phrasings are learned
PHASES["phrasings"] = [(256, 2048, PHASES["uuid"][0][2] + phrased.FIXED_TRAIN_TASKS, 2.0, 1.0)]
# the same with the grammar-built VARIED phrasings (600 families, nbcore/tasks/phrased.py) drawn
# three times as often as the 8 fixed ones, from 96 tokens up: a template per family cannot be
# learned, "the value stated with the key" can, and the short sequences look like a replayed note
# followed by its question (what NoteBank's oracle / lambda = 0 read sees)
PHASES["phrasings-varied"] = [(96, 2048, PHASES["uuid"][0][2] + phrased.FIXED_TRAIN_TASKS
                               + ("phrased_niah_varied", "phrased_multikey_varied") * 3, 2.0, 1.0)]

# random-word wording (1,000 families of random training-prose words around key and value,
# nbcore/tasks/phrased.py RANDOM_PHRASINGS) drawn three times as often as the rest of the phrased
# mix: no template and no grammar is shared, only "the value stated near the key"
PHASES["phrasings-random"] = [(96, 2048, PHASES["uuid"][0][2] + phrased.FIXED_TRAIN_TASKS
                               + ("phrased_niah_varied", "phrased_multikey_varied")
                               + ("phrased_niah_random", "phrased_multikey_random") * 3, 2.0, 1.0)]

# echo wording (nbcore/tasks/phrased.py ECHO_PHRASINGS: random words, the answer prefix ending with the
# words written right before the value) three times as often as the varied and random mix. Hypothesis:
# induction ("copy what followed the words just read") would carry to held-out prefixes that repeat their
# needle's words. Tried as tiny-gdn-v11 (55 min): not learned (bench/results/phrasings/README.md)
PHASES["phrasings-echo"] = [(96, 2048, PHASES["uuid"][0][2] + phrased.FIXED_TRAIN_TASKS
                             + ("phrased_niah_varied", "phrased_multikey_varied")
                             + ("phrased_niah_random", "phrased_multikey_random")
                             + ("phrased_niah_echo", "phrased_multikey_echo") * 3, 2.0, 1.0)]

def phases_json(phases) -> list:
    """Phases as stored in train_meta.json (tuples -> lists)."""
    return [[p[0], p[1], list(p[2]), p[3], p[4]] for p in phases]


# ------------------------------------------------------------------------------------------------
# models

def build_model(mc: ModelConfig, tok):
    """Fresh model with the long-memory + induction initialisation."""
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id)
    if mc.family == "gdn":
        if mc.groups != 1:
            raise ValueError("groups is a Mamba-2 option (GDN has a key per head already)")
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        cfg = Qwen3_5TextConfig(
            vocab_size=len(tok), hidden_size=mc.hidden, intermediate_size=mc.mlp,
            num_hidden_layers=mc.layers, layer_types=["linear_attention"] * mc.layers,
            num_attention_heads=mc.heads, num_key_value_heads=mc.heads, head_dim=mc.head_dim,
            linear_num_key_heads=mc.heads, linear_num_value_heads=mc.heads,
            linear_key_head_dim=mc.head_dim, linear_value_head_dim=mc.head_dim,
            linear_conv_kernel_dim=mc.conv, tie_word_embeddings=True, use_cache=False,
            max_position_embeddings=1 << 20, **ids)
        model = Qwen3_5ForCausalLM(cfg)
        for layer in model.model.layers:
            _init_gdn(layer.linear_attn, mc.identity_init, mc.bigram_heads, mc.window_heads, mc.offset_heads)
    elif mc.family == "mamba2":
        from transformers import Mamba2Config, Mamba2ForCausalLM
        inter = 2 * mc.hidden
        cfg = Mamba2Config(
            vocab_size=len(tok), hidden_size=mc.hidden, num_hidden_layers=mc.layers,
            expand=2, head_dim=mc.head_dim, num_heads=inter // mc.head_dim, n_groups=mc.groups,
            state_size=mc.state, conv_kernel=mc.conv, chunk_size=128, tie_word_embeddings=True,
            use_cache=False, **ids)
        if (inter // mc.head_dim) % mc.groups:
            raise ValueError(f"groups={mc.groups} must divide the {inter // mc.head_dim} Mamba-2 heads")
        model = Mamba2ForCausalLM(cfg)
        if mc.bigram_heads > mc.heads:
            raise ValueError(f"bigram_heads={mc.bigram_heads} > heads={mc.heads}")
        if len(mc.offset_heads) > mc.layers:
            raise ValueError(f"offset_heads={mc.offset_heads}: Mamba-2 takes one (q lag, k lag) per "
                             f"layer, {mc.layers} layers")
        for i, layer in enumerate(model.backbone.layers):
            _init_mamba2(layer.mixer, mc.identity_init, bigram_frac=mc.bigram_heads / mc.heads,
                         offset=mc.offset_heads[i] if i < len(mc.offset_heads) else None)
    else:
        raise ValueError(mc.family)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, mc.emb_std)
    return model


def _conv_window(conv: torch.nn.Conv1d, sl: slice, first_lag: int) -> None:
    """Depthwise causal conv channels ``sl`` read the sum of tokens t-first_lag ... t-(K-1)."""
    k = conv.weight.shape[-1]
    conv.weight.data[sl] = 0.0
    conv.weight.data[sl, 0, :k - first_lag] = 1.0
    if conv.bias is not None:
        conv.bias.data[sl] = 0.0


def _conv_taps(conv: torch.nn.Conv1d, sl: slice, lag: int, also: int | None = None) -> None:
    """Depthwise causal conv channels ``sl`` read exactly token t-lag (weight index K-1 = t),
    plus token t-``also`` with the same weight when given (a bigram read)."""
    k = conv.weight.shape[-1]
    conv.weight.data[sl] = 0.0
    conv.weight.data[sl, 0, k - 1 - lag] = 1.0
    if also is not None:
        conv.weight.data[sl, 0, k - 1 - also] = 1.0
    if conv.bias is not None:
        conv.bias.data[sl] = 0.0


def _eye(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
    """[rows, cols] identity blocks tiled over the rows (rows may exceed cols)."""
    return torch.eye(cols).repeat((rows + cols - 1) // cols, 1)[:rows] * scale


@torch.no_grad()
def _init_gdn(m, identity: bool = True, bigram_heads: int = 0, window_heads: int = 0,
              offset_heads: tuple = ()) -> None:
    """Long-memory decay + a working induction head from step 0.

    q = k = v = identity slices of the normed hidden state (token embeddings are nearly
    orthogonal, so the key match is sharp), k's conv reads t-1, out_proj = identity back into the
    residual: at init the layer already writes (token t-1 -> embedding of token t) into its state
    and reads back the embedding of whatever followed the current token last time, which the tied
    LM head decodes. The output gate silu(z) starts random, so the read-out is not clean at step 0;
    what matters is that the O(1) structure survives Adam's first updates (a std-0.02 random q=k
    copy did not: the answer loss stayed at chance for 300+ steps in a first run).

    ``bigram_heads``: the last that many heads read q = x_t + x_{t-1} and k = x_{t-1} + x_{t-2}, so
    the key matches the last two tokens, not one. Why: the unigram head loses its place at a
    repeated token inside a value ("4b88" -> after "4" either "b" or "8"); the shipped 1-layer-lag
    model copied uuids at 6.7% and mixed multi-key values at such repeats (README, diagnosis).

    ``window_heads``: the first that many heads read q = the sum of tokens t..t-(K-1) and k = the
    sum of t-1..t-(K-1) (K = conv size): a bag of the recent words, so a value is stored under the
    key words a few tokens before it ("... for swift-cloud is: 1408069") and found from a question
    whose key is ~7 tokens back ("... for swift-cloud mentioned in the provided text is"). Why: the
    bigram models copied the value of a *distractor* key on niah_multikey_1 (15 of 20 errors);
    with conv 4 no head sees the key from the question's answer position.

    ``offset_heads``: (a, b) per head, after the window heads: q reads token t-a, k reads t-b, v
    reads t. The state stores (token b back -> current token); a query returns what came b tokens
    after the token a back. With (6, 3) and the training formats' needle "... for <key> is:
    <value>" (key's last token 3 before the value's first) and answer prefix "... for <key>
    mentioned in the provided text is" (key's last token 6 before the answer), the head at the
    answer position returns the first token of the value stored under *that* key: the binding
    the bigram models lacked. This encodes the distance between key and value in the training
    formats (keys and values stay unseen); training tunes or discards it.
    """
    kd, vd, hid = m.key_dim, m.value_dim, m.hidden_size
    w = m.in_proj_qkv.weight  # [2*kd + vd, hidden]: rows q | k | v
    if identity:
        w[:kd] = _eye(kd, hid)
        w[2 * kd:] = _eye(vd, hid)
        m.out_proj.weight.copy_(_eye(vd, hid).T)
    w[kd:2 * kd] = w[:kd]  # key projection = query projection
    _conv_taps(m.conv1d, slice(0, kd), 0)  # q reads t
    _conv_taps(m.conv1d, slice(kd, 2 * kd), 1)  # k reads t-1
    _conv_taps(m.conv1d, slice(2 * kd, 2 * kd + vd), 0)  # v reads t
    if bigram_heads:
        hd = kd // m.num_k_heads
        if not 0 < bigram_heads <= m.num_k_heads:
            raise ValueError(f"bigram_heads={bigram_heads} must be in 1..{m.num_k_heads}")
        lo = kd - bigram_heads * hd                            # the last heads' q/k channels
        _conv_taps(m.conv1d, slice(lo, kd), 0, also=1)         # q reads t and t-1
        _conv_taps(m.conv1d, slice(kd + lo, 2 * kd), 1, also=2)  # k reads t-1 and t-2
    if window_heads:
        hd = kd // m.num_k_heads
        if not 0 < window_heads + bigram_heads <= m.num_k_heads:
            raise ValueError(f"window_heads={window_heads} + bigram_heads={bigram_heads} must be "
                             f"in 1..{m.num_k_heads}")
        hi = window_heads * hd                               # the first heads' q/k channels
        _conv_window(m.conv1d, slice(0, hi), 0)              # q: bag of t .. t-(K-1)
        _conv_window(m.conv1d, slice(kd, kd + hi), 1)        # k: bag of t-1 .. t-(K-1)
    if offset_heads:
        hd, K = kd // m.num_k_heads, m.conv1d.weight.shape[-1]
        first = window_heads
        if first + len(offset_heads) + bigram_heads > m.num_k_heads:
            raise ValueError(f"offset_heads={offset_heads} + window_heads={window_heads} + "
                             f"bigram_heads={bigram_heads} exceed {m.num_k_heads} heads")
        for i, (a, b) in enumerate(offset_heads):
            if not (0 <= a < K and 0 < b < K):
                raise ValueError(f"offset head lags {(a, b)} must be < conv size {K} (k lag >= 1)")
            sl = slice((first + i) * hd, (first + i + 1) * hd)
            _conv_taps(m.conv1d, sl, a)                                     # q reads t-a
            _conv_taps(m.conv1d, slice(kd + sl.start, kd + sl.stop), b)     # k reads t-b
    h = m.num_v_heads
    # decay per token exp(g), g = -A*softplus(dt_bias): A in [0.02, 0.2], softplus(-4) ~ 0.018
    m.A_log.copy_(torch.linspace(math.log(0.02), math.log(0.2), h))
    m.dt_bias.fill_(-4.0)


OFFSET_KEY_GAIN, OFFSET_KEY_THRESHOLD = 3.0, 1.0  # Mamba-2 offset layer's sparse B/C codes (_init_mamba2)


@torch.no_grad()
def _init_mamba2(m, identity: bool = True, bigram_frac: float = 0.0, offset: tuple | None = None) -> None:
    """Same recipe for Mamba-2: x (value) and C (query) read token t, B (key) = C reads t-1.

    ``bigram_frac``: Mamba-2 has one B/C group shared by every head, so the bigram match of
    ``_init_gdn`` goes to state dims, not heads: the last ``bigram_frac`` of the B/C dims read
    C = x_t + x_{t-1}, B = x_{t-1} + x_{t-2}; the score C.B then adds a bigram match to the
    unigram one (``model.bigram_heads=k`` of ``model.heads=h`` gives k/h).

    ``offset`` (a, b): the GDN offset head (see ``_init_gdn``) for a whole layer: every C dim
    reads token t-a, every B dim t-b, x reads t. With one shared B/C group an offset cannot be
    given to some heads only; the layer's dt write gate (``fit_dt_gate``) decides where it writes."""
    inter, st, hid, G = m.intermediate_size, m.ssm_state_size, m.hidden_size, m.n_groups
    w = m.in_proj.weight  # rows: gate(inter) | x(inter) | B(G*st) | C(G*st) | dt(heads)
    xb = inter  # start of the conv block; conv channels: x(inter) | B(G*st) | C(G*st)
    if identity:
        w[xb:xb + inter] = _eye(inter, hid)
        m.out_proj.weight.copy_(_eye(inter, hid).T * (hid / inter))
    _conv_taps(m.conv1d, slice(0, inter), 0)  # x (value) reads t
    uni = st - int(round(bigram_frac * st))  # B/C dims [uni, st) of every group get the bigram taps
    if offset is not None:
        a, b = offset
        K = m.conv1d.weight.shape[-1]
        if not (0 <= a < K and 0 < b < K):
            raise ValueError(f"offset lags {(a, b)} must be < conv size {K} (k lag >= 1)")
    for g in range(G):  # every group starts alike (heads h of group h // (heads/G) read it)
        bw, cw = xb + inter + g * st, xb + inter + G * st + g * st   # in_proj rows of B_g, C_g
        bc, cc = inter + g * st, inter + G * st + g * st             # conv channels of B_g, C_g
        if identity:
            w[cw:cw + st] = _eye(st, hid)
        w[bw:bw + st] = w[cw:cw + st]  # B (key) = C (query)
        _conv_taps(m.conv1d, slice(bc, bc + uni), 1)  # B reads t-1
        _conv_taps(m.conv1d, slice(cc, cc + uni), 0)  # C reads t
        if uni < st:
            _conv_taps(m.conv1d, slice(bc + uni, bc + st), 1, also=2)  # B reads t-1, t-2
            _conv_taps(m.conv1d, slice(cc + uni, cc + st), 0, also=1)  # C reads t, t-1
        if offset is not None:
            _conv_taps(m.conv1d, slice(bc, bc + st), b)  # B (key) reads t-b
            _conv_taps(m.conv1d, slice(cc, cc + st), a)  # C (query) reads t-a
    if offset is not None:
        # sparse keys: B, C = silu(3 e - 3), about the dims where the normed embedding exceeds 1.
        # Mamba-2 neither normalises B/C nor erases, and silu(e) has a positive mean, so plain
        # silu(e) codes of different tokens overlap: the fitted-gate read-out found the gold first
        # digit in 8/20 multikey haystacks with them, 19/20 with these (lab/probes/mamba2_offset_probe.py)
        bcs = slice(inter, inter + 2 * G * st)
        m.conv1d.weight.data[bcs] *= OFFSET_KEY_GAIN
        m.conv1d.bias.data[bcs] = -OFFSET_KEY_GAIN * OFFSET_KEY_THRESHOLD
    h = m.num_heads
    # decay exp(-A*dt): A in [0.005, 0.05], dt = softplus(dt_bias) ~ 0.25 (writes stay strong)
    m.A_log.copy_(torch.linspace(math.log(0.005), math.log(0.05), h))
    m.dt_bias.fill_(math.log(math.expm1(0.25)))
    m.D.fill_(0.0)


# Built first layers that write a code of a token *pair* into the residual stream (see
# _init_mamba2_product): name -> (lag of the first half of the x channels, lag of the second half).
PRODUCT_LAGS = {"lag1": (1, 1), "lag12": (1, 2)}


@torch.no_grad()
def _init_mamba2_product(m, lags: tuple = (1, 1), seed: int = 0) -> None:
    """A Mamba-2 mixer built as a bigram *product* layer (its out_proj is left alone).

    Why: the shipped Mamba-2's uuid misses are induction collisions. Its copy key (B) adds the codes
    of the previous pieces, so a position whose previous piece matches scores about half the gold
    one, whatever came before (lab/probes/uuid_copy_errors.py). A Mamba-2 block has no MLP; its one
    multiplicative interaction is the output gate, y * silu(z). This layer uses it to write
    AND-like codes of (token t-lag, token t) pairs, which later induction layers can key on:

        x_t = silu(h_{t-lag})          conv taps; first half of the x channels lag lags[0], second lags[1]
        B = C = 0                      the scan adds nothing (dt ~ 0 too)
        y_t = D x_t = x_t              D = 1
        out_t = RMSNormGated(y_t * silu(z_t)),  z_t = h_t (first half), h_t permuted (second half)

    h = the block's normed input (the token embedding when the layer comes first); the permutation
    is fixed by ``seed``, so the second half multiplies different dims of the two tokens.
    x: [inter] = 2 copies of [hidden] (``_eye``)."""
    inter, st, hid, G = m.intermediate_size, m.ssm_state_size, m.hidden_size, m.n_groups
    if inter != 2 * hid:
        raise ValueError(f"product layer expects expand=2 (intermediate {inter} = 2 x hidden {hid})")
    w = m.in_proj.weight  # rows: z(inter) | x(inter) | B(G*st) | C(G*st) | dt(heads)
    perm = torch.randperm(hid, generator=torch.Generator().manual_seed(seed))
    w.zero_()
    w[:hid] = torch.eye(hid)                                   # z, first half: token t
    w[hid:inter] = torch.eye(hid)[perm]                        # z, second half: permuted dims of token t
    w[inter:2 * inter] = _eye(inter, hid)                      # x: two copies of h
    half = slice(0, hid), slice(hid, inter)
    for sl, lag in zip(half, lags):
        _conv_taps(m.conv1d, sl, lag)                          # x reads token t-lag
    bc = slice(inter, inter + 2 * G * st)
    m.conv1d.weight.data[bc] = 0.0                             # B = C = silu(0) = 0
    m.conv1d.bias.data[bc] = 0.0
    m.dt_bias.fill_(-20.0)
    m.D.fill_(1.0)
    m.norm.weight.fill_(1.0)


def _grow_bc(w: torch.Tensor, fresh: torch.Tensor, name: str, src_cfg, dst_cfg,
             new_state_scale: float = NEW_STATE_SCALE) -> torch.Tensor:
    """A Mamba-2 mixer tensor whose rows are [pre | B(G st) | C(G st) | post] (in_proj: pre = z|x,
    post = dt; conv1d: pre = x) from the source's (G_s, st_s) to the destination's (G, st) layout.
    ``fresh``: the destination's freshly initialised tensor (the new state dims' init)."""
    g_s, st_s, g, st = src_cfg.n_groups, src_cfg.state_size, dst_cfg.n_groups, dst_cfg.state_size
    if g % g_s or st < st_s:
        raise ValueError(f"cannot grow {name}: B/C groups x state {g_s}x{st_s} -> {g}x{st}")
    pre = (2 if name.endswith("in_proj.weight") else 1) * dst_cfg.expand * dst_cfg.hidden_size
    out = fresh.clone()
    for i in (0, 1):  # B, C
        s0, d0 = pre + i * g_s * st_s, pre + i * g * st
        blk = out[d0:d0 + g * st].view(g, st, *out.shape[1:])             # [G, st, ...] (a view)
        if name.endswith("in_proj.weight"):
            blk[:, st_s:] *= new_state_scale
        elif name.endswith("bias"):
            blk[:, st_s:] = 0.0
        blk[:, :st_s] = w[s0:s0 + g_s * st_s].view(g_s, st_s, *w.shape[1:]).repeat_interleave(g // g_s, 0)
    out[:pre] = w[:pre]
    out[pre + 2 * g * st:] = w[pre + 2 * g_s * st_s:]
    return out


@torch.no_grad()
def grow_from(model, src_dir: str | Path, prepend: int = 0, new_state_scale: float = NEW_STATE_SCALE) -> dict:
    """Copy a trained model of the same family into a wider-conv and/or deeper ``model`` so that
    the grown model computes exactly the same logits as the source (lab/tests/test_lab_backbone.py).

    * a parameter of the same shape is copied;
    * a short-conv weight [C, 1, K_src] goes to the last K_src taps of [C, 1, K] (index K-1 = t);
      the older taps start at 0, so the conv reads what it read before;
    * the grown model's extra layers keep their fresh init (window/offset/induction heads) except
      the two projections back into the residual stream (attention out_proj, MLP down_proj), which
      start at 0: a new layer adds nothing until training gives it a reason to. ``prepend`` of
      them go before the source's layers (they then read the raw token embeddings, where token
      identity is sharp), the rest after;
    * Mamba-2 B/C (key/query) codes can grow in two ways (``_grow_bc``):
      - a larger state (``state`` > the source's): the source's state dims come first in every
        group; the new ones keep the fresh init's induction taps, with their in_proj rows scaled
        by ``new_state_scale`` and conv bias 0, so they add only O(scale^2) to the output at step 0
        (exactly 0 would be a saddle: B's gradient is proportional to C and vice versa; too small
        and they stay unused, see ``NEW_STATE_SCALE``);
      - more groups (``groups`` a multiple of the source's): each group copies the source group
        its heads read. Not function-preserving: transformers' gated RMSNorm normalises each
        group's slice of the read-out on its own, which on tiny-mamba2-v4 (1 -> 8 groups) changed
        99% of the argmax tokens; tests pin that the copy itself is exact.
    Returns {"copied": n, "conv_padded": n, "bc_grown": n, "new": [names]}.
    """
    from transformers import AutoModelForCausalLM
    src_model = AutoModelForCausalLM.from_pretrained(src_dir)
    src = src_model.state_dict()
    if prepend:  # source layer i becomes layer i + prepend
        src = {re.sub(r"(\.layers\.)(\d+)\.", lambda g: f"{g[1]}{int(g[2]) + prepend}.", k): v
               for k, v in src.items()}
    dst = model.state_dict()
    rep = {"copied": 0, "conv_padded": 0, "bc_grown": 0, "new": []}
    for name, t in dst.items():
        if name not in src:
            rep["new"].append(name)
            if name.endswith(("out_proj.weight", "down_proj.weight")):
                t.zero_()
            continue
        w = src[name]
        if name.endswith("conv1d.weight") and w.shape[-1] < t.shape[-1]:
            w = torch.cat([w.new_zeros(*w.shape[:-1], t.shape[-1] - w.shape[-1]), w], -1)
            rep["conv_padded"] += 1
        if w.shape != t.shape and re.search(r"mixer\.(in_proj\.weight|conv1d\.(weight|bias))$", name):
            w = _grow_bc(w, t, name, src_model.config, model.config, new_state_scale)
            rep["bc_grown"] += 1
        if w.shape != t.shape:
            raise ValueError(f"cannot grow {name}: source {tuple(src[name].shape)} -> {tuple(t.shape)}")
        t.copy_(w)
        rep["copied"] += 1
    missing = sorted(set(src) - set(dst))
    if missing:
        raise ValueError(f"grown model lacks source parameters {missing[:4]}...")
    return rep


def number_start_ids(tok) -> list[int]:
    """Token ids of " <digits>": the first token of every number value in the training formats."""
    return sorted(i for t, i in tok.get_vocab().items() if t[:1] == " " and t[1:].isdigit())


def fit_write_gate(layer, embeddings: torch.Tensor, write_ids: list[int], heads: list[int],
                   l2: float = 1e-3) -> float:
    """Set the write strength beta = sigmoid(in_proj_b h) of GDN ``heads`` in ``layer`` so that
    the head writes (beta ~ 1) at tokens ``write_ids`` and hardly anywhere else: logistic
    regression of the layer's normed input embeddings, [V, hidden] -> is-a-write-token.

    Why: an offset head's keys are single tokens, so with the random init's beta ~ 0.5 at every
    position ~1K writes of the haystack swamp the needle's (measured on the grown tiny-gdn-v2:
    first value digit retrieved 0/10 with the init gate, 9/10 with this one). Layer 0 only: its
    input is the token embedding itself. ``in_proj_b`` has no bias, so "off by default" needs a
    trained (anisotropic) table; on v2's the largest beta on another token is 0.27. Returns it.
    """
    with torch.no_grad():
        x = layer.input_layernorm(embeddings)                    # [V, hidden]
    y = torch.zeros(x.shape[0])
    y[write_ids] = 1.0
    w = fit_gate_weights(x, y, l2)
    with torch.no_grad():
        for h in heads:
            layer.linear_attn.in_proj_b.weight[h] = w
        return float((x @ w).sigmoid()[y == 0].max())


def fit_dt_gate(block, embeddings: torch.Tensor, write_ids: list[int], l2: float = 1e-3) -> tuple[float, float]:
    """Mamba-2 analogue of ``fit_write_gate`` for a first layer (``block`` = Mamba2Block, whose
    input is the token embedding): every head's dt = softplus(in_proj_dt h + dt_bias) is fitted
    (logistic regression with a bias, the bias going to ``dt_bias``) to be large at ``write_ids``
    and ~0 elsewhere. dt is both Mamba-2's write strength (h += dt B x) and its forget step
    (h *= exp(-A dt)), so dt ~ 0 on the haystack also means the needles' writes are kept.
    Returns (smallest dt on a write token, largest dt elsewhere)."""
    m = block.mixer
    with torch.no_grad():
        x = block.norm(embeddings)                                   # [V, hidden]
    y = torch.zeros(x.shape[0])
    y[write_ids] = 1.0
    wb = fit_gate_weights(torch.cat([x, torch.ones(len(x), 1)], 1), y, l2)  # [hidden + 1]
    w, b = wb[:-1], wb[-1]
    with torch.no_grad():
        m.in_proj.weight[-m.num_heads:] = w                          # rows: ... | dt(heads)
        m.dt_bias.fill_(float(b))
        dt = F.softplus(x @ w + b)                                   # [V]
    return float(dt[y == 1].min()), float(dt[y == 0].max())


def mamba2_circuit_rows(mixer) -> slice:
    """in_proj rows of a Mamba2Mixer that build the state (x | B | C | dt), as opposed to the
    output gate z (the first intermediate_size rows), which belongs to the read-out."""
    return slice(mixer.intermediate_size, mixer.in_proj.weight.shape[0])


def fit_gate_weights(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-3) -> torch.Tensor:
    """Bias-free logistic regression x [N, H] -> y [N] in {0, 1}, classes balanced; returns w [H]."""
    w = torch.zeros(x.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=300)
    pos_weight = (len(y) - y.sum()) / y.sum()

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w, y, pos_weight=pos_weight) + l2 * w.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


# ------------------------------------------------------------------------------------------------
# data

def encode_example(ex: dict, tok) -> tuple[list[int], int]:
    """ids = context+question, then the answer and EOS; returns (ids, answer_start)."""
    prompt = tok(ex["context"] + ex["question"], add_special_tokens=False)["input_ids"]
    ans = tok(ruler.answer_text(ex["answers"]), add_special_tokens=False)["input_ids"]
    return prompt + ans + [tok.eos_token_id], len(prompt)


def draw_task(rng: random.Random, tasks, phrasings_frac: float) -> str:
    """One sequence's task from a phase's list (a task listed twice is drawn twice as often). A list
    with both phrased and RULER tasks draws a phrased one with probability ``phrasings_frac``, else a
    RULER one; any other list, uniformly (one rng draw, as before phrased tasks existed)."""
    phr = [t for t in tasks if t in phrased.TASKS]
    if not phr or len(phr) == len(tasks):
        return rng.choice(tasks)
    rest = [t for t in tasks if t not in phrased.TASKS]
    return rng.choice(phr if rng.random() < phrasings_frac else rest)


def make_batch(step: int, phase: int, tc: TrainConfig, tok):
    """One training batch: ids [B, T], answer mask [B, T] (targets), lm mask [B, T]."""
    rng = random.Random(f"batch|{tc.seed}|{step}")
    lo, hi, tasks = tc.phases[phase][:3]
    length = rng.randint(lo, hi)
    bsz = max(1, tc.tokens_per_step // length)
    seqs = []
    for _ in range(bsz):
        if rng.random() < tc.prose_frac and hs.essay_available():
            text = hs.essay_slice(int(length * 0.8), rng.randrange(len(hs.essay_words())))
            ids = tok(text, add_special_tokens=False)["input_ids"][:length]
            seqs.append((ids, len(ids)))
        else:
            task = draw_task(rng, tasks, tc.phrasings_frac)
            ex = generate_train(task, length, rng.randrange(1 << 30), tok, tc.seed)
            seqs.append(encode_example(ex, tok))
    T = max(len(s) for s, _ in seqs)
    ids = torch.full((bsz, T), tok.pad_token_id, dtype=torch.long)
    ans = torch.zeros((bsz, T), dtype=torch.bool)  # position t predicts token t+1
    lm = torch.zeros((bsz, T), dtype=torch.bool)
    for i, (s, a) in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        lm[i, :min(a, len(s)) - 1] = True
        ans[i, a - 1:len(s) - 1] = True
    return ids, ans, lm


def loss_fn(model, ids, ans, lm, lm_weight):
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]  # [B, T-1, V]
    tgt = ids[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1),
                         reduction="none").view_as(tgt)
    a, l = ans[:, :-1], lm[:, :-1]
    ans_loss = (ce * a).sum() / a.sum().clamp(min=1)
    lm_loss = (ce * l).sum() / l.sum().clamp(min=1)
    with torch.no_grad():
        pred = logits.argmax(-1)
        ok = ((pred == tgt) | ~a).all(dim=1) & a.any(dim=1)
        em = ok.float().sum() / a.any(dim=1).float().sum().clamp(min=1)
    return ans_loss + lm_weight * lm_loss, ans_loss.item(), lm_loss.item(), em.item()


# ------------------------------------------------------------------------------------------------
# evaluation

def _counting_cache(config):
    """DynamicCache that counts tokens itself: all-linear qwen3_5 configs have no attention layer
    to ask, and transformers' cache raises in ``get_seq_length`` for them."""
    from transformers import DynamicCache

    class CountingCache(DynamicCache):
        seen = 0

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.seen

        def get_query_offset(self, layer_idx: int = 0) -> int:
            return self.seen

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
            return self.seen + query_length, 0

    return CountingCache(config=config)


@torch.no_grad()
def greedy(model, ids: list[int], max_new: int, eos: int, use_cache: bool = True) -> list[int]:
    """Greedy decoding: prefill once, then one token per step from the recurrent state.

    ``use_cache=False`` re-reads the whole sequence every step (slow reference path; the tests
    check both agree)."""
    out: list[int] = []
    dev = next(model.parameters()).device  # a CUDA eval (GPU lease) as well as CPU
    if not use_cache:
        x = torch.tensor([ids], device=dev)
        for _ in range(max_new):
            nxt = int(model(input_ids=x, use_cache=False).logits[0, -1].argmax())
            if nxt == eos:
                break
            out.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]], device=dev)], dim=1)
        return out
    cache = _counting_cache(model.config)
    x = torch.tensor([ids], device=dev)
    for _ in range(max_new):
        logits = model(input_ids=x, cache=cache, use_cache=True).logits
        cache.seen += x.shape[1]
        nxt = int(logits[0, -1].argmax())
        if nxt == eos:
            break
        out.append(nxt)
        x = torch.tensor([[nxt]], device=dev)
    return out


@torch.no_grad()
def evaluate(model, tok, tasks, length: int, n: int, seed: int = 0) -> dict[str, float]:
    """RULER score (string_match_all, 0-100) per task with greedy decoding, test-split keys."""
    model.eval()
    res = {}
    for task in tasks:
        scores = []
        for i in range(n):
            ex = ruler.generate(task, length, i, tok, seed=seed, split="test")
            prompt = tok(ex["context"] + ex["question"], add_special_tokens=False)["input_ids"]
            budget = len(tok(ruler.answer_text(ex["answers"]), add_special_tokens=False)["input_ids"]) + 2
            pred = tok.decode(greedy(model, prompt, budget, tok.eos_token_id))
            scores.append(ruler.score(task, pred, ex["answers"]))
        res[task] = sum(scores) / len(scores)
    model.train()
    return res


# ------------------------------------------------------------------------------------------------
# training loop with checkpoint/resume

def lr_at(step_frac: float, step: int, tc: TrainConfig) -> float:
    warm = min(1.0, (step + 1) / tc.warmup_steps)
    cos = tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(step_frac, 1.0)))
    return tc.lr * warm * cos


def _source_layers(src_dir: str) -> int:
    cfg = json.loads((Path(src_dir) / "config.json").read_text())
    return cfg.get("num_hidden_layers") or cfg["text_config"]["num_hidden_layers"]


def _source_conv(src_dir: str):
    """Short-conv kernel size from an HF config (GDN or Mamba-2 naming); "?" if absent."""
    cfg = json.loads((Path(src_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return cfg.get("linear_conv_kernel_dim") or cfg.get("conv_kernel") or "?"


def _source_meta(src_dir: str) -> dict:
    """What a grown model started from: the source's path and training totals (its train_meta)."""
    p = Path(src_dir) / "train_meta.json"
    m = json.loads(p.read_text()) if p.is_file() else {}
    return {"path": str(src_dir), "steps": m.get("steps"), "tokens": m.get("tokens"),
            "wall_s": m.get("wall_s"), "model": m.get("model")}


LINEAGE_KEYS = ("model", "train", "device", "phases", "phase_log", "params", "steps", "tokens", "wall_s", "eval")


def lineage_entry(src_dir: str, git_commit: str | None = None) -> dict:
    """One run of a lineage chain, from its model dir's train_meta.json: enough to print its
    reproduce command and scores after the checkpoint itself is gone (``git_commit``: a commit
    whose tree still holds the dir, so ``git checkout <commit> -- <dir>`` restores it)."""
    p = Path(src_dir) / "train_meta.json"
    m = json.loads(p.read_text()) if p.is_file() else {}
    entry = {"name": Path(src_dir).name, "path": str(src_dir), **{k: m[k] for k in LINEAGE_KEYS if k in m}}
    return {**entry, **({"git_commit": git_commit} if git_commit else {})}


def source_lineage(src_dir: str) -> list[dict]:
    """The runs that led to ``src_dir``, oldest first, ``src_dir`` itself last (its own recorded
    lineage, if any, comes before it)."""
    p = Path(src_dir) / "train_meta.json"
    m = json.loads(p.read_text()) if p.is_file() else {}
    return list(m.get("lineage", [])) + [lineage_entry(src_dir)]


def export(model, tok, out_dir: Path, meta: dict) -> None:
    """Write the HF model dir (config, safetensors, tokenizer, train_meta.json)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    (out_dir / "train_meta.json").write_text(json.dumps(meta, indent=2))


def _freeze_mixer(model, i: int, is_readout) -> list:
    """Hold layer ``i``'s state-building parameters (q/k/v/conv/gates; Mamba-2: x/B/C/dt rows of
    in_proj, conv, dt_bias, A_log, D) at their current values; its read-out keeps training.
    Returns [(param, rows, values)] for row blocks that share a tensor with trained rows (Mamba-2's
    in_proj): the caller writes them back after every optimizer step (AdamW's decoupled weight
    decay would shrink them even with a zero gradient)."""
    held = []
    for n, p in model.named_parameters():
        if f".layers.{i}." not in n:
            continue
        if n.endswith("mixer.in_proj.weight"):  # z rows train, the circuit rows are held
            rows = mamba2_circuit_rows(model.get_submodule(n[:-len(".in_proj.weight")]))
            held.append((p, rows, p.detach()[rows].clone()))
        elif not is_readout(n):
            p.requires_grad_(False)
    return held


def train(mc: ModelConfig, tc: TrainConfig, out_dir: Path, run_dir: Path, tok, log=print):
    torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = run_dir / "ckpt.pt"
    model = build_model(mc, tok)
    grown = grow_from(model, tc.init_from, tc.grow_prepend, tc.new_state_scale) if tc.init_from and not ckpt_path.exists() else None
    fresh = not tc.init_from and not ckpt_path.exists()
    if tc.product_layer and (grown or fresh):  # the (new) first layer as a bigram product layer
        if mc.family != "mamba2" or (grown and tc.grow_prepend != 1):
            raise ValueError("product_layer builds layer 0 of a fresh Mamba-2 or the one prepended layer "
                             f"of a grown one (family={mc.family}, grow_prepend={tc.grow_prepend})")
        _init_mamba2_product(model.backbone.layers[0].mixer, PRODUCT_LAGS[tc.product_layer], tc.seed)
        log(f"layer 0 built as a bigram product layer, x lags {PRODUCT_LAGS[tc.product_layer]}")
    elif grown and mc.offset_heads and tc.grow_prepend and mc.family == "mamba2":  # see fit_dt_gate
        lo, leak = fit_dt_gate(model.backbone.layers[0], model.get_input_embeddings().weight.detach(),
                               number_start_ids(tok))
        log(f"offset layer 0 writes at number starts (dt >= {lo:.2f} there, max dt elsewhere {leak:.3f})")
    elif grown and mc.offset_heads and tc.grow_prepend:  # the new first layer's offset heads (see fit_write_gate)
        heads = list(range(mc.window_heads, mc.window_heads + len(mc.offset_heads)))
        leak = fit_write_gate(model.model.layers[0], model.get_input_embeddings().weight.detach(),
                              number_start_ids(tok), heads)
        log(f"offset heads {heads} of layer 0 write at number starts (max beta elsewhere {leak:.2f})")
    model = model.to(tc.device)
    # the new layers' read-out (zero out_proj, output gate, MLP) at a higher lr: at the shared lr
    # their out_proj grew to a norm of 0.7 in 300 steps against ~20 for the trained layers, so their
    # answer never won. Not their q/k/v/conv/gates: at 10x those lost the offset head's retrieval
    # (first value digit 8/10 -> 0/10 in 460 steps) before the read-out could use it.
    new_idx = set(range(tc.grow_prepend)) | set(range(tc.grow_prepend + _source_layers(tc.init_from),
                                                      mc.layers)) if tc.init_from else set()
    # read-out = what maps the layer's state read into the residual stream. Mamba-2's in_proj holds
    # both the output gate z and the circuit (x | B | C | dt): it counts as read-out and, when
    # frozen, only its circuit rows are held (written back after each step; see _freeze_mixer)
    readout = ("out_proj", "in_proj_z", "linear_attn.norm", "mlp.", "post_attention_layernorm",
               "mixer.norm", "mixer.in_proj")
    is_readout = lambda n: any(r in n for r in readout)  # noqa: E731
    in_new = lambda n: any(f".layers.{i}." in n for i in new_idx)  # noqa: E731
    new_readout = lambda n: in_new(n) and is_readout(n)  # noqa: E731
    frozen = set(tc.freeze_mixer_layers)
    for i in frozen:  # e.g. a grown model's built layer 0, when it is trained further
        if not 0 <= i < mc.layers:
            raise ValueError(f"freeze_mixer_layers: layer {i} out of range for {mc.layers} layers")
    if tc.freeze_new_mixer:  # the init's circuits (offset heads + their write gate) stay as built
        frozen |= new_idx
    held = [h for i in sorted(frozen) for h in _freeze_mixer(model, i, is_readout)]
    groups = [{"params": [p for n, p in model.named_parameters() if not new_readout(n) and p.requires_grad],
               "lr_mult": 1.0},
              {"params": [p for n, p in model.named_parameters() if new_readout(n)],
               "lr_mult": tc.new_layer_lr_mult}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=tc.lr, betas=(0.9, 0.95),
                            weight_decay=tc.weight_decay)
    step, elapsed, tokens, phase = 0, 0.0, 0, 0
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False, map_location=tc.device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, elapsed, tokens = ck["step"], ck["elapsed"], ck["tokens"]
        torch.set_rng_state(ck["torch_rng"].cpu())
        phase = ck.get("phase", 0)
        log(f"resumed from {ckpt_path} at step {step}, {elapsed:.0f}s, {tokens} tokens")
    held = [(p, rows, p.detach()[rows].clone()) for p, rows, _ in held]  # the loaded values
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{mc.family}: {n_params} params; budget {tc.minutes} min"
        + (f"; grown from {tc.init_from}: {grown['copied']} copied, {grown['conv_padded']} convs "
           f"padded, {len(grown['new'])} new tensors" if grown else ""))
    budget = tc.minutes * 60
    t0, last_ckpt = time.time() - elapsed, time.time()
    ema = None
    phase_log = ck.get("phase_log", []) if ckpt_path.exists() else []

    # where a grown model came from, read once: a resumed run whose source is gone keeps what its
    # first save recorded
    old_meta = json.loads((out_dir / "train_meta.json").read_text()) if (out_dir / "train_meta.json").is_file() else {}
    if tc.init_from and Path(tc.init_from, "config.json").is_file():
        source, lineage = _source_meta(tc.init_from), source_lineage(tc.init_from)
    else:
        source, lineage = old_meta.get("init_from"), old_meta.get("lineage", [])

    def meta():
        return {"model": asdict(mc), "train": {k: v for k, v in asdict(tc).items() if k not in ("phases", "device")},
                "device": tc.device,
                "phases": phases_json(tc.phases),
                "phase_log": phase_log,
                "params": n_params, "steps": step, "tokens": tokens,
                **({"init_from": source or {"path": tc.init_from}} if tc.init_from else {}),
                **({"lineage": lineage} if tc.init_from and lineage else {}),
                "wall_s": round(time.time() - t0, 1)}

    def save():
        # tmp + rename: a run killed mid-save (a session ends) keeps its previous checkpoint
        tmp = ckpt_path.with_suffix(".pt.tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "elapsed": time.time() - t0, "tokens": tokens, "phase": phase,
                    "phase_log": phase_log,
                    "torch_rng": torch.get_rng_state()}, tmp)
        tmp.replace(ckpt_path)
        export(model, tok, out_dir, meta())

    model.train()
    while time.time() - t0 < budget and (tc.max_steps is None or step < tc.max_steps):
        frac = (time.time() - t0) / budget
        if phase + 1 < len(tc.phases) and (frac >= tc.phases[phase][4] or (
                ema is not None and step >= 20 and ema[2] >= tc.phases[phase][3])):
            phase += 1
            ema = None
            phase_log.append({"phase": phase, "step": step, "elapsed_s": round(time.time() - t0)})
            log(f"advancing to phase {phase} at step {step}")
        ids, ans, lm = (x.to(tc.device) for x in make_batch(step, phase, tc, tok))
        for g in opt.param_groups:
            g["lr"] = lr_at(frac, step, tc) * g.get("lr_mult", 1.0)
        loss, a_l, l_l, em = loss_fn(model, ids, ans, lm, tc.lm_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for p, rows, values in held:
                p[rows] = values
        step += 1
        tokens += int(ids.numel())
        ema = (a_l, l_l, em) if ema is None else tuple(0.9 * e + 0.1 * v for e, v in zip(ema, (a_l, l_l, em)))
        if step % 10 == 0:
            log(f"step {step} t={time.time() - t0:.0f}s frac={frac:.3f} ph={phase} len={ids.shape[1]} "
                f"ans={ema[0]:.3f} lm={ema[1]:.3f} tf_em={ema[2]:.2f} lr={opt.param_groups[0]['lr']:.2e}")
        if time.time() - last_ckpt > tc.ckpt_every_s:
            save()
            last_ckpt = time.time()
            log(f"checkpoint at step {step}")
    save()
    log(f"done: {step} steps, {tokens} tokens, {time.time() - t0:.0f}s")
    return model, meta()


# ------------------------------------------------------------------------------------------------
# reproduce commands: the lab/train_backbone.py `--set` overrides that rebuild a recorded run

CLI = "python lab/train_backbone.py"
# keys every reproduce command spells out even at their default (the run's shape and budget at a glance)
ALWAYS_SHOWN = ("model.family", "model.layers", "model.hidden", "model.heads", "model.mlp", "train.minutes",
                "train.seed", "train.lr", "train.tokens_per_step", "train.threads")


def _yaml_value(v) -> str:
    """A `--set` value as YAML that pipeline.config parses back to the same Python value."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        s = repr(v)
        s = s[:-2] if s.endswith(".0") else s
        mant, _, exp = s.partition("e")
        return f"{mant}.0e{exp}" if exp and "." not in mant else s   # YAML 1.1 floats need a dot
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_yaml_value(x) for x in v) + "]"
    if v is None:
        return "null"
    return str(v)


def curriculum_name(phases: list) -> str | None:
    """The PHASES name of a recorded curriculum (None: not a named one)."""
    return next((k for k, v in PHASES.items() if phases_json(v) == phases_json(phases)), None)


def reproduce_overrides(meta: dict, out: str) -> list[str]:
    """``key=value`` overrides for lab/train_backbone.py that rebuild the run recorded in ``meta``
    (a train_meta.json or a lineage entry): the keys in ALWAYS_SHOWN and every key off its default.
    Keys a recorded run predates are absent from ``meta`` and stay at their defaults, which is
    what the code did then."""
    mdef, tdef = asdict(ModelConfig()), asdict(TrainConfig())
    tr = {**meta["train"], "device": meta.get("device", "cpu")}
    out_args = [f"out={out}"]
    for prefix, rec, dflt in (("model", meta["model"], mdef), ("train", tr, tdef)):
        for k, v in rec.items():
            if k == "phases" or k not in dflt:
                continue
            key = f"{prefix}.{k}"
            same = json.loads(json.dumps(v)) == json.loads(json.dumps(dflt[k]))
            if key in ALWAYS_SHOWN or not same:
                out_args.append(f"{key}={_yaml_value(v)}")
    name = curriculum_name(meta["phases"])
    auto = "grow" if tr.get("init_from") else "scratch"
    if name is None:
        out_args.append(f"train.phases={_yaml_value(meta['phases'])}")
    elif name != auto or tr.get("init_from"):
        out_args.append(f"curriculum={name}")
    return out_args


def reproduce_command(meta: dict, out: str, indent: str = "    ") -> str:
    """The shell command (one `--set` per key, wrapped) that rebuilds the run in ``meta``."""
    import shlex
    sets = [f"--set {shlex.quote(o)}" for o in reproduce_overrides(meta, out)]
    lines, cur = [], f"{indent}{CLI}"
    for s in sets:
        if len(cur) + 1 + len(s) > 100:
            lines.append(cur + " \\")
            cur = indent + "    " + s
        else:
            cur += " " + s
    return "\n".join(lines + [cur])


def eval_commands(out_dir: Path, evals: list[dict]) -> str:
    """The eval-only command(s) that measured the table (one per number of examples)."""
    by_n: dict[int, list[int]] = {}
    for e in evals:
        by_n.setdefault(e["n"], []).append(e["length"])
    if not by_n:
        return ""
    cmds = [f"    {CLI} --set out=models/{out_dir.name} --set eval_only=true \\\n"
            f"        --set 'eval.lengths={_yaml_value(sorted(ls))}' --set eval.n={n} --set eval.write_readme=true"
            for n, ls in sorted(by_n.items(), reverse=True)]
    return " The table below was measured with\n\n" + "\n".join(cmds)


def _scores_line(evals: list[dict]) -> str:
    """The scores of the eval with the most tasks at the longest length up to 2K (the training
    lengths), most examples breaking ties."""
    best = max((e for e in evals if e["length"] <= 2048), key=lambda e: (len(e["scores"]), e["length"], e["n"]),
               default=None)
    if best is None:
        return ""
    short = {t: t.removeprefix("niah_") for t in best["scores"]}
    return (f"; at {best['length']} tokens (N={best['n']}): "
            + ", ".join(f"{short[t]} {s:.1f}" for t, s in best["scores"].items()))


def _run_summary(meta: dict) -> str:
    src = (meta.get("train") or {}).get("init_from")
    start = f"from `{Path(src).name}`" if src else "from scratch"
    return (f"{start}, {meta['train']['minutes']:g} min budget, {meta.get('steps', 0):,} steps, "
            f"{meta.get('tokens', 0):,} tokens{_scores_line(meta.get('eval', []))}")


OVERWRITE = ("a run refuses to replace a checkpoint it did not write, so add `--set overwrite=true` to "
             "retrain a shipped one in place, or give another `out`")


def lineage_section(out_dir: Path, meta: dict) -> str:
    """How to rebuild this checkpoint: the whole chain of runs for a grown / continued model (the
    intermediates are restorable from git history when their entry names a commit)."""
    chain = list(meta.get("lineage", []))
    here = f"models/{out_dir.name}"
    if not chain:
        return ("## Reproduce\n\nOne run from scratch (resumes from `runs/<name>/ckpt.pt` if present; "
                + OVERWRITE + "):\n\n"
                + reproduce_command(meta, here) + "\n")
    commits = sorted({e["git_commit"] for e in chain if e.get("git_commit")})
    text = [f"## Lineage and reproduce\n\n{len(chain) + 1} runs, each started from the checkpoint the previous "
            "one wrote (every run resumes from `runs/<name>/ckpt.pt` if present; " + OVERWRITE + "):\n"]
    for i, e in enumerate(chain, 1):
        where = (f"not shipped; in git history: `git checkout {e['git_commit'][:12]} -- {e['path']}`"
                 if e.get("git_commit") else "not shipped")
        if "model" not in e:   # a source without a train_meta.json: no command to give
            text.append(f"{i}. `{e['name']}` ({where}; no training record)\n")
            continue
        note = f" {e['note'].strip()}" if e.get("note") else ""
        text.append(f"{i}. `{e['name']}` ({where}): {_run_summary(e)}.{note}\n\n"
                    + reproduce_command(e, e["path"], indent="       ") + "\n")
    text.append(f"{len(chain) + 1}. `{out_dir.name}` (this checkpoint): {_run_summary(meta)}.\n\n"
                + reproduce_command(meta, here, indent="       ") + "\n")
    if commits:
        text.append("To redo only the last run(s), restore the checkpoint before them from git history "
                    f"(commit {', '.join(c[:12] for c in commits)}) and start the chain there.\n")
    return "\n".join(text)


# ------------------------------------------------------------------------------------------------
# model card

FAMILY_TEXT = {
    "gdn": ("transformers `Qwen3_5ForCausalLM` (`Qwen3_5TextConfig`), every layer "
            "`linear_attention` (pure Gated DeltaNet)",
            "All-linear qwen3_5 configs raise in `get_seq_length` on cached forwards; the config "
            "ships with `use_cache=false`, call `model(input_ids, use_cache=False)` or use a "
            "`DynamicCache` subclass that counts tokens itself for incremental decoding."),
    "mamba2": ("transformers `Mamba2ForCausalLM` (`Mamba2Config`)",
               "The config ships with `use_cache=false`; pass `use_cache=True` to use the cache."),
}


def _src_shapes(src: dict) -> tuple[int, int]:
    """(Mamba-2 state size, B/C groups) of a grown model's source: its config.json while the dir
    exists, else what train_meta recorded of it (a deleted intermediate)."""
    cfg_path = Path(src["path"]) / "config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        return cfg.get("state_size", 64), cfg.get("n_groups", 1)
    m = src.get("model") or {}
    return m.get("state", 64), m.get("groups", 1)


def write_readme(out_dir: Path, meta: dict, evals: list[dict]) -> None:
    mc = meta["model"]
    arch, cache_note = FAMILY_TEXT[mc["family"]]
    size = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file() and f.name != "README.md")
    rows = []
    for e in evals:
        for task, s in e["scores"].items():
            rows.append(f"| {e['length']} | {task} | {e['n']} | {s:.1f} |")
    phases = "\n".join(f"  - lengths {p[0]}-{p[1]}, tasks {', '.join(p[2])}; next phase when the "
                       f"teacher-forced answer EM (EMA) >= {p[3]} or at {p[4]:.0%} of the budget"
                       for p in meta["phases"])
    phases += "\n  - phase changes in this run: " + json.dumps(meta.get("phase_log", []))
    tr = meta["train"]
    phr = sorted({t for p in meta["phases"] for t in p[2] if t in phrased.TASKS})
    phrased_text = "" if not phr else (
        f"\n  Phrased needles (`nbcore/tasks/phrased.py`: {', '.join(phr)}; the TRAIN phrasings in the "
        f"training prose, never the HELD-OUT ones) are {tr.get('phrasings_frac', 0.5):.0%} of the needle "
        f"sequences of a phase that lists them with RULER tasks.")
    bigram = mc.get("bigram_heads", 0)
    where = (f"{bigram}/{mc['heads']} of the shared B/C state dims (C = query, B = key)"
             if mc["family"] == "mamba2" else f"{bigram} of the {mc['heads']} heads per layer")
    bigram_text = (f"\n  In {where} the induction init matches bigrams:"
                   f"\n  q reads tokens t and t-1, k reads t-1 and t-2, so a repeated token inside a value"
                   f"\n  (uuids, 7-digit numbers) does not make the copy lose its place." if bigram else "")
    product_text = "" if not tr.get("product_layer") else (
        f"\n- Layer 0 (the new first layer when grown) is built as a bigram *product* layer "
        f"(`train.product_layer={tr['product_layer']}`, `_init_mamba2_product`): x reads token t-lag "
        f"(lags {PRODUCT_LAGS[tr['product_layer']]}), the scan is off (B = C = 0, D = 1) and the output "
        f"gate multiplies it by token t, so the layer writes AND-like codes of token pairs that the "
        f"induction layers after it can key on (a Mamba-2 block has no MLP to form them).")
    grown_text, title = "", "trained from scratch on CPU"
    src = meta.get("init_from")
    if src:  # a grown model (grow_from): where it started
        offsets = ", ".join(f"({a}, {b})" for a, b in mc.get("offset_heads", ()))
        title = f"grown from {Path(src['path']).name} and trained on CPU"
        src_layers = (src.get("model") or {}).get("layers") or _source_layers(src["path"])
        src_conv = (src.get("model") or {}).get("conv") or _source_conv(src["path"])
        trained = f" ({src['steps']} steps, {src['tokens']:,} tokens)" if src.get("steps") else ""
        frozen = tr.get("freeze_mixer_layers") or ()
        held = ("x/B/C/dt rows of `in_proj`, conv, dt_bias, A and D" if mc["family"] == "mamba2"
                else "q/k/v/conv/gates")   # what _freeze_mixer holds per family
        frozen_text = (f" The {held} of layer(s) {', '.join(map(str, frozen))} stay as loaded "
                       f"(only their read-out trains)." if frozen else "")
        src_bc = _src_shapes(src)
        bc = (mc.get("state", 64), mc.get("groups", 1))
        bc_text = "" if mc["family"] != "mamba2" or bc == src_bc else (
            f"\n- B/C codes grown by `grow_from` (`_grow_bc`): state {src_bc[0]} -> {bc[0]}, B/C groups "
            f"{src_bc[1]} -> {bc[1]}. The source's state dims are copied into every group; new state dims "
            f"start at {tr.get('new_state_scale', NEW_STATE_SCALE):g} x the fresh induction init (in_proj rows; conv "
            f"bias 0), small enough that the run starts from the source's answers."
            + (" More groups change transformers' per-group gated norm, so the start is not the source's "
               "output." if bc[1] != src_bc[1] else ""))
        if mc["layers"] == src_layers and str(src_conv) == str(mc["conv"]) and bc_text:  # B/C grown only
            title = f"grown from {Path(src['path']).name} (B/C state) and trained on CPU"
            grown_text = (f"\n- Started from `{src['path']}`{trained}; every other tensor copied.{frozen_text}"
                          f" Steps, tokens and wall time below are this run's only.{bc_text}")
        elif mc["layers"] == src_layers and str(src_conv) == str(mc["conv"]):  # same shapes: a continuation
            title = f"continued from {Path(src['path']).name} on CPU"
            grown_text = (f"\n- Continued from `{src['path']}`{trained} (same shapes: every tensor copied, "
                          f"so the run starts from exactly that model; the lineage below says how it was "
                          f"built).{frozen_text} Steps, tokens and wall time below are this run's only.")
        else:
            grown_text = (f"\n- Grown from `{src['path']}`{trained} by "
                          f"`grow_from`: {mc['layers'] - src_layers} new layer(s)"
                          + (" placed first" if tr.get("grow_prepend") else " placed last")
                          + f", short conv {src_conv} -> {mc['conv']} (old taps kept at the newest "
                          f"positions); at step 0 the grown model's logits equal the source's exactly. "
                          + (f"The new layer's offset heads {offsets} (q reads t-a, k reads t-b) write only at "
                             f"number starts (a fitted write gate); " if offsets and mc["family"] != "mamba2" else "")
                          + (f"The new layer is an offset layer {offsets} (C reads t-a, B reads t-b, as sparse "
                             f"codes silu(3e - 3)) whose dt is fitted to write at number starts only "
                             f"(`fit_dt_gate`); " if offsets and mc["family"] == "mamba2" else "")
                          + (f"its {held} stay frozen"
                             + (" (its z gate trains); " if mc["family"] == "mamba2" else "; ")
                             if tr.get("freeze_new_mixer") else "")
                          + f"its read-out trains at {tr.get('new_layer_lr_mult', 1):g}x the lr.{frozen_text} "
                          f"Steps, tokens and wall time below are this run's only.")
    ssm_text = (f" state {mc.get('state', 64)}, {mc.get('groups', 1)} B/C group(s),"
                if mc["family"] == "mamba2" else "")
    about = ("\n\n" + meta["about"].strip()) if meta.get("about") else ""  # hand-written, kept in train_meta.json
    text = f"""# {out_dir.name}: a tiny {mc['family'].upper()} backbone {title}

Architecture: {arch}; {mc['layers']} layers, hidden {mc['hidden']}, head dim {mc['head_dim']},{ssm_text}
conv {mc['conv']}, tied embeddings, {meta['params']:,} parameters, {size / 2**20:.1f} MiB on disk
(fp32 safetensors). Tokenizer: the project BPE (`nbcore/tasks/tokenizer.py`, 2,048 entries,
single-digit tokens). {cache_note}

It exists so NoteBank's pipeline, tests and benchmarks have a real recurrent model that can read a
RULER haystack; it is not a language model of any quality.{about}

## Recipe
- Initialisation (why it learns at all in minutes): long-memory decay init (per-token decay
  close to 1) and an induction init: query, key and value projections start as identity slices of
  the hidden state (key = query), the key's short conv reads token t-1 while query and value read
  token t, and the output projection starts as identity. A small random q=k copy (std 0.02) was
  wiped out by Adam's first steps and stayed at chance; the O(1) identity survives and the answer
  loss leaves chance within ~60 steps. See `lab/backbone.py`.{bigram_text}{product_text}{grown_text}
- Data, generated on the fly (`nbcore/tasks/ruler.py`, train-split keys, fresh random values):
  the six NIAH tasks of the NoteBank paper over noise and prose haystacks, plus
  {tr['prose_frac']:.0%} plain prose LM sequences; length curriculum:{phrased_text}
{phases}
- Loss: answer CE + {tr['lm_weight']} x LM CE on all other tokens. AdamW lr {tr['lr']} (warm-up
  {tr['warmup_steps']} steps, cosine to {tr['min_lr_frac']} x over the time budget), betas
  (0.9, 0.95), weight decay {tr['weight_decay']}, grad clip 1.0, ~{tr['tokens_per_step']} tokens per step.
- Seed {tr['seed']}; {meta['steps']} steps, {meta['tokens']:,} tokens, wall time
  {meta['wall_s'] / 60:.1f} min on a 2-core CPU shared with other jobs ({tr['threads']} torch thread(s)).

{lineage_section(out_dir, meta)}
Batches are a pure function of (seed, step, phase), but phases advance on a training metric or a
wall-clock cap and the budget is wall-clock, so a run on a faster or less loaded machine sees more
steps and is not bit-identical.{eval_commands(out_dir, evals)}

## Measured (greedy, RULER string_match_all 0-100, test-split keys, plain reading, seed 0)

Greedy decoding with a token-counting `DynamicCache` (identical output to re-reading the whole
sequence each step; checked in lab/tests/test_lab_greedy.py). Training lengths are 128-2048; 4K and
16K are extrapolation.

| length | task | N | score |
|---|---|---|---|
""" + "\n".join(rows) + "\n"
    if meta.get("notes"):  # hand-written extra measurements kept in train_meta.json
        text += "\n## More measurements\n\n" + meta["notes"].strip() + "\n"
    if meta.get("limits"):  # hand-written diagnosis kept in train_meta.json, survives re-evaluation
        text += "\n## Known limits\n\n" + meta["limits"].strip() + "\n"
    (out_dir / "README.md").write_text(text)
