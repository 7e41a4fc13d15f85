"""Write (Eqs. 3-4, 8-9; App. B.2-B.3) on hand-checkable inputs, and fast == naive."""
import numpy as np
import pytest
import torch

from nbcore import ingest, load_backbone
from nbcore.backbones import RawTap
from nbcore.config import NoteBankConfig
from nbcore.notebank.features import (ChunkReducer, chunk_distinctiveness, compact, l2_normalize,
                                      projection_coords, reference_features)
from nbcore.notebank.write import ArchiveWriter, assign_addresses, best_window, select_spans, span_from_window
from nbcore.reader import coords_for, encode_context
from nbcore.testing import byte_tokenizer, tiny_gdn_config


# ---- Eq. 3 / 8 ------------------------------------------------------------------------------
def test_distinctiveness_marks_the_odd_key():
    # 8 tokens, 1 channel: every key points along e0 except token 5 (along e1).
    k = torch.zeros(8, 1, 4)
    k[:, 0, 0] = torch.arange(1, 9).float()        # magnitude must not matter (k is normalised)
    k[5, 0] = torch.tensor([0.0, 3.0, 0, 0])
    d = chunk_distinctiveness(k, chunk_size=8)
    assert int(d[:, 0].argmax()) == 5
    # mu = normalize(7 e0 + e1) -> d = 1 - 7/sqrt(50) for e0 tokens, 1 - 1/sqrt(50) for token 5
    assert torch.allclose(d[0, 0], torch.tensor(1 - 7 / 50 ** 0.5), atol=1e-6)
    assert torch.allclose(d[5, 0], torch.tensor(1 - 1 / 50 ** 0.5), atol=1e-6)


@pytest.mark.parametrize("T,C", [(63, 16), (64, 16), (100, 512)], ids=lambda v: str(v))
def test_distinctiveness_fast_equals_reference(T, C):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(T, 6, 8, generator=g), torch.randn(T, 6, 8, generator=g)
    coords = projection_coords(6, 8, 4, seed=1)
    d_ref, qc_ref = reference_features(q, k, coords, C)
    red = ChunkReducer(coords, heads_per_layer=3, chunk_size=C)
    red.on_layer(0, q[:, :3], k[:, :3])
    red.on_layer(1, q[:, 3:], k[:, 3:])
    d, qc = red.result()
    assert torch.allclose(d, d_ref, atol=1e-6)
    assert torch.equal(qc, qc_ref)


def test_reducer_split_calls_equal_one_call():
    # Two forward calls of 32 + 32 tokens (chunk-aligned) == one call of 64.
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(64, 2, 8, generator=g), torch.randn(64, 2, 8, generator=g)
    coords = projection_coords(2, 8, 4, seed=0)
    one = ChunkReducer(coords, 2, 16)
    one.on_layer(0, q, k)
    a, b = ChunkReducer(coords, 2, 16, offset=0), ChunkReducer(coords, 2, 16, offset=32)
    a.on_layer(0, q[:32], k[:32])
    b.on_layer(0, q[32:], k[32:])
    assert torch.equal(one.result()[0], torch.cat([a.result()[0], b.result()[0]]))
    with pytest.raises(ValueError, match="chunk boundary"):
        chunk_distinctiveness(k, 16, offset=8)


# ---- Eq. 9 ----------------------------------------------------------------------------------
def test_projection_is_seeded_distinct_and_selects_coordinates():
    P = projection_coords(5, 32, 16, seed=3)
    assert P.shape == (5, 16)
    assert all(len(set(row.tolist())) == 16 for row in P)
    assert torch.equal(P, projection_coords(5, 32, 16, seed=3))
    assert not torch.equal(P, projection_coords(5, 32, 16, seed=4))
    # drawn per channel: every channel has its own selection (as a set, not only as an order)
    assert len({tuple(sorted(row.tolist())) for row in P}) == 5
    assert all(not torch.equal(P[i], P[j]) for i in range(5) for j in range(i + 1, 5))
    same = torch.randn(3, 1, 32, generator=torch.Generator().manual_seed(0)).expand(3, 5, 32)  # one query, every channel
    cq = compact(same, P)
    assert all(not torch.equal(cq[:, i], cq[:, j]) for i in range(5) for j in range(i + 1, 5))
    q = torch.arange(2 * 5 * 32).float().reshape(2, 5, 32)
    out = compact(q, P)
    assert out[1, 2, 7] == q[1, 2, P[2, 7]]
    with pytest.raises(ValueError, match="cannot exceed"):
        projection_coords(2, 8, 16, seed=0)


