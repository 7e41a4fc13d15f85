"""The kernel-side feature capture: `ChunkReducer.on_segment`, fed by the CPU delta-rule kernel's
own chunk-major copies, against `on_layer` on the same q/k (the general path, itself tested
against `reference_features` in test_write.py)."""
import pytest
import torch

from nbcore import load_backbone
from nbcore.kernels import gdn_cpu
from nbcore.notebank.features import ChunkReducer, projection_coords
from nbcore.testing import byte_tokenizer, tiny_gdn_config


def _feed_segments(red, layer, q, k, r, C_kernel=32, segment=2048):
    """Feed [T, H, d] q/k to red.on_segment as gdn_cpu lays them out (heads repeated r times)."""
    T = q.shape[0]
    for a in range(0, T, segment):
        b = min(T, a + segment)
        qs = gdn_cpu._chunked_f32(q[None, a:b], q.shape[1] * r, C_kernel)
        ks = gdn_cpu._chunked_f32(k[None, a:b], k.shape[1] * r, C_kernel)
        red.on_segment(layer, a, b - a, qs, ks)


@pytest.mark.parametrize("T", [1, 31, 64, 500, 2048, 2049, 4100])
@pytest.mark.parametrize("C,r,n_tokens", [(64, 1, True), (512, 2, False), (2048, 3, True), (None, 2, True)],
                         ids=["C64-r1-buf", "C512-r2", "C2048-r3-buf", "noC-r2"])
def test_on_segment_equals_on_layer(T, C, r, n_tokens):
    g = torch.Generator().manual_seed(T)
    H, D, layers = 3, 32, 2
    q, k = torch.randn(T, layers * H, D, generator=g), torch.randn(T, layers * H, D, generator=g) * 3
    coords = projection_coords(layers * H, D, 8, seed=1)
    kw = dict(offset=4096, keep_partial=C is not None, n_tokens=T if n_tokens else None)
    ref, fast = ChunkReducer(coords, H, C, **kw), ChunkReducer(coords, H, C, **kw)
    for layer in range(layers):
        sl = slice(layer * H, (layer + 1) * H)
        ref.on_layer(layer, q[:, sl], k[:, sl])
        assert fast.accepts_segments(layer, 32, 2048)
        _feed_segments(fast, layer, q[:, sl], k[:, sl], r)
    (d_ref, qc_ref), (d, qc) = ref.result(), fast.result()
    assert torch.equal(qc, qc_ref)                       # a selection then rounding: exact
    if C is None:
        assert d is None and d_ref is None
        return
    assert torch.allclose(d, d_ref, atol=2e-6, rtol=0)   # sums taken in another order
    assert torch.equal(fast.partial_keys(), ref.partial_keys())


def test_segments_that_do_not_tile_the_chunks_go_the_general_way():
    coords = projection_coords(2, 32, 8, seed=0)
    assert not ChunkReducer(coords, 2, 48).accepts_segments(0, 32, 2048)      # 48 % 32 != 0
    assert not ChunkReducer(coords, 2, 4096).accepts_segments(0, 32, 2048)    # 2048 % 4096 != 0
    pre = ChunkReducer(coords, 2, 64, offset=32, prefix_keys=torch.randn(32, 2, 32))
    assert not pre.accepts_segments(0, 32, 2048)          # a resumed chunk's prefix: the general path
    with pytest.raises(ValueError, match="segment starts"):
        red = ChunkReducer(coords, 2, 64)
        q = torch.randn(1, 2, 32, 32)
        red.on_segment(0, 64, 10, q, q)


class _NoSegments(ChunkReducer):
    def accepts_segments(self, *a):
        return False


class _Counting(ChunkReducer):
    def on_segment(self, *a):
        self.segments = getattr(self, "segments", 0) + 1
        return super().on_segment(*a)


@pytest.mark.parametrize("hybrid", [False, True], ids=["gdn", "hybrid"])
def test_a_forward_captures_the_same_features_through_the_kernel(hybrid):
    # GQA (2 key heads, 4 value heads), 2,500 tokens = two kernel segments, the second partial
    bb = load_backbone(tiny_gdn_config(hybrid=hybrid), tokenizer=byte_tokenizer(), seed=0)
    if not gdn_cpu.chunk_gated_delta_rule.accepts_feature_sink:
        pytest.skip("no sink")
    ids = torch.randint(3, 262, (2500,), generator=torch.Generator().manual_seed(0))
    coords = projection_coords(bb.heads_per_layer * len(bb.rec_layers), bb.key_dim, 8, seed=0)
    out = {}
    for name, cls in (("general", _NoSegments), ("kernel", _Counting)):
        red = cls(coords, bb.heads_per_layer, 64, n_tokens=len(ids), keep_partial=True)
        logits = bb.forward(bb.new_state(), ids, tap=red)
        out[name] = (*red.result(), red.partial_keys(), logits)
    assert red.segments == 2 * len(bb.rec_layers)        # the kernel path was taken, per segment
    (d0, q0, p0, l0), (d1, q1, p1, l1) = out["general"], out["kernel"]
    assert torch.equal(q1, q0) and torch.equal(p1, p0) and torch.equal(l1, l0)
    assert torch.allclose(d1, d0, atol=2e-6, rtol=0)
