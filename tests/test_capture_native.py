"""The C capture kernel (nbcore/kernels/capture.c via nbcore.kernels.native) against its reference,
`ChunkReducer.on_segment`'s torch path, at odd sizes; its bf16 rounding against torch's; and the
loader's fallbacks (disabled, no compiler, a failing compiler), which must never raise."""
import logging

import numpy as np
import pytest
import torch

from nbcore.kernels import gdn_cpu, native
from nbcore.notebank.features import ChunkReducer, projection_coords

needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler here: the torch path runs")


def _feed(red, layer, q, k, r, c=32, segment=2048):
    """Feed [T, H, d] q/k to red.on_segment as gdn_cpu lays them out (heads repeated r times)."""
    T = q.shape[0]
    for a in range(0, T, segment):
        b = min(T, a + segment)
        red.on_segment(layer, a, b - a, gdn_cpu._chunked_f32(q[None, a:b], q.shape[1] * r, c),
                       gdn_cpu._chunked_f32(k[None, a:b], k.shape[1] * r, c))


@needs_native
@pytest.mark.parametrize("T", [1, 33, 512, 2047, 2049, 5000])
@pytest.mark.parametrize("H,D,dr,C,r,c", [
    (3, 32, 8, 64, 1, 32),       # odd head count
    (2, 20, 7, 128, 2, 32),      # D not a multiple of 8 or 4 lanes, repeated heads
    (4, 64, 16, 512, 3, 64),     # kernel chunk 64
    (1, 36, 36, 2048, 1, 32),    # every coordinate kept, one chunk per segment
    (2, 32, 16, None, 2, 32),    # no chunk: compacted queries only
], ids=["H3", "D20-r2", "c64-r3", "drfull", "noC"])
@pytest.mark.parametrize("buffered", [True, False], ids=["buf", "nobuf"])
def test_native_equals_torch_path(T, H, D, dr, C, r, c, buffered):
    g = torch.Generator().manual_seed(T * 7 + D)
    layers = 2
    q = torch.randn(T, layers * H, D, generator=g)
    k = torch.randn(T, layers * H, D, generator=g) * torch.rand(T, layers * H, 1, generator=g) * 4
    k[T // 3] = 0.0                                       # |k| = 0: the 1e-12 clamp
    coords = projection_coords(layers * H, D, dr, seed=3)
    kw = dict(offset=4096 if C else 0, keep_partial=C is not None, n_tokens=T if buffered else None)
    ref, fast = ChunkReducer(coords, H, C, native=False, **kw), ChunkReducer(coords, H, C, **kw)
    for layer in range(layers):
        sl = slice(layer * H, (layer + 1) * H)
        _feed(ref, layer, q[:, sl], k[:, sl], r, c)
        _feed(fast, layer, q[:, sl], k[:, sl], r, c)
    (d_ref, qc_ref), (d, qc) = ref.result(), fast.result()
    assert torch.equal(qc, qc_ref)                        # a selection, then the same rounding: exact
    if C is None:
        assert d is None and d_ref is None
        return
    assert torch.allclose(d, d_ref, atol=2e-6, rtol=0)    # sums in another order (float lanes, double chunk sum)
    assert torch.equal(fast.partial_keys(), ref.partial_keys())


@needs_native
@pytest.mark.parametrize("D", [8, 20, 32, 36, 64, 128, 256])
def test_l2norm_reproduces_torchs_bits(D):
    g = torch.Generator().manual_seed(D)
    x = torch.randn(5, 3, 32, D, generator=g) * 10 ** torch.randint(-6, 7, (5, 3, 32, 1), generator=g).float()
    x[0, 0, :4] = 0.0                                     # padding rows: eps alone
    x[1, 1, 2, 0] = 3e38                                  # overflowing square: inf sum, row becomes 0 / nan
    for scale in (None, D ** -0.5):
        want = gdn_cpu._l2norm_(x.clone())
        if scale is not None:
            want.mul_(scale)
        got = x.clone()
        assert native.l2norm_(got, gdn_cpu.L2_EPS, scale)
        assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())


