"""The fused CPU kernels against numpy packbits and the plain-torch reference."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lbcomm import ops
from lbcomm.testing import kernels as R

pytestmark = pytest.mark.skipif(not ops.HAS_EXTENSION, reason=f"extension not built: {ops.extension_problem()}")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCKS = [None, 32, 64, 2048]


def _special_values(n, dtype=torch.float32):
    """Random values mixed with +0, -0, subnormals and huge magnitudes."""
    x = torch.randn(n)
    specials = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 3e38, -3e38, 1.0, -1.0])
    if n:
        idx = torch.randint(0, n, (min(n, 64),))
        x[idx] = specials[torch.randint(0, len(specials), idx.shape)]
    return x.to(dtype)


def run_without_avx2(nodeid: str, passed: int) -> None:
    """Run the test `nodeid` (path::name) in a fresh process with the AVX2 bodies off
    (LBCOMM_DISABLE_AVX2=1: the portable bodies) and require all `passed` cases to pass."""
    env = dict(os.environ, LBCOMM_DISABLE_AVX2="1")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", nodeid],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"{passed} passed" in res.stdout, res.stdout[-3000:]


def _worker_inputs(n0, p, dtype=torch.float32, err_scale=0.1):
    m = R.chunk_size(n0, p)
    x = torch.randn(n0).to(dtype)
    e = torch.randn(p, m) * err_scale
    e.view(-1)[n0:] = 0  # pad slots carry no error
    return x, e


@pytest.mark.parametrize("n0", [0, 1, 7, 8, 9, 1000, 4099])
@pytest.mark.parametrize("p", [1, 3])
def test_packing_matches_numpy_packbits(n0, p):
    x = _special_values(n0)
    m = R.chunk_size(n0, p)
    e = torch.zeros(p, m)
    e.view(-1)[:n0] = _special_values(n0) * torch.rand(n0).round()  # zeros of both signs too
    y = x.numpy() + e.view(-1)[:n0].numpy()  # the bits are those of y = x + e (-0 + +0 is +0)
    packed, _ = ops.worker_compress(x, e, 2048)
    signs = np.zeros(p * m, dtype=bool)
    signs[:n0] = np.signbit(y)
    expected = np.packbits(signs.reshape(p, m), axis=1, bitorder="little")
    assert packed.shape == (p, m // 8)
    np.testing.assert_array_equal(packed.numpy(), expected)


def test_negative_zero_is_a_set_bit_and_pad_is_clear():
    x = torch.tensor([-0.0, 0.0, -1e-45, 1e-45, -5.0, -0.0])
    e = torch.zeros(1, 32)
    e[0, 0] = -0.0  # -0 + -0 = -0 (bit set); -0 + +0 = +0 (bit clear)
    packed, scales = ops.worker_compress(x, e, None)
    assert packed.tolist()[0] == [0b010101, 0, 0, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n0,p", [(0, 2), (1, 1), (7, 2), (33, 3), (1000, 4), (5000, 5), (70001, 3)])
@pytest.mark.parametrize("in_place", [True, False])
def test_worker_compress_matches_reference(n0, p, block, dtype, in_place):
    x, e = _worker_inputs(n0, p, dtype)
    ref_packed, ref_scales, ref_err = R.worker_compress(x, e, block)
    err = e.clone()
    out = None if in_place else torch.full_like(e, float("nan"))
    packed, scales = ops.worker_compress(x, err, block, error_out=out)
    new_err = err if in_place else out
    if not in_place:
        assert torch.equal(err, e), "error must be untouched when error_out is given"
    assert torch.equal(packed, ref_packed)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    torch.testing.assert_close(new_err, ref_err, rtol=1e-6, atol=1e-6)
    assert torch.all(new_err.view(-1)[n0:] == 0)


def _weights(n, seed=0):
    """Per-coordinate weights > 0 spanning many binades, tiny and huge ones too."""
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(torch.randn(n, generator=g) * 3)
    if n > 4:
        w[:4] = torch.tensor([1e-20, 1e20, 1.0, 0.1])
    return w


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [None, 32, 2048])
@pytest.mark.parametrize("n0,p", [(1, 1), (33, 3), (5000, 5), (70001, 3)])
def test_worker_compress_with_weights(n0, p, block, dtype, wdtype):
    """x / w fused: the reference's arithmetic; for fp32 x bit for bit the same as dividing
    first (what the 1-bit hook did before the fusion); bf16 weights at their fp32 values."""
    x, e = _worker_inputs(n0, p, dtype)
    w = _weights(n0).to(wdtype)
    ref_packed, ref_scales, ref_err = R.worker_compress(x, e, block, w)
    err, out = e.clone(), torch.full_like(e, float("nan"))
    packed, scales = ops.worker_compress(x, err, block, weights=w)
    packed2, scales2 = ops.worker_compress(x, e, block, error_out=out, weights=w)
    assert torch.equal(packed, ref_packed) and torch.equal(packed2, ref_packed) and torch.equal(scales2, scales)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    torch.testing.assert_close(err, ref_err, rtol=1e-6, atol=1e-6)
    assert torch.equal(out, err)
    assert torch.all(err.view(-1)[n0:] == 0)
    divided_err = e.clone()
    divided = ops.worker_compress(x.float() / w.float(), divided_err, block)
    if dtype == torch.float32:
        assert torch.equal(divided[0], packed) and torch.equal(divided[1], scales) and torch.equal(divided_err, err)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [None, 64])
@pytest.mark.parametrize("p,m,numel", [(1, 32, 5), (3, 4096, 12000), (4, 8192, 32768)])
def test_unpack_into_with_weights(p, m, numel, block, wdtype):
    packed = torch.randint(0, 256, (p, m // 8), dtype=torch.uint8)
    scales = torch.rand(p, R.num_blocks(m, block))
    w = _weights(numel, seed=1).to(wdtype)
    out = torch.full((numel,), float("nan"))
    assert ops.unpack_into(packed, scales, block, out, weights=w) is out
    assert torch.equal(out, R.unpack(packed, scales, numel, block, w))
    assert torch.equal(out, ops.unpack(packed, scales, numel, block) * w.float())  # decode, then multiply
    half = torch.empty(numel, dtype=torch.bfloat16)  # the non-direct path
    assert torch.equal(ops.unpack_into(packed, scales, block, half, weights=w), out.to(torch.bfloat16))


def test_bad_weights_are_refused_clearly():
    x, e = _worker_inputs(100, 2)
    with pytest.raises(ValueError, match="one element per coordinate"):
        ops.worker_compress(x, e, 64, weights=torch.ones(99))
    for bad in (torch.float64, torch.float16):
        with pytest.raises(TypeError, match="weights float32 or bfloat16"):
            ops.worker_compress(x, e, 64, weights=torch.ones(100, dtype=bad))
    packed, scales = ops.worker_compress(x, e, 64)
    with pytest.raises(ValueError, match="one element per coordinate"):
        ops.unpack_into(packed, scales, 64, torch.empty(100), weights=torch.ones(101))


def _caps(n, seed=0, scale=0.5):
    """Per-coordinate caps of the capped decode around the block scales, with 0, a tiny
    one and +inf (no bound) among them."""
    g = torch.Generator().manual_seed(seed)
    c = torch.exp(torch.randn(n, generator=g) * 1.5) * scale
    c[torch.rand(n, generator=g) < 0.2] = float("inf")
    if n > 3:
        c[:3] = torch.tensor([0.0, 1e-30, float("inf")])
    return c


def _capped_definition(v, cap, p, m, n0, block):
    """The capped decode written out in float64 per block of [p, m] values v (flat, n0
    real): (scales [p, nb], decoded [n0], error [n0]) (module docs of lbcomm.reference)."""
    nb = R.num_blocks(m, block)
    vv, cc = torch.zeros(p * m, dtype=torch.float64), torch.full((p * m,), float("inf"), dtype=torch.float64)
    vv[:n0], cc[:n0] = v.double(), cap.double()
    real = torch.arange(p * m) < n0
    scales = torch.zeros(p, nb, dtype=torch.float64)
    per = torch.zeros(p * m, dtype=torch.float64)
    for k in range(p):
        for b in range(nb):
            sl = slice(k * m + b * block, k * m + min((b + 1) * block, m))
            r, y, c = real[sl], vv[sl], cc[sl]
            if not r.any():
                continue
            s1 = y[r].square().mean().sqrt()
            keep = r & (c >= s1.float().double())
            s = y[keep].square().mean().sqrt() if keep.any() else s1
            scales[k, b] = s
            per[sl] = s.float().double()
    d = torch.minimum(per, cc)[:n0]
    decoded = torch.where(torch.signbit(vv[:n0]), -d, d)
    err = torch.maximum(torch.minimum(vv[:n0] - decoded, 3 * cc[:n0]), -3 * cc[:n0])
    return scales, decoded, err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [32, 64, 2048])
@pytest.mark.parametrize("n0,p", [(1, 1), (33, 3), (5000, 5), (70001, 3)])
def test_capped_decode_matches_reference_and_its_definition(n0, p, block, dtype):
    """The capped decode: worker, server and unpack against the reference; scales, decoded
    values and errors against the rule written out in float64; no decoded value above its
    cap; all-inf caps are bitwise the plain kernels."""
    x, e = _worker_inputs(n0, p, dtype, err_scale=0.5)
    m = e.shape[1]
    cap = _caps(n0, seed=n0)
    ref_packed, ref_scales, ref_err = R.worker_compress(x, e, block, cap=cap)
    err = e.clone()
    packed, scales = ops.worker_compress(x, err, block, cap=cap)
    assert torch.equal(packed, ref_packed)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    torch.testing.assert_close(err, ref_err, rtol=1e-6, atol=1e-6)
    assert torch.all(err.view(-1)[n0:] == 0)
    y = x.float() + e.view(-1)[:n0]
    want_scales, decoded, want_err = _capped_definition(y, cap, p, m, n0, block)
    torch.testing.assert_close(scales.double(), want_scales, rtol=1e-6, atol=0)
    torch.testing.assert_close(err.view(-1)[:n0].double(), want_err, rtol=1e-6, atol=1e-6)
    out = torch.full((n0,), float("nan"))
    ops.unpack_into(packed, scales, block, out, cap=cap)
    assert torch.equal(out, R.unpack(packed, scales, n0, block, cap=cap))
    torch.testing.assert_close(out.double(), decoded, rtol=1e-6, atol=0)
    assert torch.all(out.abs() <= cap)
    # the server: every rank's values decoded under the cap, then the same rule on z
    real = min(n0, m)
    s0 = torch.randn(m) * 0.3
    s0[real:] = 0
    got_s = s0.clone()
    pk2, sc2 = ops.server_compress(packed, scales, got_s, block, real, cap=cap[:real])
    rp2, rs2, re2 = R.server_compress(packed, scales, s0.clone(), block, real, cap=cap[:real])
    assert torch.equal(pk2, rp2)
    torch.testing.assert_close(sc2, rs2, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_s, re2, rtol=1e-6, atol=1e-6)
    neg = R.unpack_signs(packed)[:, :real]
    per = R._expand(scales, m, block)[:, :real].double()
    mean = torch.where(neg, -torch.minimum(per, cap[:real].double()), torch.minimum(per, cap[:real].double())).mean(0)
    z = mean + s0[:real].double()
    torch.testing.assert_close(_capped_definition(z.float(), cap[:real], 1, m, real, block)[2],
                               got_s[:real].double(), rtol=1e-5, atol=1e-5)
    # no bound anywhere: bitwise the plain kernels
    inf = torch.full((n0,), float("inf"))
    plain_err, capped_err = e.clone(), e.clone()
    assert all(torch.equal(a, b) for a, b in zip(ops.worker_compress(x, plain_err, block),
                                                 ops.worker_compress(x, capped_err, block, cap=inf)))
    assert torch.equal(plain_err, capped_err)


def test_bad_caps_are_refused_clearly():
    x, e = _worker_inputs(100, 2)
    with pytest.raises(ValueError, match="one element per coordinate"):
        ops.worker_compress(x, e, 64, cap=torch.ones(99))
    with pytest.raises(TypeError, match="cap float32"):
        ops.worker_compress(x, e, 64, cap=torch.ones(100, dtype=torch.float64))
    with pytest.raises(ValueError, match="needs a block size"):
        ops.worker_compress(x, e, None, cap=torch.ones(100))
    with pytest.raises(ValueError, match="cannot be combined"):
        ops.worker_compress(x, e, 64, weights=torch.ones(100), cap=torch.ones(100))
    packed, scales = ops.worker_compress(x, e, 64)
    with pytest.raises(ValueError, match="one element per coordinate"):
        ops.unpack_into(packed, scales, 64, torch.empty(100), cap=torch.ones(101))
    with pytest.raises(ValueError, match="one element per coordinate"):
        ops.server_compress(packed, scales, torch.zeros(e.shape[1]), 64, 50, cap=torch.ones(51))


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("m_real,p", [(32, 1), (64, 2), (1000, 3), (4096, 4), (9000, 5)])
@pytest.mark.parametrize("in_place", [True, False])
def test_server_compress_matches_reference(m_real, p, block, in_place):
    m = R.chunk_size(m_real, 1)
    real = m_real - 3 if m_real > 3 else m_real
    packed = torch.randint(0, 256, (p, m // 8), dtype=torch.uint8)
    scales = torch.rand(p, R.num_blocks(m, block)) * 2
    s = torch.randn(m) * 0.1
    s[real:] = 0
    ref_packed, ref_scales, ref_err = R.server_compress(packed, scales, s, block, real)
    err = s.clone()
    out = None if in_place else torch.empty_like(s)
    got_packed, got_scales = ops.server_compress(packed, scales, err, block, real, error_out=out)
    new_err = err if in_place else out
    assert torch.equal(got_packed, ref_packed)
    torch.testing.assert_close(got_scales, ref_scales, rtol=1e-6, atol=0)
    torch.testing.assert_close(new_err, ref_err, rtol=1e-6, atol=1e-6)
    assert torch.all(new_err[real:] == 0)


def test_server_compress_reads_strided_rows():
    """The transport hands the server row slices of one receive buffer."""
    p, m, block = 3, 256, 64
    nb = R.num_blocks(m, block)
    buf = torch.randint(0, 256, (p, m // 8 + 4 * nb), dtype=torch.uint8)
    buf[:, m // 8:].view(torch.float32).copy_(torch.rand(p, nb))
    packed, scales = buf[:, : m // 8], buf[:, m // 8:].view(torch.float32)
    s = torch.randn(m)
    ref = R.server_compress(packed.contiguous(), scales.contiguous(), s, block)
    got = ops.server_compress(packed, scales, s.clone(), block)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("p,m,numel", [(1, 32, 0), (1, 32, 5), (2, 64, 100), (3, 4096, 12000), (4, 8192, 32768)])
def test_unpack_matches_reference(p, m, numel, block):
    packed = torch.randint(0, 256, (p, m // 8), dtype=torch.uint8)
    scales = torch.rand(p, R.num_blocks(m, block))
    assert torch.equal(ops.unpack(packed, scales, numel, block), R.unpack(packed, scales, numel, block))


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("capped", [False, True])
def test_large_unpack_matches_reference(capped, offset):
    """Outputs of a million elements and more are written with streamed stores (aligned
    ones; offset 1 is not aligned): still the reference's values, every element written."""
    p, m, numel, block = 4, (1 << 18) + 2048, (1 << 20) + 5, 2048
    packed = torch.randint(0, 256, (p, m // 8), dtype=torch.uint8)
    scales = torch.rand(p, R.num_blocks(m, block))
    cap = _caps(numel, scale=0.5) if capped else None
    buf = torch.full((numel + offset,), float("nan"))
    out = buf[offset:]
    ops.unpack_into(packed, scales, block, out, cap=cap)
    assert torch.equal(out, R.unpack(packed, scales, numel, block, cap=cap))


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_into_matches_unpack(dtype):
    packed = torch.randint(0, 256, (3, 128), dtype=torch.uint8)
    scales = torch.rand(3, 16)
    out = torch.full((3000,), float("nan"), dtype=dtype)
    assert ops.unpack_into(packed, scales, 64, out) is out
    assert torch.equal(out, R.unpack(packed, scales, 3000, 64).to(dtype))


def test_non_contiguous_input_is_handled():
    base = torch.randn(64, 50)
    x = base.t()  # non-contiguous view
    e = torch.zeros(2, R.chunk_size(x.numel(), 2))
    ref = R.worker_compress(x.contiguous(), e, 64)
    got = ops.worker_compress(x, e.clone(), 64)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_huge_values_keep_finite_scales():
    x = torch.full((64,), 3e38)
    packed, scales = ops.worker_compress(x, torch.zeros(1, 64), 32)
    assert torch.isfinite(scales).all() and scales[0, 0].item() == pytest.approx(3e38, rel=1e-6)


def test_nonfinite_input_gives_nonfinite_scale_of_its_block_only():
    x = torch.randn(256)
    x[70] = float("nan")
    _, scales = ops.worker_compress(x, torch.zeros(1, 256), 64)
    assert torch.isfinite(scales).tolist() == [[True, False, True, True]]


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: ops.worker_compress(torch.arange(8), torch.zeros(1, 32), None), TypeError, "float32/float16/bfloat16"),
        (lambda: ops.worker_compress(torch.randn(40), torch.zeros(1, 32), None), ValueError, "40 elements"),
        (lambda: ops.worker_compress(torch.randn(8), torch.zeros(1, 24), None), ValueError, "multiple of 32"),
        (lambda: ops.worker_compress(torch.randn(8), torch.zeros(1, 32), 48), ValueError, "block_size"),
        (lambda: ops.worker_compress(torch.randn(8), torch.zeros(1, 32, dtype=torch.float64), None), TypeError,
         "error float32"),
        (lambda: ops.worker_compress(torch.randn(8), torch.zeros(1, 32), None, error_out=torch.zeros(1, 64)),
         ValueError, "error_out"),
        (lambda: ops.server_compress(torch.zeros(2, 4, dtype=torch.uint8), torch.zeros(2, 2), torch.zeros(32), None),
         ValueError, "scales of shape"),
        (lambda: ops.server_compress(torch.zeros(2, 4, dtype=torch.uint8), torch.zeros(2, 1), torch.zeros(32), None,
                                     numel=33), ValueError, "numel"),
        (lambda: ops.unpack(torch.zeros(1, 4, dtype=torch.uint8), torch.zeros(1, 1), 40, None), ValueError, "numel"),
    ],
)
def test_bad_input_is_refused_clearly(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_partial_overlap_of_error_out_is_refused():
    e = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="partially overlaps"):
        torch.ops.lbcomm.worker_compress(torch.randn(32), e.view(-1)[:64].view(1, 64), None,
                                         e.view(-1)[32:96].view(1, 64))


