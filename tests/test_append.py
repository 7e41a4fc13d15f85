"""Incremental append (nbcore.reader.append): continuing an ingested document from its stored
state + writer carry equals a one-shot ingest of the same token sequence (join rule:
nbcore.reader.JOIN_RULE), on real tiny GDN, GDN/attention hybrid and Mamba-2 backbones.

Tolerances (where the append point is not a block boundary, so the kernels see other block
boundaries than one-shot and fp32 sums reassociate):
  - note spans (starts / ends / chunk_index), note token ids, carry ids: identical;
  - state tensors (fp32): atol STATE_ATOL = 1e-5;
  - addresses (bf16): at most one bf16 rounding step apart, |a - b| <= ADDR_RTOL * |b| + 1e-6
    with ADDR_RTOL = 2**-7 (the bf16 spacing relative to the value);
  - carry features: pending/tail distinctiveness atol 1e-5, pending keys atol 1e-5.
Where the append point is a multiple of the block size the backbone calls are one-shot's and
everything is bit-identical (torch.equal).
Measured (torch 2.13 CPU, these configs): max |state diff| 9.5e-7 (hybrid), 3.7e-9 (Mamba-2),
0 (pure GDN); addresses 0 for every family; carry features <= 1.9e-6.
"""
import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from nbcore import NoteBankConfig, WriterCarry, append, encode_parts, ingest, load_backbone
from nbcore.reader import JOIN_RULE
from nbcore.testing import sentence_text, byte_tokenizer, tiny_gdn_config, tiny_mamba2_config

STATE_ATOL = 1e-5
ADDR_RTOL = 2.0 ** -7
FEAT_ATOL = 1e-5

# C=64, tail 8, block 128 (two chunks): small enough that ~700-token documents write many notes.
SMALL = NoteBankConfig(chunk_size=64, note_budget=16, window=8, tail=8, addr_dim=8)
SMALL_BLOCK = 128
# The default tail (32) with a chunk size that makes it a quarter of the region.
TAIL32 = NoteBankConfig(chunk_size=128, note_budget=32, window=16, tail=32, addr_dim=8)
TAIL32_BLOCK = 256
# Addressing variant with a carried running statistic (key_qnovel's query sum) and m = 2 slots.
QNOVEL = NoteBankConfig(chunk_size=64, note_budget=16, window=8, tail=8, addr_dim=8,
                        addr_select="key_qnovel", addr_positions=2)

FAMILIES = {"gdn": lambda: tiny_gdn_config(), "gdn-hybrid": lambda: tiny_gdn_config(hybrid=True),
            "mamba2": lambda: tiny_mamba2_config()}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def bb(request):
    torch.set_num_threads(1)
    return load_backbone(FAMILIES[request.param](), tokenizer=byte_tokenizer(), seed=0)


TEXT = sentence_text(720, seed=3)


def _split(text, cuts):
    cuts = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def _chain(bb, parts, cfg, block, as_ids=False):
    """ingest(parts[0]) then append(part) for each later part."""
    kw = (lambda p: {"token_ids": p}) if as_ids else (lambda p: {"text": p})
    res = ingest(bb, cfg=cfg, block_size=block, **kw(parts[0]))
    for p in parts[1:]:
        res = append(bb, res.state, res.archive, res.carry, cfg=cfg, block_size=block, **kw(p))
    return res