# ---- windows and spans ------------------------------------------------------------------------
def test_best_window_ties_go_to_earliest_and_short_region_is_one_window():
    s = np.array([0, 1, 1, 0, 1, 1, 0], float)
    assert best_window(s, 0, 7, 2) == (1, 3, 2.0)
    assert best_window(s, 2, 4, 5) == (2, 4, 1.0)


def _sent(lengths):
    return np.repeat(np.arange(len(lengths)), lengths)


def test_span_expands_left_then_right_within_budget():
    sent = _sent([5, 5, 5, 5, 5])                  # sentences [0,5) [5,10) [10,15) [15,20) [20,25)
    # window centred in sentence 2; B=15 -> add left (sentence 1), then right (sentence 3)
    assert span_from_window(sent, 10, 15, 0, 25, B=15)[:2] == (5, 20)
    # B=10 -> only the left neighbour fits first, then nothing
    assert span_from_window(sent, 10, 15, 0, 25, B=10)[:2] == (5, 15)
    # expansion stays inside the region
    assert span_from_window(sent, 10, 15, 8, 17, B=25)[:2] == (8, 17)


def test_overlong_sentence_takes_B_tokens_from_window_start_inside_sentence():
    sent = _sent([3, 40, 3])                       # long sentence [3, 43)
    s, e, xs, xe = span_from_window(sent, 10, 20, 0, 46, B=8)
    assert (s, e, xs, xe) == (10, 18, 3, 43)
    s, e, _, _ = span_from_window(sent, 38, 46, 0, 46, B=8)   # would spill past the sentence end
    assert (s, e) == (35, 43)


def test_two_notes_never_overlap_and_exclude_whole_sentences():
    sent = _sent([10, 10, 10, 10])
    scores = np.zeros(40)
    scores[12:16] = 5.0                            # best window in sentence 1
    scores[31:33] = 1.0                            # second best in sentence 3
    spans = select_spans(scores, sent, W=2, B=10, window=4)
    assert spans == [(10, 20), (30, 40)]
    # partial note of an over-long sentence excludes the whole sentence
    sent = _sent([30, 10])
    scores = np.zeros(40)
    scores[5:9] = 5.0
    scores[20:24] = 4.0                            # same long sentence: excluded
    scores[34:36] = 1.0
    spans = select_spans(scores, sent, W=2, B=8, window=4)
    assert spans[0] == (5, 13) and spans[1] == (32, 40)   # window [32,36): B tokens from its start, clamped


def test_no_candidate_left_writes_one_note():
    sent = np.zeros(20, np.int64)                  # one sentence covering the region
    assert len(select_spans(np.ones(20), sent, W=2, B=64, window=4)) == 1


def test_address_uses_per_channel_argmax_position():
    dist = torch.tensor([[0.1, 0.9], [0.5, 0.2], [0.5, 0.1]])   # [L=3, J=2]
    qc = torch.arange(3 * 2 * 2).float().reshape(3, 2, 2)
    a = assign_addresses(dist, qc, 0, 3)
    assert torch.equal(a.float(), torch.stack([qc[1, 0], qc[0, 1]]))   # channel 0: tie -> earlier (t=1)
    assert a.dtype == torch.bfloat16


# ---- the streaming writer ----------------------------------------------------------------------
def _feed(cfg, T, J=3, seed=0, block=None, dist=None):
    g = torch.Generator().manual_seed(seed)
    ids = np.arange(T)
    sent = np.arange(T) // 7                       # 7-token sentences
    dist = torch.rand(T, J, generator=g) if dist is None else dist
    qc = torch.randn(T, J, cfg.addr_dim, generator=g).to(torch.bfloat16)
    w = ArchiveWriter(cfg, ids, sent, J, "fp")
    block = block or T
    for b in range(0, T, block):
        w.feed(dist[b:b + block], qc[b:b + block])
    return w.finish(), dist, qc


