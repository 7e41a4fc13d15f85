"""Tiled routing kernel (Eq. 5, App. B.3): channel_scores (fast, tiled) against the naive paths
(channel_scores_naive, the explicit-loop native_votes_naive), tie rules included."""
from functools import partial

import pytest
import torch

from nbcore.notebank import route
from nbcore.notebank.route import (approx_scores_bf16, bf16_prefilter_available, channel_scores,
                                   channel_scores_naive, channel_winners, margin_votes, native_votes,
                                   native_votes_naive, normalized_keys, slot_scores, sum_scores, tile_shape)

D = 8


def tiny(note_block=5, chan_block=2):
    """The fast scorer with tiny tiles, so small inputs cross many tile edges."""
    return partial(channel_scores, note_block=note_block, chan_block=chan_block)


def make(Q, N, J, m=1, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(Q, J, D, generator=g).to(dtype)
    a = torch.randn(N, J * m, D, generator=g).to(dtype)
    return u, a


def plant(u, a, src, dsts, m=1):
    """Make note `src` the best match of every channel (its slot 0 = question token 0), then copy it
    to `dsts`: every channel's maximum is an exact tie between src and its copies."""
    J = u.shape[1]
    a[src, ::m] = u[0].to(a.dtype) * 3
    for i in dsts:
        a[i] = a[src]
    assert a.shape[1] == J * m


SIZES = [(1, 1, 1, 1), (1, 7, 3, 1), (3, 1, 5, 1), (5, 13, 1, 1), (2, 11, 7, 1),
         (4, 21, 5, 4), (1, 6, 3, 4), (64, 33, 5, 1)]


@pytest.mark.parametrize("Q,N,J,m", SIZES, ids=lambda v: str(v))
@pytest.mark.parametrize("path", ["fp32", "tiny-tile", "prefilter"])
def test_votes_equal_loop_reference(Q, N, J, m, path):
    u, a = make(Q, N, J, m, seed=Q * 100 + N)
    kw = {"fp32": dict(prefilter=False), "tiny-tile": dict(scorer=tiny()), "prefilter": dict(prefilter=True)}[path]
    v = native_votes(u, a, m=m, **kw)
    assert torch.equal(v, native_votes_naive(u, a, m=m))
    assert int(v.sum()) == J


@pytest.mark.parametrize("Q,N,J,m", SIZES, ids=lambda v: str(v))
def test_scores_match_naive_and_variants(Q, N, J, m):
    u, a = make(Q, N, J, m, seed=N)
    keys = normalized_keys(a)
    s, ref = slot_scores(u, keys, m, scorer=tiny()), slot_scores(u, keys, m, scorer=channel_scores_naive)
    assert s.shape == (J, N) and s.dtype == torch.float32
    assert torch.allclose(s, ref, atol=1e-6, rtol=0)
    assert torch.allclose(s, slot_scores(u, keys, m), atol=1e-6, rtol=0)          # default tile
    assert torch.equal(channel_winners(u, keys, m, tiny()), channel_winners(u, keys, m, channel_scores_naive))
    assert torch.allclose(margin_votes(u, keys, m, tiny()), margin_votes(u, keys, m, channel_scores_naive),
                          atol=1e-5, rtol=0)
    assert torch.allclose(sum_scores(u, keys, m, tiny()), sum_scores(u, keys, m, channel_scores_naive),
                          atol=1e-4, rtol=0)


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("Q", [1, 3])
def test_duplicated_notes_tie_to_the_earliest_across_tile_edges(Q, m):
    """Copies of the winning note sit in the middle of a tile, at tile starts/ends and in the
    (shifted) last tile: their scores must be bitwise equal, so every channel votes the first copy."""
    N, J = 23, 5                                     # tiles of 5 notes: 0-4, ..., 15-19, 18-22
    u, a = make(Q, N, J, m, seed=7 + Q)
    plant(u, a, 3, [4, 5, 9, 10, 19, 20, 22], m)
    keys = normalized_keys(a)
    for scorer in (None, tiny(), tiny(1, 1), tiny(16, 3), tiny(22, 4)):
        s = slot_scores(u, keys, m, scorer)
        assert all(torch.equal(s[:, i], s[:, 3]) for i in (4, 5, 9, 10, 19, 20, 22))
        v = native_votes(u, keys=keys, m=m, scorer=scorer, prefilter=False)
        assert v.tolist() == [0, 0, 0, J] + [0] * (N - 4)
        assert torch.equal(v, native_votes_naive(u, a, m=m))
        assert torch.equal(native_votes(u, keys=keys, m=m, prefilter=True), v)
        w = margin_votes(u, keys, m, scorer)
        assert w[3] == pytest.approx(J * 1e-6, abs=1e-12) and int((w > 0).sum()) == 1   # a tie carries ~no evidence
        ss = sum_scores(u, keys, m, scorer)
        assert all(ss[i] == ss[3] for i in (4, 5, 9, 10, 19, 20, 22))


def test_a_later_tie_winner_is_caught():
    """The tests can fail: letting the last copy of a tied note win differs from the loop reference."""
    N, J = 12, 3
    u, a = make(2, N, J, seed=1)
    plant(u, a, 2, [6, 11])
    keys = normalized_keys(a)
    ref = native_votes_naive(u, a)
    assert ref.tolist() == [0, 0, J] + [0] * 9
    assert torch.equal(native_votes(u, keys=keys), ref)
    s = slot_scores(u, keys)
    broken = torch.bincount(N - 1 - s.flip(1).argmax(dim=1), minlength=N)   # broken rule: last max wins
    assert not torch.equal(broken, ref)


@pytest.mark.parametrize("m", [1, 4])
def test_all_equal_addresses(m):
    N, J = 17, 3
    u, a = make(4, N, J, m, seed=2)
    a[:] = a[0, 0]                                   # every note, channel and slot identical
    keys = normalized_keys(a)
    for scorer in (None, tiny(), tiny(3, 1)):
        s = slot_scores(u, keys, m, scorer)
        assert bool((s == s[:, :1]).all())
        assert native_votes(u, keys=keys, m=m, scorer=scorer).tolist() == [J] + [0] * (N - 1)
    assert native_votes(u, keys=keys, m=m, prefilter=True).tolist() == [J] + [0] * (N - 1)
    assert native_votes_naive(u, a, m=m).tolist() == [J] + [0] * (N - 1)


needs_bf16 = pytest.mark.skipif(not bf16_prefilter_available(), reason="no AVX512-BF16 prefilter here")


@needs_bf16
@pytest.mark.parametrize("m", [1, 4])
def test_prefilter_proxy_is_within_eps(m):
    u, a = make(9, 300, 7, m, seed=11, dtype=torch.float32)
    keys = normalized_keys(a)
    s = channel_scores(u, keys, m=m)
    p = approx_scores_bf16(u, keys, m, note_block=64, chan_block=3)
    assert p.dtype == torch.bfloat16
    p = p.float()
    assert p.shape == s.shape
    assert float((p - s)[p >= 0].abs().max()) < route.PREFILTER_EPS / 2
    assert bool((s[p < 0] < route.PREFILTER_EPS).all())   # a negative proxy only where the score is ~<= 0
    assert bool((p[s < -route.PREFILTER_EPS] < 0).all())


@needs_bf16
@pytest.mark.parametrize("m", [1, 4])
def test_prefilter_near_ties_and_fallbacks(m, monkeypatch):
    """Near-ties inside the prefilter's blind spot (differences << eps) are settled in FP32; channels the
    prefilter cannot trust (negative maxima, too many candidates) fall back to the FP32 kernel."""
    N, J, Q = 40, 6, 5
    u, a = make(Q, N, J, m, seed=12, dtype=torch.float32)
    plant(u, a, 30, [], m)
    a[10] = a[30] * 0.5                              # same direction: bitwise equal once normalised
    a[20, ::m] = a[30, ::m] * (1 + 0.02 * torch.randn(J, D))   # slightly off: loses by ~1e-4, << eps
    a[5] = a[30]                                     # exact duplicate, earlier: wins every tie
    a[:, m:2 * m] = -u[0, 1].repeat(m, 1)            # channel 1: every cosine vs token 0 is -1 ...
    u[:, 1] = u[0, 1]                                # ... for all tokens: the maximum is negative
    keys = normalized_keys(a)
    ref = native_votes_naive(u, a, m=m)
    fp32 = native_votes(u, keys=keys, m=m, prefilter=False)
    assert torch.equal(fp32, ref)
    assert torch.equal(native_votes(u, keys=keys, m=m, prefilter=True), ref)
    monkeypatch.setattr(route, "CANDIDATE_CAP", 1)   # every tied channel now takes the FP32 fallback
    assert torch.equal(native_votes(u, keys=keys, m=m, prefilter=True), ref)
    monkeypatch.setattr(route, "PREFILTER_EPS", 0.0)  # a broken bound (no margin) must be caught
    broken = [native_votes(u2, keys=normalized_keys(a2), prefilter=True).tolist() != native_votes_naive(u2, a2).tolist()
              for u2, a2 in (_near_misses(seed) for seed in range(32))]
    assert any(broken)


def _near_misses(seed, J=8, N=64):
    """Channels whose notes all score ~0.9 within BF16 rounding of each other: BF16 can reorder them."""
    g = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(1, J, 16, generator=g), dim=-1)
    v = torch.nn.functional.normalize(torch.randn(1, J, 16, generator=g), dim=-1)
    a = (u[0] + 0.5 * v[0]).repeat(N, 1, 1) + 0.01 * torch.randn(N, J, 16, generator=g)
    return u, a