def _diffs(bb, got, want):
    """Check the exact parts; -> max abs diffs of the float parts (0.0 = bit-identical)."""
    a, b = got.archive, want.archive
    assert len(a) == len(b) > 0
    assert np.array_equal(a.starts, b.starts) and np.array_equal(a.ends, b.ends)
    assert np.array_equal(a.chunk_index, b.chunk_index)
    assert all(np.array_equal(x, y) for x, y in zip(a.token_ids, b.token_ids))
    assert a.n_tokens == b.n_tokens == got.n_tokens == want.n_tokens
    assert a.addresses.shape == b.addresses.shape and a.addresses.dtype == torch.bfloat16
    assert a.config == b.config and a.model_fingerprint == b.model_fingerprint
    st_a, st_b = bb.state_to_tensors(got.state), bb.state_to_tensors(want.state)
    assert st_a.keys() == st_b.keys()
    ca, cb = got.carry.to_tensors(), want.carry.to_tensors()
    assert ca.keys() == cb.keys()
    for k in ("carry.pos", "carry.n_chunks", "carry.ids_start", "carry.last_sent", "carry.ids", "carry.sent"):
        assert torch.equal(ca[k], cb[k]), k
    d = {"addr": (a.addresses.float() - b.addresses.float()).abs().max().item(),
         "state": max((st_a[k].float() - st_b[k].float()).abs().max().item() if st_a[k].numel() else 0.0
                      for k in st_a),
         "carry": max(((ca[k].float() - cb[k].float()).abs().max().item() if ca[k].numel() else 0.0)
                      for k in ca if ca[k].is_floating_point())}
    # addresses: at most one bf16 step apart
    assert torch.all((a.addresses.float() - b.addresses.float()).abs()
                     <= ADDR_RTOL * b.addresses.float().abs() + 1e-6), d
    assert d["state"] <= STATE_ATOL and d["carry"] <= FEAT_ATOL, d
    return d


def _assert_bit_identical(bb, got, want):
    assert torch.equal(got.archive.addresses, want.archive.addresses)
    st_a, st_b = bb.state_to_tensors(got.state), bb.state_to_tensors(want.state)
    for k in st_a:
        assert torch.equal(st_a[k], st_b[k]), k
    ca, cb = got.carry.to_tensors(), want.carry.to_tensors()
    for k in ca:
        assert torch.equal(ca[k], cb[k]), k