@pytest.mark.parametrize("T", [63, 64, 200, 511], ids=lambda t: f"T{t}")
def test_note_count_bound_and_budget(T):
    cfg = NoteBankConfig(chunk_size=64, write_budget=2, note_budget=16, window=8, tail=8, addr_dim=4)
    arc, _, _ = _feed(cfg, T)
    assert len(arc) <= 2 * (T // 64)
    assert all(len(z) <= 16 for z in arc.token_ids)
    assert all(e <= (c + 1) * 64 for e, c in zip(arc.ends, arc.chunk_index))   # nothing from the partial chunk
    if T < 64:
        assert len(arc) == 0


def test_feed_block_size_does_not_change_archive():
    cfg = NoteBankConfig(chunk_size=64, note_budget=16, window=8, tail=8, addr_dim=4)
    a, _, _ = _feed(cfg, 300, block=300)
    b, _, _ = _feed(cfg, 300, block=17)
    assert np.array_equal(a.starts, b.starts) and torch.equal(a.addresses, b.addresses)


def test_tail_region_on_hand_scores():
    """The tail rule on hand-made scores (the real path: test_tail_keeps_original_scores_and_queries)."""
    cfg = NoteBankConfig(chunk_size=64, write_budget=1, note_budget=4, window=4, tail=8, addr_dim=4)
    dist = torch.zeros(128, 3)
    dist[60:62] = 10.0                             # in chunk 0's last 8 tokens
    dist[10:12] = 20.0                             # chunk 0's own best
    arc, _, qc = _feed(cfg, 128, dist=dist)
    # chunk 0 picks around 10; chunk 1's region = tokens 56..127 -> the tail (scored in chunk 0) wins
    assert arc.chunk_index.tolist() == [0, 1]
    assert 56 <= arc.starts[1] <= 60 < arc.ends[1]
    t_star = 60                                    # first max of dist in the note, every channel
    assert torch.equal(arc.addresses[1], qc[t_star].to(torch.bfloat16))


def _region_notes(dist, qc, sent, cfg, T, tail_dist=None):
    """The archive App. B.2 prescribes, chunk by chunk, from per-token features of the whole
    document: region of chunk c = its `tail` predecessors + its C tokens, rows as given
    (tail_dist(c) -> [tail, J]: other scores for chunk c's tail rows)."""
    C, out = cfg.chunk_size, []
    for c in range(T // C):
        lo, hi = max(0, c * C - cfg.tail), (c + 1) * C
        d = dist[lo:hi]
        if c and tail_dist is not None:
            d = torch.cat([tail_dist(c), dist[c * C:hi]])
        for s, e in select_spans(d.mean(1).double().numpy(), sent[lo:hi], cfg.write_budget,
                                 cfg.note_budget, cfg.window):
            out.append((lo + s, lo + e, c, assign_addresses(d, qc[lo:hi], s, e)))
    return out


def test_tail_keeps_original_scores_and_queries():
    """Through the real writer path (tiny GDN backbone -> ChunkReducer -> ArchiveWriter, one
    backbone call per chunk, so the tail's features come from the PREVIOUS call): the tail of
    chunk c-1 joins chunk c's candidate region with the scores and compacted queries it got in
    its own chunk (distinctiveness against chunk c-1's mean key). Reference: one whole-document
    capture, every token scored within its own chunk, regions built by hand."""
    bb = load_backbone(tiny_gdn_config(), tokenizer=byte_tokenizer())
    cfg = NoteBankConfig(chunk_size=64, write_budget=1, note_budget=12, window=4, tail=24, addr_dim=8)
    C, r = cfg.chunk_size, cfg.tail
    g = np.random.default_rng(0)
    text = "".join(g.choice(list("abcdefghij klmnop. qrstuvwxyz!\n")) for _ in range(10 * C))
    arc = ingest(bb, text, cfg, block_size=C).archive
    ids, sent = encode_context(bb, text)
    T = len(ids)
    tap = RawTap(len(bb.rec_layers))
    bb.forward(bb.new_state(), torch.from_numpy(ids), tap=tap)
    q, k = tap.result()
    dist, qc = reference_features(q, k, coords_for(bb, cfg), C)
    want = _region_notes(dist, qc, sent, cfg, T)
    assert [(int(s), int(e), int(c)) for s, e, c in zip(arc.starts, arc.ends, arc.chunk_index)] == \
        [w[:3] for w in want]
    assert all(torch.equal(arc.addresses[i], w[3]) for i, w in enumerate(want))
    # The document exercises the rule: a later chunk writes a note that lies inside its tail, so
    # every address row of that note is a tail query from the previous backbone call ...
    assert any(c > 0 and e <= c * C for _, e, c, _ in want)
    # ... and a writer that re-scored the tail inside chunk c (against chunk c's mean key instead
    # of chunk c-1's) would write other notes.
    kh = l2_normalize(k)

    def rescored(c):
        mu = l2_normalize(kh[c * C:(c + 1) * C].mean(0))                       # [J, d]
        return 1.0 - torch.einsum("tjd,jd->tj", kh[c * C - r:c * C], mu)
    other = _region_notes(dist, qc, sent, cfg, T, tail_dist=rescored)
    assert [w[:3] for w in other] != [w[:3] for w in want]


def test_writer_rejects_bad_config():
    for bad in (dict(chunk_size=0), dict(note_budget=-1), dict(write_budget=3), dict(window=0),
                dict(tail=512), dict(addr_dim=0)):
        with pytest.raises(ValueError):
            NoteBankConfig(**bad).validate()


@pytest.mark.parametrize("T,C", [(63, 16), (64, 16), (1000, 128), (7, 16)], ids=lambda v: str(v))
def test_reducer_head_major_layout_equals_reference(T, C):
    """The head-major fast path ([T, H, d] views of contiguous [H, T, d] q/k, as the GDN kernels
    lay them out) gives the reference features: distinctiveness to 1e-6, compact queries exactly."""
    from nbcore.notebank.features import compact_bf16, head_major
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, T, 8, generator=g).transpose(0, 1)          # [T, 6, 8] head-major views
    k = torch.randn(6, T, 8, generator=g).transpose(0, 1)
    assert head_major(k) and head_major(q) and not head_major(k.contiguous())
    coords = projection_coords(6, 8, 4, seed=1)
    d_ref, qc_ref = reference_features(q.contiguous(), k.contiguous(), coords, C)
    red = ChunkReducer(coords, heads_per_layer=6, chunk_size=C)
    red.on_layer(0, q, k)
    d, qc = red.result()
    assert torch.allclose(d, d_ref, atol=1e-6)
    assert torch.equal(qc, qc_ref) and torch.equal(compact_bf16(q, coords), qc_ref)


@pytest.mark.parametrize("head_major_layout", [False, True])
def test_reducer_with_n_tokens_writes_one_result_pair(head_major_layout):
    """n_tokens: layers write straight into one result pair; same values as the concatenating path,
    with a prefix (resumed chunk) too; a layer that misses tokens is an error, not a silent gap."""
    g = torch.Generator().manual_seed(5)
    T, H, L, D = 100, 3, 2, 8
    q, k = torch.randn(T, L * H, D, generator=g), torch.randn(T, L * H, D, generator=g)
    if head_major_layout:
        q, k = q.transpose(0, 1).contiguous().transpose(0, 1), k.transpose(0, 1).contiguous().transpose(0, 1)
    pre = torch.randn(5, L * H, D, generator=g)
    coords = projection_coords(L * H, D, 4, seed=2)
    for kw in ({}, {"prefix_keys": pre, "offset": 25}):
        a = ChunkReducer(coords, H, 20, **kw)
        b = ChunkReducer(coords, H, 20, n_tokens=T, **kw)
        for red in (a, b):
            red.on_layer(0, q[:, :H], k[:, :H])
            red.on_layer(1, q[:60, H:], k[:60, H:])      # layer 1 in two calls
            red.on_layer(1, q[60:, H:], k[60:, H:]) if "prefix_keys" not in kw else None
        if "prefix_keys" in kw:
            with pytest.raises(ValueError, match="saw"):
                b.result()
            continue
        (da, qa), (db, qb) = a.result(), b.result()
        assert torch.equal(da, db) and torch.equal(qa, qb)
    c = ChunkReducer(coords, H, 20, n_tokens=T, prefix_keys=pre, offset=25)
    ref = ChunkReducer(coords, H, 20, prefix_keys=pre, offset=25)
    for red in (c, ref):
        red.on_layer(0, q[:, :H], k[:, :H])
        red.on_layer(1, q[:, H:], k[:, H:])
    assert torch.equal(c.result()[0], ref.result()[0]) and torch.equal(c.prefix_dist(), ref.prefix_dist())
    with pytest.raises(ValueError, match="n_tokens"):
        ChunkReducer(coords, H, 20, n_tokens=10).on_layer(0, q[:11, :H], k[:11, :H])


@pytest.mark.parametrize("writer", ["device", "reference"])
def test_block_buffers_are_reused_and_archives_unchanged(monkeypatch, writer):
    """ingest writes every block's features into the previous block's buffers (no fresh pages per
    block); archives equal a one-block read, whose buffers are its own."""
    from nbcore.testing import needle_text
    bb = load_backbone(tiny_gdn_config(), tokenizer=byte_tokenizer())
    text, _ = needle_text(2300, 2, seed=4)                       # odd length: a partial last block
    cfg = NoteBankConfig(chunk_size=128, note_budget=40, tail=16)
    ptrs = []
    real = ChunkReducer.result

    def result(self):
        out = real(self)
        ptrs.append((out[0].data_ptr(), out[1].data_ptr(), out[1].shape[0]))
        return out
    monkeypatch.setattr(ChunkReducer, "result", result)
    many = ingest(bb, text, cfg, block_size=256, writer=writer).archive
    full = [p for p in ptrs if p[2] == 256]
    assert len(full) >= 7 and len({p[:2] for p in full}) == 1    # every full block in the same buffers
    one = ingest(bb, text, cfg, block_size=1 << 20, writer=writer).archive
    assert len(many) == len(one) > 0
    assert np.array_equal(many.starts, one.starts) and np.array_equal(many.ends, one.ends)
    assert all(np.array_equal(a, b) for a, b in zip(many.token_ids, one.token_ids))
    assert torch.equal(many.addresses, one.addresses)