@needs_native
def test_delta_rule_gives_the_same_bits_with_and_without_the_c_l2norm(monkeypatch):
    g = torch.Generator().manual_seed(1)
    T, Hk, Hv, K, V = 2100, 2, 4, 32, 16
    q, k = torch.randn(1, T, Hk, K, generator=g), torch.randn(1, T, Hk, K, generator=g)
    v = torch.randn(1, T, Hv, V, generator=g)
    gate, beta = -torch.rand(1, T, Hv, generator=g), torch.rand(1, T, Hv, generator=g)
    with torch.no_grad():
        o1, s1 = gdn_cpu.chunk_gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True,
                                                output_final_state=True)
        monkeypatch.setenv(native.ENV, "0")
        o2, s2 = gdn_cpu.chunk_gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True,
                                                output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


@needs_native
def test_bf16_rounding_matches_torch():
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 1e-40, -1e-40, 3.4e38, -3.4e38,
                             1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -9, 1.00390625, 65504.0])
    x = torch.cat([specials, torch.randn(4096 - len(specials)) * 10 ** torch.randint(-30, 30, (4096 - len(specials),))])
    x = x.view(1, 1, 4096 // 32, 32).contiguous()           # [n=1, BH=1, c=128, D=32]
    T, D = 128, 32
    coords = torch.arange(D).view(1, D)
    qc = torch.empty(T, 1, D, dtype=torch.bfloat16)
    assert native.capture_segment(x, x, 1, 1, T, coords, qc, None, None)
    want = x.view(T, 1, D).to(torch.bfloat16)
    assert torch.equal(qc.view(torch.int16), want.view(torch.int16))
    nan = torch.full((1, 1, 32, 32), float("nan"))
    qn = torch.empty(32, 1, D, dtype=torch.bfloat16)
    assert native.capture_segment(nan, nan, 1, 1, 32, coords, qn, None, None)
    assert torch.isnan(qn.float()).all()


@needs_native
def test_native_declines_what_it_cannot_take():
    q = torch.randn(2, 2, 32, 32)
    coords = torch.zeros(2, 4, dtype=torch.int64)
    qc = torch.empty(64, 2, 4, dtype=torch.bfloat16)
    assert not native.capture_segment(q.double(), q.double(), 1, 2, 64, coords, qc, None, None)   # not fp32
    assert not native.capture_segment(q.transpose(2, 3), q, 1, 2, 64, coords, qc, None, None)     # not contiguous
    d = torch.empty(64, 2)
    assert not native.capture_segment(q, q, 1, 2, 64, coords, qc, d, 48)      # C not a multiple of c = 32


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """The loader's state reset, its cache in tmp_path; restored afterwards."""
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path / "kernels"))
    monkeypatch.setattr(native, "_LIB", native._UNSET)
    yield tmp_path / "kernels"