# (cuts in tokens; with the byte tokenizer 1 char = 1 token). C = 64, tail 8, block 128.
CASES = {
    "inside-chunk": [100],            # 100 % 64 = 36: pending chunk completed by the append
    "inside-tail": [195],             # 195 % 64 = 3 < tail: inside the next region's tail tokens
    "chunk-boundary": [192],          # 192 % 64 = 0 but not a block boundary
    "three-parts": [100, 110],        # second part leaves the chunk incomplete again (10 tokens)
    "three-parts-long": [70, 400],
    "block-boundary": [256],          # multiple of the block: bit-identical
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_append_equals_one_shot(bb, case):
    cuts = CASES[case]
    parts = _split(TEXT, cuts)
    want = ingest(bb, parts=parts, cfg=SMALL, block_size=SMALL_BLOCK)
    got = _chain(bb, parts, SMALL, SMALL_BLOCK)
    d = _diffs(bb, got, want)
    if all(c % SMALL_BLOCK == 0 for c in cuts):
        assert d == {"addr": 0.0, "state": 0.0, "carry": 0.0}
        _assert_bit_identical(bb, got, want)
    # old notes never change: the archive before the last append is a prefix of the result
    first = ingest(bb, parts[0], SMALL, block_size=SMALL_BLOCK)
    n0 = len(first.archive)
    assert np.array_equal(got.archive.starts[:n0], first.archive.starts)
    assert torch.equal(got.archive.addresses[:n0], first.archive.addresses)


def test_append_mid_sentence_uses_the_join_rule(bb):
    # cut inside a word: the join becomes a sentence boundary, so sentence ids differ from a one-shot
    # read of the unsplit text but equal the parts ingest's
    cut = next(i for i in range(150, 200) if TEXT[i - 1].isalpha() and TEXT[i].isalpha())
    parts = [TEXT[:cut], TEXT[cut:]]
    ids, sent = encode_parts(bb, parts)
    assert sent[cut] == sent[cut - 1] + 1
    whole_ids, whole_sent = encode_parts(bb, [TEXT])
    assert np.array_equal(ids, whole_ids) and whole_sent[cut] == whole_sent[cut - 1]
    want = ingest(bb, parts=parts, cfg=SMALL, block_size=SMALL_BLOCK)
    got = _chain(bb, parts, SMALL, SMALL_BLOCK)
    _diffs(bb, got, want)
    assert np.array_equal(got.carry.sent, sent[got.carry.ids_start:])


@pytest.mark.parametrize("cut", [256 + 10, 384, 512], ids=lambda c: f"cut{c}")
def test_append_default_tail32(bb, cut):
    # C = 128, tail 32, block 256: 266 is inside the tail of chunk 2, 384 a chunk boundary, 512 a block
    parts = _split(TEXT, [cut])
    want = ingest(bb, parts=parts, cfg=TAIL32, block_size=TAIL32_BLOCK)
    got = _chain(bb, parts, TAIL32, TAIL32_BLOCK)
    _diffs(bb, got, want)
    assert got.carry.tail_dist.shape[0] == 32
    if cut % TAIL32_BLOCK == 0:
        _assert_bit_identical(bb, got, want)


@pytest.mark.parametrize("cuts", [[100, 300], [256]], ids=["mid", "block"])
def test_append_token_ids_only_equals_ingest_of_concatenation(bb, cuts):
    # no text: the whole document is one sentence, append keeps the previous part's sentence id
    ids = encode_parts(bb, [TEXT])[0]
    pieces = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    want = ingest(bb, token_ids=ids, cfg=SMALL, block_size=SMALL_BLOCK)
    got = _chain(bb, pieces, SMALL, SMALL_BLOCK, as_ids=True)
    _diffs(bb, got, want)
    assert got.carry.last_sent == 0 and not got.carry.sent.any()
    if all(c % SMALL_BLOCK == 0 for c in cuts):
        _assert_bit_identical(bb, got, want)


def test_append_key_qnovel_carries_query_sum(bb):
    parts = _split(TEXT, [100, 300])
    want = ingest(bb, parts=parts, cfg=QNOVEL, block_size=SMALL_BLOCK)
    got = _chain(bb, parts, QNOVEL, SMALL_BLOCK)
    _diffs(bb, got, want)
    assert got.carry.q_sum is not None


def test_carry_safetensors_round_trip_and_inputs_untouched(bb):
    first = ingest(bb, TEXT[:300], SMALL, block_size=SMALL_BLOCK)
    c = first.carry
    assert c.pos == 300 and c.n_chunks == 4 and c.n_pending == 300 - 256
    assert c.ids_start == 256 - SMALL.tail and len(c.ids) == 300 - c.ids_start   # not the whole document
    assert c.pending_keys.shape == (44, bb.n_channels, bb.key_dim)
    # stored next to the backbone state in ONE safetensors blob, deterministic bytes
    state_t = bb.state_to_tensors(first.state)
    carry_t = c.to_tensors()
    assert not set(state_t) & set(carry_t) and all(k.startswith("carry.") for k in carry_t)
    blob = st_save({**state_t, **carry_t})
    assert blob == st_save({**bb.state_to_tensors(first.state), **first.carry.to_tensors()})
    loaded = st_load(blob)
    c2 = WriterCarry.from_tensors(loaded)
    for k, v in c2.to_tensors().items():
        assert torch.equal(v, carry_t[k]), k
    state2 = bb.state_from_tensors({k: v for k, v in loaded.items() if not k.startswith("carry.")})

    snap_state = {k: v.clone() for k, v in bb.state_to_tensors(first.state).items()}
    arch = first.archive
    snap_arch = (arch.starts.copy(), arch.ends.copy(), arch.chunk_index.copy(),
                 [t.copy() for t in arch.token_ids], arch.addresses.clone(), arch.n_tokens)
    snap_carry = {k: v.clone() for k, v in first.carry.to_tensors().items()}

    a = append(bb, first.state, first.archive, first.carry, TEXT[300:], block_size=SMALL_BLOCK)
    b = append(bb, state2, first.archive, loaded, TEXT[300:], block_size=SMALL_BLOCK)   # carry as dict
    _assert_bit_identical(bb, a, b)
    assert np.array_equal(a.archive.starts, b.archive.starts)
    assert len(a.archive) > len(first.archive)

    for k, v in bb.state_to_tensors(first.state).items():
        assert torch.equal(v, snap_state[k]), k
    assert first.state.n_tokens == 300
    assert np.array_equal(arch.starts, snap_arch[0]) and np.array_equal(arch.ends, snap_arch[1])
    assert np.array_equal(arch.chunk_index, snap_arch[2]) and arch.n_tokens == snap_arch[5]
    assert len(arch) == len(snap_arch[3]) and all(np.array_equal(x, y) for x, y in zip(arch.token_ids, snap_arch[3]))
    assert torch.equal(arch.addresses, snap_arch[4])
    for k, v in first.carry.to_tensors().items():
        assert torch.equal(v, snap_carry[k]), k


def test_append_rejects_mismatches(bb):
    first = ingest(bb, TEXT[:200], SMALL, block_size=SMALL_BLOCK)
    with pytest.raises(ValueError, match="carry"):
        append(bb, first.state, first.archive, None, "more text.")
    other = ingest(bb, TEXT[:150], SMALL, block_size=SMALL_BLOCK)
    with pytest.raises(ValueError, match="same document position"):
        append(bb, other.state, first.archive, first.carry, "more text.")
    with pytest.raises(ValueError, match="config"):
        append(bb, first.state, first.archive, first.carry, "more text.", cfg=TAIL32)
    with pytest.raises(ValueError, match="empty"):
        append(bb, first.state, first.archive, first.carry, "")
    assert ingest(bb, TEXT[:200], SMALL, write=False).carry is None


def test_join_rule_is_in_the_docstrings():
    norm = lambda s: " ".join(s.split())
    assert norm(JOIN_RULE) in norm(append.__doc__)


def test_ingest_steps_yields_per_block_and_two_interleaved_reads_equal_separate_ones(bb):
    """ingest_steps yields 0 after tokenising, then the tokens read after each block, and returns
    ingest's result; a NoteBank read and a plain read stepped in alternation (what the overhead
    benchmark's interleaved mode does) give the results each gives alone, bit for bit."""
    from nbcore.reader import ingest_steps

    alone_nb = ingest(bb, TEXT, SMALL, block_size=SMALL_BLOCK)
    alone_plain = ingest(bb, TEXT, SMALL, block_size=SMALL_BLOCK, write=False)
    T = alone_nb.n_tokens
    steps = {"nb": ingest_steps(bb, TEXT, SMALL, block_size=SMALL_BLOCK),
             "plain": ingest_steps(bb, TEXT, SMALL, block_size=SMALL_BLOCK, write=False)}
    seen, out = {k: [] for k in steps}, {}
    while steps:
        for k in list(steps):
            try:
                seen[k].append(next(steps[k]))
            except StopIteration as done:
                out[k] = done.value
                del steps[k]
    want = [0, *range(SMALL_BLOCK, T, SMALL_BLOCK), T]
    assert seen["nb"] == seen["plain"] == want
    _assert_bit_identical(bb, out["nb"], alone_nb)
    assert out["nb"].archive.token_ids and all(
        np.array_equal(a, b) for a, b in zip(out["nb"].archive.token_ids, alone_nb.archive.token_ids))
    st_a, st_b = bb.state_to_tensors(out["plain"].state), bb.state_to_tensors(alone_plain.state)
    assert all(torch.equal(st_a[k], st_b[k]) for k in st_a)
    assert len(out["plain"].archive) == 0
    with pytest.raises(ValueError, match="empty document"):   # checked at the first step, before any block
        next(ingest_steps(bb, token_ids=[], cfg=SMALL))