def test_bf16_and_fp32_inputs_agree():
    u, a = make(5, 29, 6, seed=3)
    keys = normalized_keys(a)
    s16 = channel_scores(u, keys, 4, chan_block=4)                                  # bf16 question
    s32 = channel_scores(u.float(), keys, 4, chan_block=4)
    assert torch.equal(s16, s32)                                                    # cast before normalising
    sk = channel_scores(u, keys.to(torch.bfloat16), 4, chan_block=4)                # bf16 keys are accepted
    assert torch.allclose(sk, s32, atol=2e-2)


@pytest.mark.parametrize("N,J", [(0, 3), (1, 1), (9, 5), (700, 12), (40000, 3)])
def test_normalized_keys_bitwise_as_before(N, J):
    """Slab-wise normalisation == the whole-tensor formula Archive.routing_keys uses, bit for bit."""
    a = (torch.randn(N, J, D, generator=torch.Generator().manual_seed(N)) * 3).to(torch.bfloat16)
    if N > 2:
        a[2] = 0                                     # zero address: clamped norm, zero key
    ref = (a.float() / a.float().norm(dim=-1, keepdim=True).clamp_min(1e-12)).transpose(0, 1).contiguous()
    assert torch.equal(normalized_keys(a), ref)


def test_empty_archive_and_bad_shapes():
    u, a = make(3, 0, 4, m=4)
    keys = normalized_keys(a)
    assert channel_scores(u, keys, m=4).shape == (4, 0)
    assert native_votes(u, keys=keys, m=4).tolist() == [] and native_votes(u, a, m=4).dtype == torch.int64
    assert margin_votes(u, keys, 4).tolist() == [] and sum_scores(u, keys, 4).tolist() == []
    assert native_votes_naive(u, a, m=4).tolist() == []
    with pytest.raises(ValueError):
        channel_scores(u, keys, m=1)                 # J*m rows expected
    with pytest.raises(ValueError):
        channel_scores(u[:0], keys, m=4)             # no question tokens