def test_disabled_by_environment(fresh_loader, monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    assert not native.available()
    q = torch.randn(1, 1, 32, 32)
    assert not native.capture_segment(q, q, 1, 1, 32, torch.zeros(1, 2, dtype=torch.int64),
                                      torch.empty(32, 1, 2, dtype=torch.bfloat16), None, None)


def test_no_compiler_falls_back(fresh_loader, monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert not native.available()
    assert "torch path" in caplog.text
    # and the reducer still works, on its torch path
    coords = projection_coords(2, 32, 8, seed=0)
    q = torch.randn(100, 2, 32)
    red = ChunkReducer(coords, 2, 64)
    _feed(red, 0, q, q, 1)
    ref = ChunkReducer(coords, 2, 64)
    ref.on_layer(0, q, q)
    assert torch.equal(red.result()[1], ref.result()[1])


def test_failing_compiler_is_logged_not_raised(fresh_loader, monkeypatch, tmp_path, caplog):
    bad = tmp_path / "badcc"
    bad.write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 3\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert not native.available()
    assert "broken compiler" in caplog.text
    assert not list(fresh_loader.glob("*.so"))            # nothing half-written left in the cache


@needs_native
def test_build_is_cached_under_a_content_key(fresh_loader):
    assert native.available()
    built = list(fresh_loader.glob("capture-*.so"))
    assert len(built) == 1 and not list(fresh_loader.glob("*.tmp"))
    mtime = built[0].stat().st_mtime_ns
    native._LIB = native._UNSET
    assert native.available()                             # loaded again: not rebuilt
    assert built[0].stat().st_mtime_ns == mtime


@needs_native
def test_archives_equal_with_native_and_torch_capture(monkeypatch):
    """A real ingest (tiny GDN, text with sentences) writes the same archive either way."""
    from nbcore import NoteBankConfig, ingest, load_backbone
    bb = load_backbone("models/tiny-gdn-v5")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "the", "a", "of", "blue", "seven"]
    text = " ".join(" ".join(rng.choice(words, 12)) + "." for _ in range(500))
    cfg = NoteBankConfig()
    a = ingest(bb, text, cfg, block_size=4096)
    monkeypatch.setenv(native.ENV, "0")
    b = ingest(bb, text, cfg, block_size=4096)
    assert a.n_tokens > 4096 and len(a.archive) > 4
    assert torch.equal(a.archive.addresses, b.archive.addresses)
    assert [t.tolist() for t in a.archive.token_ids] == [t.tolist() for t in b.archive.token_ids]


@needs_native
def test_avx2_clone_avx512_and_baseline_builds_agree_bitwise(tmp_path):
    """capture.c's AVX2 clone (x86-64 Linux GCC), its AVX-512 compaction (x86-64, picked at run time)
    and its plain C build give the same bits."""
    import ctypes
    import subprocess
    libs = []
    for i, extra in enumerate(((), ("-DNB_NO_CLONES",), ("-DNB_NO_CLONES", "-DNB_NO_AVX512"))):
        out = tmp_path / f"k{i}.so"
        subprocess.run([native._compiler(), *native.FLAGS, *extra, "-o", str(out), str(native.SOURCE), "-lm"],
                       check=True, capture_output=True)
        lib = ctypes.CDLL(str(out))
        fn, l2 = lib.nb_capture_segment, lib.nb_l2norm_rows
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        fn.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ptr, i64, ptr, i64, i64, ptr, i64, i64, i64, ptr]
        l2.argtypes = [ptr, i64, i64, f32, f32, i64]
        libs.append((fn, l2))
    g = torch.Generator().manual_seed(0)
    for H, D, dr, C, r in [(4, 32, 16, 512, 1), (3, 20, 7, 128, 2), (1, 36, 36, 2048, 1), (2, 64, 32, 512, 1),
                           (2, 24, 16, 256, 2)]:
        T, c = 4096, 32
        n = T // c
        q = torch.randn(n, H * r, c, D, generator=g)
        k = torch.randn(n, H * r, c, D, generator=g) * 3
        coords = torch.stack([torch.randperm(D, generator=g)[:dr] for _ in range(H)])
        outs = []
        for fn, l2 in libs:
            qc, d, sc = torch.zeros(T, H, dr, dtype=torch.bfloat16), torch.zeros(T, H), torch.empty(C)
            assert fn(q.data_ptr(), k.data_ptr(), n, H * r, c, D, r, H, T, coords.data_ptr(), dr, qc.data_ptr(),
                      H * dr, dr, d.data_ptr(), H, 1, C, sc.data_ptr()) == 0
            x = k.clone()
            assert l2(x.data_ptr(), x.numel() // D, D, 1e-6, D ** -0.5, 1) == 0
            outs.append((qc, d, x))
        for other in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
