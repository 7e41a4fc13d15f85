"""The device writer (nbcore.notebank.write_device.DeviceArchiveWriter) writes byte-identical
archives to the naive host writer (write.ArchiveWriter) on CPU: through the real `ingest` /
`append` on tiny GDN, GDN/attention hybrid and Mamba-2 backbones with real sentence boundaries,
on synthetic features with exact and near (sub-grid) ties, and it keeps its host transfers to
the selected notes' address rows plus a few scalars per chunk."""
import numpy as np
import pytest
import torch
from safetensors.torch import save as st_save

from nbcore import NoteBankConfig, WriterCarry, append, ingest, load_backbone
from nbcore.notebank.write import ArchiveWriter, TIE_GRID
from nbcore.notebank.write_device import DeviceArchiveWriter, device_addresses, device_best_windows
from nbcore.reader import DEFAULT_WRITER, writer_class
from nbcore.testing import sentence_text, byte_tokenizer, needle_text, tiny_gdn_config, tiny_mamba2_config
from notebank.schemas import archive as S
from notebank.schemas._base import table_to_parquet_bytes

FAMILIES = {"gdn": lambda: tiny_gdn_config(), "gdn-hybrid": lambda: tiny_gdn_config(hybrid=True),
            "mamba2": lambda: tiny_mamba2_config()}

# the paper's tail (32) and window (48) with a chunk small enough for many notes per document
TAIL32 = NoteBankConfig(chunk_size=128, note_budget=32, window=48, tail=32, addr_dim=8)
CONFIGS = {
    "tail32": TAIL32,
    "tail32-W1": NoteBankConfig(**{**TAIL32.to_dict(), "write_budget": 1}),
    "m4": NoteBankConfig(**{**TAIL32.to_dict(), "addr_positions": 4}),
    "qnovel": NoteBankConfig(**{**TAIL32.to_dict(), "addr_select": "key_qnovel", "addr_positions": 2}),
    "tail0-B12": NoteBankConfig(chunk_size=64, note_budget=12, window=8, tail=0, addr_dim=8),
    "win-gt-region": NoteBankConfig(chunk_size=16, note_budget=6, window=40, tail=8, addr_dim=4),
}


TEXT = sentence_text(1000, seed=5)          # 1000 tokens + BOS: an incomplete final chunk for every C here


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def bb(request):
    torch.set_num_threads(1)
    return load_backbone(FAMILIES[request.param](), tokenizer=byte_tokenizer(), seed=0)


def assert_same_archive(a, b, n_channels, nonempty=True):
    """Every Archive field exactly, and the serialized notes (parquet) bytes."""
    assert len(a) == len(b)
    if nonempty:
        assert len(a) > 0
    for f in ("starts", "ends", "chunk_index"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and np.array_equal(x, y), f
    assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a.token_ids, b.token_ids))
    assert a.addresses.dtype == b.addresses.dtype == torch.bfloat16
    assert a.addresses.shape == b.addresses.shape
    assert a.addresses.contiguous().view(torch.uint16).numpy().tobytes() == \
        b.addresses.contiguous().view(torch.uint16).numpy().tobytes()
    assert (a.n_tokens, a.config, a.model_fingerprint) == (b.n_tokens, b.config, b.model_fingerprint)
    assert notes_parquet_bytes("doc", a, n_channels) == notes_parquet_bytes("doc", b, n_channels)


def notes_parquet_bytes(doc_id: str, a, n_channels: int) -> bytes:
    """The archive's notes as the pipeline stores them (schemas.archive notes table, Parquet bytes)."""
    slots = n_channels * a.config.addr_positions
    addr = a.addresses.detach().cpu().contiguous()
    bits = addr.view(torch.uint16).numpy().reshape(addr.shape[0], int(np.prod(addr.shape[1:])))  # 0 notes too
    rows = [{"doc_id": doc_id, "generation": 0, "note_index": i, "chunk_index": int(a.chunk_index[i]),
             "start": int(a.starts[i]), "end": int(a.ends[i]), "token_ids": a.token_ids[i], "text": None,
             "addresses": bits[i]} for i in range(len(a))]
    return table_to_parquet_bytes(S.notes_table(rows, slots, a.config.addr_dim))


def assert_same_carry(a: WriterCarry, b: WriterCarry):
    ta, tb = a.to_tensors(), b.to_tensors()
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    assert st_save(ta) == st_save(tb)


def test_device_writer_is_the_default():
    assert DEFAULT_WRITER == "device" and writer_class() is DeviceArchiveWriter
    assert writer_class("reference") is ArchiveWriter
    with pytest.raises(ValueError, match="unknown writer"):
        writer_class("numpy")