def test_never_materialises_j_q_n(monkeypatch):
    """Every bmm output is one fixed-size tile within the cache budget, never [J, Q, N]."""
    J, Q, N, m = 24, 64, 3000, 4
    u, a = make(Q, N, J, m, seed=4)
    keys = normalized_keys(a)
    shapes, real = [], torch.bmm

    def spy(x, y, *, out=None):
        r = real(x, y, out=out) if out is not None else real(x, y)
        shapes.append(tuple(r.shape))
        return r

    monkeypatch.setattr(torch, "bmm", spy)
    s = channel_scores(u, keys, m=m)
    jt, nt = tile_shape(J, Q, N, m, "cpu")
    assert set(shapes) == {(jt * m, Q, nt)}
    assert jt * m * Q * nt <= route.CPU_TILE_PER_THREAD * max(1, torch.get_num_threads()) < J * m * Q * N
    shapes.clear()
    v = native_votes(u, keys=keys, m=m, prefilter=True)         # BF16 proxy tiles + one small rescoring bmm
    monkeypatch.undo()
    # BF16 proxy tiles stay within their budget; the one FP32 rescoring bmm is bounded by the
    # candidate cap per channel ([J*m, <= CANDIDATE_CAP, Q]), never by N
    proxy_budget = route.PREFILTER_TILE[0] * max(1, torch.get_num_threads())
    rescoring_bound = J * m * route.CANDIDATE_CAP * Q
    assert max(x[0] * x[1] * x[2] for x in shapes) <= max(proxy_budget, rescoring_bound)
    assert all(x[0] * x[1] * x[2] <= proxy_budget or x[1] <= route.CANDIDATE_CAP for x in shapes)
    assert max(proxy_budget, rescoring_bound) < J * m * Q * N
    assert torch.allclose(s, channel_scores_naive(u, keys, m=m), atol=1e-6, rtol=0)
    assert torch.equal(v, torch.bincount(s.argmax(dim=1), minlength=N))


def test_tile_shape_bounds():
    for J, Q, N, m in [(192, 64, 4096, 1), (1, 1, 1, 1), (7, 4096, 5, 4), (300, 1, 10 ** 6, 1)]:
        for dev in ("cpu", "cuda"):
            jt, nt = tile_shape(J, Q, N, m, dev)
            assert 1 <= jt <= J and 1 <= nt <= N
    jt, nt = tile_shape(192, 64, 4096, 1, "cuda")
    assert jt * nt * 64 <= route.GPU_TILE and jt * nt >= 192 * 1024                  # big tiles on GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_loop():
    u, a = make(64, 300, 12, m=4, seed=5)
    plant(u, a, 7, [150, 299], m=4)
    keys = normalized_keys(a)
    v = native_votes(u.cuda(), keys=keys.cuda(), m=4)
    assert v.device.type == "cuda" and v.cpu().tolist() == native_votes_naive(u, a, m=4).tolist()
    assert torch.allclose(margin_votes(u.cuda(), keys.cuda(), 4).cpu(), margin_votes(u, keys, 4), atol=1e-5)