@pytest.mark.parametrize("block", [None, 64])
def test_opcheck(block):
    x, e = _worker_inputs(100, 2)
    torch.library.opcheck(torch.ops.lbcomm.worker_compress.default, (x, e.clone(), block, None))
    torch.library.opcheck(torch.ops.lbcomm.worker_compress.default, (x, e.clone(), block, torch.empty_like(e)))
    m = e.shape[1]
    packed = torch.randint(0, 256, (2, m // 8), dtype=torch.uint8)
    scales = torch.rand(2, R.num_blocks(m, block))
    torch.library.opcheck(torch.ops.lbcomm.server_compress.default, (packed, scales, torch.randn(m), block, 50, None))
    torch.library.opcheck(torch.ops.lbcomm.unpack.default, (packed, scales, 90, block))
    torch.library.opcheck(torch.ops.lbcomm.unpack_into.default, (packed, scales, block, torch.empty(90)))
    w = torch.rand(100) + 0.5
    torch.library.opcheck(torch.ops.lbcomm.worker_compress.default, (x, e.clone(), block, None, w))
    torch.library.opcheck(torch.ops.lbcomm.unpack_into.default, (packed, scales, block, torch.empty(90), w[:90]))
    if block is not None:  # the capped decode
        c = torch.rand(100) + 0.1
        torch.library.opcheck(torch.ops.lbcomm.worker_compress.default, (x, e.clone(), block, None, None, c))
        torch.library.opcheck(torch.ops.lbcomm.server_compress.default,
                              (packed, scales, torch.randn(m), block, 50, None, c[:50]))
        torch.library.opcheck(torch.ops.lbcomm.unpack_into.default, (packed, scales, block, torch.empty(90), None,
                                                                     c[:90]))


def test_portable_path_matches_reference():
    """The same comparisons with the AVX2 bodies switched off (a fresh process)."""
    if not ops.cpu_has_avx2():
        pytest.skip("this CPU runs the portable path already")
    code = (
        "import torch, sys; from lbcomm import ops; from lbcomm.testing import kernels as R\n"
        "assert not ops.cpu_has_avx2()\n"
        "torch.manual_seed(0)\n"
        "for n0, p in [(1, 1), (7, 2), (1000, 3), (70001, 4)]:\n"
        "  for block in [None, 32, 2048]:\n"
        "    for dt in [torch.float32, torch.float16, torch.bfloat16]:\n"
        "      m = R.chunk_size(n0, p); x = torch.randn(n0).to(dt); e = torch.randn(p, m); e.view(-1)[n0:] = 0\n"
        "      rp, rs, re = R.worker_compress(x, e, block); pk, sc = ops.worker_compress(x, e, block)\n"
        "      assert torch.equal(pk, rp); torch.testing.assert_close(sc, rs, rtol=1e-6, atol=0)\n"
        "      torch.testing.assert_close(e, re, rtol=1e-6, atol=1e-6)\n"
        "      s = torch.randn(m); rp2, rs2, re2 = R.server_compress(pk, sc, s, block, min(n0, m))\n"
        "      pk2, sc2 = ops.server_compress(pk, sc, s, block, min(n0, m))\n"
        "      assert torch.equal(pk2, rp2); torch.testing.assert_close(sc2, rs2, rtol=1e-6, atol=0)\n"
        "      torch.testing.assert_close(s, re2, rtol=1e-6, atol=1e-6)\n"
        "      assert torch.equal(ops.unpack(pk, sc, n0, block), R.unpack(pk, sc, n0, block))\n"
        "      w = torch.rand(n0) * 4 + 0.01; e = torch.randn(p, m); e.view(-1)[n0:] = 0\n"
        "      rp, rs, re = R.worker_compress(x, e, block, w); pk, sc = ops.worker_compress(x, e, block, weights=w)\n"
        "      assert torch.equal(pk, rp); torch.testing.assert_close(sc, rs, rtol=1e-6, atol=0)\n"
        "      torch.testing.assert_close(e, re, rtol=1e-6, atol=1e-6)\n"
        "      o = torch.empty(n0); ops.unpack_into(pk, sc, block, o, weights=w)\n"
        "      assert torch.equal(o, R.unpack(pk, sc, n0, block, w))\n"
        "      wb = w.to(torch.bfloat16); e = torch.randn(p, m); e.view(-1)[n0:] = 0\n"
        "      rp, rs, re = R.worker_compress(x, e, block, wb); pk, sc = ops.worker_compress(x, e, block, weights=wb)\n"
        "      assert torch.equal(pk, rp); torch.testing.assert_close(e, re, rtol=1e-6, atol=1e-6)\n"
        "      ops.unpack_into(pk, sc, block, o, weights=wb); assert torch.equal(o, R.unpack(pk, sc, n0, block, wb))\n"
        "      if block is None: continue\n"
        "      c = torch.exp(torch.randn(n0)) * 0.5; c[torch.rand(n0) < 0.2] = float('inf')\n"
        "      e = torch.randn(p, m) * 0.5; e.view(-1)[n0:] = 0\n"
        "      rp, rs, re = R.worker_compress(x, e, block, cap=c); pk, sc = ops.worker_compress(x, e, block, cap=c)\n"
        "      assert torch.equal(pk, rp); torch.testing.assert_close(sc, rs, rtol=1e-6, atol=0)\n"
        "      torch.testing.assert_close(e, re, rtol=1e-6, atol=1e-6)\n"
        "      r = min(n0, m); s = torch.randn(m); rp2, rs2, re2 = R.server_compress(pk, sc, s, block, r, cap=c[:r])\n"
        "      pk2, sc2 = ops.server_compress(pk, sc, s, block, r, cap=c[:r])\n"
        "      assert torch.equal(pk2, rp2); torch.testing.assert_close(sc2, rs2, rtol=1e-6, atol=0)\n"
        "      torch.testing.assert_close(s, re2, rtol=1e-6, atol=1e-6)\n"
        "      ops.unpack_into(pk, sc, block, o, cap=c); assert torch.equal(o, R.unpack(pk, sc, n0, block, cap=c))\n"
        "print('portable ok')\n"
    )
    env = dict(os.environ, LBCOMM_DISABLE_AVX2="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "portable ok" in res.stdout