# ---- through the real ingest ----------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_ingest_device_equals_reference(bb, name):
    cfg = CONFIGS[name]
    want = ingest(bb, TEXT, cfg, block_size=256, writer="reference")
    for block in (cfg.chunk_size, 256, 8192):
        got = ingest(bb, TEXT, cfg, block_size=block, writer="device")
        if block == 256:
            assert_same_archive(got.archive, want.archive, bb.n_channels)
            assert_same_carry(got.carry, want.carry)
        else:   # other blocks: the reference with the same blocks (features see other kernel blocks)
            ref = ingest(bb, TEXT, cfg, block_size=block, writer="reference")
            assert_same_archive(got.archive, ref.archive, bb.n_channels)
            assert_same_carry(got.carry, ref.carry)
    assert want.archive.n_tokens % cfg.chunk_size                  # incomplete final chunk
    assert want.carry.n_pending > 0
    if cfg.write_budget == 2:
        assert any(np.diff(want.archive.chunk_index) == 0)       # chunks that wrote 2 notes


def test_ingest_default_config_and_needles(bb):
    """The paper's default config (C = 512, B = 64, window 48, tail 32) on a needle haystack."""
    text, _ = needle_text(2200, 3, seed=2)
    got = ingest(bb, text, NoteBankConfig(addr_dim=8), block_size=1024)
    want = ingest(bb, text, NoteBankConfig(addr_dim=8), block_size=1024, writer="reference")
    assert_same_archive(got.archive, want.archive, bb.n_channels)
    assert len(got.archive) == 2 * (got.n_tokens // 512)


@pytest.mark.parametrize("n", [1, 50, 127, 128], ids=lambda n: f"T{n}")
def test_short_documents(bb, n):
    # shorter than C: nothing written; exactly C: one chunk
    got = ingest(bb, TEXT[:n], TAIL32, block_size=256)
    want = ingest(bb, TEXT[:n], TAIL32, block_size=256, writer="reference")
    assert_same_archive(got.archive, want.archive, bb.n_channels, nonempty=False)
    assert_same_carry(got.carry, want.carry)
    assert (len(got.archive) == 0) == (got.n_tokens < 128)


def test_also_writers_equal_reference(bb):
    variants = [CONFIGS["m4"], CONFIGS["qnovel"], CONFIGS["tail32-W1"]]
    got = ingest(bb, TEXT, TAIL32, block_size=384, also=variants)
    want = ingest(bb, TEXT, TAIL32, block_size=384, also=variants, writer="reference")
    for a, b in zip([got.archive, *got.also_archives], [want.archive, *want.also_archives]):
        assert_same_archive(a, b, bb.n_channels)


# ---- resumed append -----------------------------------------------------------------------------
def _chain(bb, parts, cfg, block, writer):
    res = ingest(bb, parts[0], cfg, block_size=block, writer=writer)
    for p in parts[1:]:
        carry = WriterCarry.from_tensors(res.carry.to_tensors())       # round trip through tensors
        res = append(bb, res.state, res.archive, carry, p, cfg, block_size=block, writer=writer)
    return res


@pytest.mark.parametrize("cuts", [[300], [256], [140, 150, 600]], ids=["inside-chunk", "block", "three"])
@pytest.mark.parametrize("name", ["tail32", "qnovel"])
def test_append_device_equals_reference_and_one_pass(bb, cuts, name):
    cfg = CONFIGS[name]
    parts = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)])]
    got = _chain(bb, parts, cfg, 256, "device")
    want = _chain(bb, parts, cfg, 256, "reference")
    assert_same_archive(got.archive, want.archive, bb.n_channels)     # same features -> same bytes
    assert_same_carry(got.carry, want.carry)
    one = ingest(bb, parts=parts, cfg=cfg, block_size=256)
    if all(c % 256 == 0 for c in cuts):            # the backbone calls are one-pass's: bit-identical
        assert_same_archive(got.archive, one.archive, bb.n_channels)
    else:                                          # kernels see other blocks: spans exact
        assert np.array_equal(got.archive.starts, one.archive.starts)
        assert np.array_equal(got.archive.ends, one.archive.ends)


def test_carry_crosses_writers(bb):
    """A carry written by either writer resumes in either (the carry format is shared)."""
    first_ref = ingest(bb, TEXT[:300], TAIL32, block_size=256, writer="reference")
    first_dev = ingest(bb, TEXT[:300], TAIL32, block_size=256)
    assert_same_carry(first_ref.carry, first_dev.carry)
    a = append(bb, first_ref.state, first_ref.archive, first_ref.carry, TEXT[300:], block_size=256)
    b = append(bb, first_dev.state, first_dev.archive, first_dev.carry, TEXT[300:], block_size=256,
               writer="reference")
    assert_same_archive(a.archive, b.archive, bb.n_channels)
    assert_same_carry(a.carry, b.carry)


# ---- synthetic features ---------------------------------------------------------------------------
def _write(W, cfg, dist, qc, sent, blocks):
    w = W(cfg, np.arange(len(sent)), np.asarray(sent), dist.shape[1], "fp")
    b0 = 0
    for n in blocks:
        w.feed(dist[b0:b0 + n], qc[b0:b0 + n])
        b0 += n
    assert b0 == len(sent)
    return w.finish(), w


def _both(cfg, dist, qc, sent, blocks=None):
    blocks = blocks or [len(sent)]
    a, wa = _write(DeviceArchiveWriter, cfg, dist, qc, sent, blocks)
    b, wb = _write(ArchiveWriter, cfg, dist, qc, sent, blocks)
    assert_same_archive(a, b, dist.shape[1], nonempty=False)
    assert_same_carry(wa.carry(), wb.carry())
    return a


def _qc(T, J, d, seed=0):
    return torch.randn(T, J, d, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_exact_window_ties_go_to_the_earliest():
    # one chunk (no tail), one-token sentences: the note is exactly the window's sentence expansion
    cfg = NoteBankConfig(chunk_size=64, write_budget=1, note_budget=4, window=4, tail=0, addr_dim=2)
    dist = torch.zeros(64, 3)
    dist[8:12] = 0.5                                # two windows with the same (exact) sum ...
    dist[40:44] = 0.5
    arc = _both(cfg, dist, _qc(64, 3, 2), np.arange(64) // 4)   # 4-token sentences: note = window
    assert (arc.starts[0], arc.ends[0]) == (8, 12)  # ... the earlier one


@pytest.mark.parametrize("delta,first", [(0.3 * TIE_GRID, True), (-0.3 * TIE_GRID, True), (30 * TIE_GRID, False)])
def test_near_ties_on_the_grid(delta, first):
    """Sums closer than the tie grid count as equal (earliest wins); 30 grid steps apart do not."""
    cfg = NoteBankConfig(chunk_size=64, write_budget=1, note_budget=4, window=4, tail=0, addr_dim=2)
    dist = torch.zeros(64, 1, dtype=torch.float32)
    dist[8:12] = 0.25
    dist[40:44] = 0.25
    dist[41] += delta                                # fp32 noise-sized difference on the later window
    arc = _both(cfg, dist, _qc(64, 1, 2), np.arange(64) // 4)
    assert arc.starts[0] == (8 if first else 40)


def test_second_note_ties_left_subregion_and_short_subregion():
    """W = 2: the sub-regions left and right of note 1's sentences hold equal best windows -> the
    left one; a short (<= window) sub-region competes with the sum of its tokens."""
    cfg = NoteBankConfig(chunk_size=64, write_budget=2, note_budget=8, window=8, tail=0, addr_dim=2)
    sent = np.repeat(np.arange(8), 8)               # 8-token sentences
    dist = torch.zeros(64, 2)
    dist[24:32] = 1.0                               # note 1: sentence [24, 32)
    dist[4:6] = 0.5                                 # left sub-region [0, 24): best window sum 1.0
    dist[50:52] = 0.5                               # right sub-region [32, 64): best window sum 1.0
    arc = _both(cfg, dist, _qc(64, 2, 2), sent)
    assert arc.starts.tolist() == [24, 0]           # note 2 from the LEFT sub-region (tie)
    # a short left sub-region: note 1 = sentence [8, 16) of 8-token sentences, left sub-region [0, 8)
    dist = torch.zeros(64, 2)
    dist[9:15] = 1.0
    dist[0:8] = 0.125                               # whole short sub-region: sum 1.0
    dist[40:48] = 0.125                             # right: best window sum 1.0 -> tie -> left
    arc = _both(cfg, dist, _qc(64, 2, 2), sent)
    assert arc.starts.tolist() == [8, 0]


@pytest.mark.parametrize("m", [1, 3, 4])
def test_address_ties_go_to_earlier_positions(m):
    cfg = NoteBankConfig(chunk_size=32, write_budget=1, note_budget=6, window=6, tail=0, addr_dim=2,
                         addr_positions=m)
    dist = torch.zeros(32, 3)
    dist[10:16] = 1.0                               # note [10, 16), channel 0: all tied
    dist[10:16, 1] = torch.tensor([0.5, 1.0, 0.25, 1.0, 1.0, 0.5])   # channel 1: ties at 11, 13, 14
    dist[12:14, 2] = 1.0 + 0.2 * TIE_GRID           # channel 2: sub-grid lead at 12, 13 -> tie
    qc = torch.arange(32).float()[:, None, None].expand(32, 3, 2).to(torch.bfloat16)   # row = position
    arc = _both(cfg, dist, qc, np.repeat([0, 1, 2], [10, 6, 16]))     # the note is sentence [10, 16)
    assert (arc.starts[0], arc.ends[0]) == (10, 16)
    pos = arc.addresses[0, :, 0].float().reshape(3, m).long().tolist()
    want = {0: [10, 11, 12, 13], 1: [11, 13, 14, 10], 2: [10, 11, 12, 13]}
    assert pos == [want[j][:m] for j in range(3)]


def test_note_shorter_than_m_repeats_its_best():
    cfg = NoteBankConfig(chunk_size=16, write_budget=1, note_budget=2, window=2, tail=0, addr_dim=2,
                         addr_positions=4)
    dist = torch.zeros(16, 2)
    dist[5:7, 0] = torch.tensor([1.0, 2.0])
    dist[5:7, 1] = torch.tensor([2.0, 1.0])
    qc = torch.arange(16).float()[:, None, None].expand(16, 2, 2).to(torch.bfloat16)
    arc = _both(cfg, dist, qc, np.repeat([0, 1, 2], [5, 2, 9]))       # the note is sentence [5, 7)
    assert (arc.starts[0], arc.ends[0]) == (5, 7)
    assert arc.addresses[0, :, 0].float().tolist() == [6, 5, 6, 6, 5, 6, 5, 5]


CFG_GRID = [NoteBankConfig(chunk_size=64, note_budget=16, window=8, tail=8, addr_dim=4),
            NoteBankConfig(chunk_size=64, write_budget=1, note_budget=16, window=8, tail=8, addr_dim=4),
            NoteBankConfig(chunk_size=64, note_budget=16, window=8, tail=0, addr_dim=4, addr_positions=4),
            NoteBankConfig(chunk_size=64, note_budget=16, window=8, tail=8, addr_dim=4, addr_select="key_qnovel",
                           addr_positions=2),
            NoteBankConfig(chunk_size=8, note_budget=5, window=16, tail=4, addr_dim=4),
            NoteBankConfig(chunk_size=48, note_budget=64, window=48, tail=32, addr_dim=4)]


@pytest.mark.parametrize("cfg", CFG_GRID, ids=[f"cfg{i}" for i in range(len(CFG_GRID))])
@pytest.mark.parametrize("quant", [None, 4], ids=["float", "quantized"])
def test_random_features_many_ties(cfg, quant):
    """Random features; `quantized`: per-channel scores on a 1/4 grid, so window sums, sub-region
    scores and per-channel maxima tie exactly all the time. Random sentence lengths, block
    sizes that cut chunks anywhere."""
    g = torch.Generator().manual_seed(7)
    rng = np.random.default_rng(7)
    for T, blocks in [(300, [17] * 17 + [11]), (300, [300]), (511, [64] * 7 + [63]), (40, [7] * 5 + [5])]:
        dist = torch.rand(T, 5, generator=g)
        if quant:
            dist = (dist * quant).round() / quant
        sent = np.cumsum(rng.random(T) < 0.15)
        _both(cfg, dist, _qc(T, 5, cfg.addr_dim, seed=T), sent, blocks)


def test_kernels_equal_reference_functions():
    from nbcore.notebank.write import assign_addresses, best_window
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(500, generator=g) * 4).round().double() / 4
    los, lens = [0, 37, 100, 250], [200, 49, 400, 250]
    got = device_best_windows(x, los, lens, 48).numpy()
    for (i, s), lo, n in zip(got, los, lens):
        ws, _, sc = best_window(x.numpy(), lo, lo + n, 48)
        assert (lo + int(i), float(s)) == (ws, sc)
    dist, qc = torch.rand(100, 4, generator=g), _qc(100, 4, 3)
    for m in (1, 2, 5):
        got = device_addresses(dist, qc, [3, 50], [3, 50], [4, 20], m)
        assert torch.equal(got[0], assign_addresses(dist, qc, 3, 7, m))
        assert torch.equal(got[1], assign_addresses(dist, qc, 50, 70, m))


def test_sentence_span_lookup_equals_search():
    """The device writer's O(1) sentence bounds (write.sentence_spans) answer as the reference's
    searchsorted (write._sentence_bounds) for every token and clipping range, and so do the spans
    grown from them."""
    from nbcore.notebank.write import _sentence_bounds, sentence_spans, span_from_window
    rng = np.random.default_rng(5)
    for T in (1, 2, 7, 64, 301):
        sent = np.cumsum(rng.random(T) < rng.choice([0.02, 0.2, 0.7]))
        first, end = sentence_spans(sent)
        for _ in range(200):
            lo = int(rng.integers(0, T))
            hi = int(rng.integers(lo + 1, T + 1))
            t = int(rng.integers(lo, hi))
            assert (max(lo, int(first[t])), min(hi, int(end[t]))) == _sentence_bounds(sent, t, lo, hi)
            ws = int(rng.integers(lo, hi))
            we = int(rng.integers(ws + 1, hi + 1))
            B = int(rng.integers(1, 70))
            fast = span_from_window(None, ws, we, lo, hi, B,
                                    bounds=lambda t, a, b: (max(a, int(first[t])), min(b, int(end[t]))))
            assert fast == span_from_window(sent, ws, we, lo, hi, B)

# ---- host transfers -------------------------------------------------------------------------------
class Watched(torch.Tensor):
    """Records every way a tensor's values can leave torch: .cpu() / .to(cpu) / .numpy() /
    .tolist() / .item() / int() / float() / bool() / np.asarray(). What .cpu() returns is a plain
    tensor (it has crossed), so the crossing is counted once."""
    log: list = []
    LEAVE = {"cpu", "numpy", "tolist", "item", "__int__", "__float__", "__bool__", "__index__", "__array__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_cpu = name == "to" and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
        if name in cls.LEAVE or to_cpu:
            cls.log.append((name, args[0].numel()))
        out = super().__torch_function__(func, types, args, kwargs)
        if name == "cpu" or to_cpu:
            out = out.as_subclass(torch.Tensor)
        return out


def _watched_feed(W, cfg, T, J, blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    dist = torch.rand(T, J, generator=g).as_subclass(Watched)
    qc = torch.randn(T, J, cfg.addr_dim, generator=g).to(torch.bfloat16).as_subclass(Watched)
    sent = np.cumsum(np.random.default_rng(seed).random(T) < 0.1)
    w = W(cfg, np.arange(T), sent, J, "fp")
    per_feed, b0 = [], 0
    for n in blocks:
        Watched.log = []
        before = w._n_chunks
        w.feed(dist[b0:b0 + n], qc[b0:b0 + n])
        per_feed.append((w._n_chunks - before, list(Watched.log)))
        b0 += n
    Watched.log = []
    carry = w.carry()
    return w, per_feed, list(Watched.log), carry


@pytest.mark.parametrize("cfg", [TAIL32, CONFIGS["tail32-W1"], CONFIGS["m4"], CONFIGS["qnovel"]],
                         ids=["W2", "W1", "m4", "qnovel"])
def test_host_transfers_are_the_notes_only(cfg):
    J, T = 24, 1000
    blocks = [100, 28, 512, 37, 300, 23]           # feeds completing 0, 1, 4, 0, 2, 0 chunks
    W, m, d, w = cfg.write_budget, cfg.addr_positions, cfg.addr_dim, cfg.window
    dev, per_feed, at_carry, carry = _watched_feed(DeviceArchiveWriter, cfg, T, J, blocks)
    for n_new, log in per_feed:
        if n_new == 0:
            assert log == []                          # a feed that completes no chunk never syncs
            continue
        assert all(name == "cpu" for name, _ in log), log
        assert len(log) <= (3 if W == 2 else 2)      # host syncs per feed, however many chunks
        assert sum(k for _, k in log) <= n_new * (W * J * m * d + 2 * w + 4), log
        assert max(k for _, k in log) >= n_new * J * m * d   # the address rows did cross (not faked)
    # carry(): the tail + pending features (and the query sum), once
    C, r = cfg.chunk_size, cfg.tail
    assert sum(k for _, k in at_carry) <= (r + carry.n_pending) * J * (1 + d) + J * d
    # the same archive as the reference, which the same watch sees moving whole blocks
    ref, ref_feed, _, ref_carry = _watched_feed(ArchiveWriter, cfg, T, J, blocks)
    assert_same_archive(dev.finish(), ref.finish(), J)
    assert_same_carry(carry, ref_carry)
    assert max(k for _, log in ref_feed for _, k in log) >= 512 * J * d
