"""The CUDA kernels against the plain-torch reference and against the CPU kernels."""
import pytest
import torch

from lbcomm import ops
from lbcomm.testing import kernels as R


def _why_skip():
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if not ops.HAS_EXTENSION:
        return f"extension not built: {ops.extension_problem()}"
    if not torch.ops.lbcomm.built_with_cuda():
        # Without CUDA kernels the wrappers fall back to the reference: nothing to test.
        return "lbcomm was built without CUDA kernels (needs nvcc and a CUDA torch at build time)"
    return None


_SKIP = _why_skip()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCKS = [None, 32, 2048, 65536]
SIZES = [0, 1, 7, 33, 1000, 2**20 + 5]
EPS32 = torch.finfo(torch.float32).eps


def _x(n0, dtype):
    """Random input with exact zeros of both signs mixed in (their sign bit matters)."""
    x = torch.randn(n0, device=DEV)
    x[::7] = 0.0
    x[3::11] = -0.0
    return x.to(dtype)


def _error(p, m, n0, scale=0.3):
    e = torch.randn(p, m, device=DEV) * scale
    e.view(-1)[3::11] = -0.0  # -0 + -0 = -0: a set bit with a zero value
    e.view(-1)[n0:] = 0  # pad slots carry no error
    return e


def _per_elem(scales, m, block):
    """Per-element scale [rows, m] from block scales [rows, nb]."""
    return scales[:, :1].expand(-1, m) if block is None else scales.repeat_interleave(block, dim=1)[:, :m]


def _assert_error_close(got, want, scales):
    """A scale may differ from the reference by one fp32 ulp (its float64 sum runs in another
    order), which moves the error by up to one ulp of that scale; everything else is exact."""
    atol = 2 * EPS32 * (scales.abs().max().item() if scales.numel() else 0.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=atol)


def _assert_own_error_exact(err, v, real, scales, block):
    """err must be exactly v - copysign(scale, v) with the kernel's own scales (pads 0)."""
    per = _per_elem(scales.reshape(v.shape[0], -1), v.shape[1], block)
    want = torch.where(real, v - torch.copysign(per, v), torch.zeros((), device=v.device))
    assert torch.equal(err.reshape(v.shape), want)


def _worker_y(x, e):
    p, m = e.shape
    flat = torch.zeros(p * m, device=e.device)
    flat[: x.numel()] = x.reshape(-1).float()
    real = (torch.arange(p * m, device=e.device) < x.numel()).reshape(p, m)
    return torch.where(real, flat.reshape(p, m) + e, torch.zeros((), device=e.device)), real


def _server_z(packed, scales, s, block, numel):
    """z with the recipe of the server step (fp32 sum in rank order, then * (1/p), then + s)."""
    p, m = packed.shape[0], s.numel()
    neg = R.unpack_signs(packed)
    per = _per_elem(scales, m, block)
    acc = torch.zeros(m, device=s.device)
    for j in range(p):
        acc = acc + torch.where(neg[j], -per[j], per[j])
    inv_p = (torch.tensor(1.0) / torch.tensor(float(p))).to(s.device)
    real = torch.arange(m, device=s.device) < numel
    return torch.where(real, acc * inv_p + s, torch.zeros((), device=s.device)).reshape(1, m), real.reshape(1, m)


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n0", SIZES)
def test_worker_compress_matches_reference(n0, p, block, dtype, in_place):
    m = R.chunk_size(n0, p)
    x, e = _x(n0, dtype), _error(p, m, n0)
    ref_packed, ref_scales, ref_err = R.worker_compress(x, e, block)
    err = e.clone()
    out = None if in_place else torch.full_like(e, float("nan"))
    packed, scales = ops.worker_compress(x, err, block, error_out=out)
    new_err = err if in_place else out
    if not in_place:
        assert torch.equal(err, e), "error must be untouched when error_out is given"
    assert packed.device.type == "cuda" and packed.shape == (p, m // 8)
    assert scales.shape == (p, R.num_blocks(m, block))
    assert torch.equal(packed, ref_packed)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    _assert_error_close(new_err, ref_err, ref_scales)
    y, real = _worker_y(x, e)
    _assert_own_error_exact(new_err, y, real, scales, block)
    if block is None and p > 1:
        assert torch.equal(scales, scales[:1].expand_as(scales)), "one scale for the whole tensor"


@pytest.mark.parametrize("block", [None, 32, 96, 2048, 4096, 65536])
def test_worker_compress_block_size_edges(block):
    """Blocks longer than the chunk, a last block cut short, and blocks kept partly in registers."""
    for n0, p in [(3 * 4096 + 17, 3), (70001, 2), (65536 * 2 + 40, 2)]:
        m = R.chunk_size(n0, p)
        x, e = _x(n0, torch.float32), _error(p, m, n0)
        ref_packed, ref_scales, ref_err = R.worker_compress(x, e, block)
        packed, scales = ops.worker_compress(x, e, block)
        assert torch.equal(packed, ref_packed)
        torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
        _assert_error_close(e, ref_err, ref_scales)


def test_worker_compress_one_dimensional_error_and_non_contiguous_x():
    base = torch.randn(64, 50, device=DEV)
    x = base.t()
    e = _error(1, R.chunk_size(x.numel(), 1), x.numel()).reshape(-1)
    ref_packed, ref_scales, ref_err = R.worker_compress(x.contiguous(), e, 64)
    packed, scales = ops.worker_compress(x, e, 64)
    assert packed.dim() == 1 and torch.equal(packed, ref_packed.reshape(-1))
    torch.testing.assert_close(scales, ref_scales.reshape(-1), rtol=1e-6, atol=0)
    _assert_error_close(e, ref_err, ref_scales)


def test_single_scale_is_deterministic():
    n0, p = 3 * 2**20 + 11, 4
    m = R.chunk_size(n0, p)
    x, e = _x(n0, torch.float32), _error(p, m, n0)
    runs = [ops.worker_compress(x, e, None, error_out=torch.empty_like(e)) for _ in range(3)]
    for packed, scales in runs[1:]:
        assert torch.equal(packed, runs[0][0]) and torch.equal(scales, runs[0][1])


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n0", [n for n in SIZES if n])  # an empty tensor has no server chunks
def test_server_compress_matches_reference(n0, p, block, in_place):
    m = R.chunk_size(n0, p)
    nb = R.num_blocks(m, block)
    for real in sorted({0, 1, min(n0, m), m - 5, m}):
        packed = torch.randint(0, 256, (p, m // 8), dtype=torch.uint8, device=DEV)
        scales = torch.rand(p, nb, device=DEV) * 2
        s = torch.randn(m, device=DEV) * 0.1
        s[real:] = 0
        ref_packed, ref_scales, ref_err = R.server_compress(packed, scales, s, block, real)
        err = s.clone()
        out = None if in_place else torch.full_like(s, float("nan"))
        got_packed, got_scales = ops.server_compress(packed, scales, err, block, real, error_out=out)
        new_err = err if in_place else out
        if not in_place:
            assert torch.equal(err, s)
        assert torch.equal(got_packed, ref_packed), f"real={real}"
        torch.testing.assert_close(got_scales, ref_scales, rtol=1e-6, atol=0)
        _assert_error_close(new_err, ref_err, ref_scales)
        z, zreal = _server_z(packed, scales, s, block, real)
        _assert_own_error_exact(new_err, z, zreal, got_scales, block)


@pytest.mark.parametrize("block", [None, 64, 2048])
def test_server_compress_reads_strided_rows(block):
    """The transport hands the server row slices of one receive buffer (bits then scales)."""
    p, m = 5, 4096 + 96
    nb = R.num_blocks(m, block)
    buf = torch.randint(0, 256, (p, m // 8 + 4 * nb + 12), dtype=torch.uint8, device=DEV)
    buf[:, m // 8 : m // 8 + 4 * nb].view(torch.float32).copy_(torch.rand(p, nb, device=DEV))
    packed, scales = buf[:, : m // 8], buf[:, m // 8 : m // 8 + 4 * nb].view(torch.float32)
    s = torch.randn(m, device=DEV)
    ref = R.server_compress(packed.contiguous(), scales.contiguous(), s, block, m - 40)
    err = s.clone()
    got = ops.server_compress(packed, scales, err, block, m - 40)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=0)
    _assert_error_close(err, ref[2], ref[1])


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [None, 32, 2048])
@pytest.mark.parametrize("n0,p", [(1, 1), (33, 3), (1000, 2), (2**20 + 5, 4)])
def test_weights_match_reference(n0, p, block, dtype, wdtype):
    """Per-coordinate weights (the 1-bit hook's normalization), fp32 and bf16: the worker
    divides by them, unpack_into multiplies by them, as the reference does."""
    m = R.chunk_size(n0, p)
    x, e = _x(n0, dtype), _error(p, m, n0)
    w = (torch.exp(torch.randn(n0, device=DEV) * 3)).to(wdtype)
    ref_packed, ref_scales, ref_err = R.worker_compress(x, e, block, w)
    err = e.clone()
    packed, scales = ops.worker_compress(x, err, block, weights=w)
    assert torch.equal(packed, ref_packed)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    _assert_error_close(err, ref_err, ref_scales)
    divided_err = e.clone()  # bitwise what dividing first gives
    divided = ops.worker_compress(x.float() / w.float(), divided_err, block)
    if dtype == torch.float32:
        assert torch.equal(divided[0], packed) and torch.equal(divided[1], scales) and torch.equal(divided_err, err)
    out = torch.full((n0,), float("nan"), device=DEV)
    assert ops.unpack_into(packed, scales, block, out, weights=w) is out
    assert torch.equal(out, R.unpack(packed, scales, n0, block, w))
    assert torch.equal(out, ops.unpack(packed, scales, n0, block) * w.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [32, 2048])
@pytest.mark.parametrize("n0,p", [(1, 1), (33, 3), (1000, 2), (2**20 + 5, 4)])
def test_capped_decode_matches_reference_and_cpu(n0, p, block, dtype):
    """The capped decode (caps around the scales, 0 and +inf among them): worker, server and
    unpack_into against the reference and the CPU kernels; no decoded value above its cap."""
    m = R.chunk_size(n0, p)
    x, e = _x(n0, dtype), _error(p, m, n0, scale=0.5)
    cap = torch.exp(torch.randn(n0, device=DEV) * 1.5) * 0.5
    cap[torch.rand(n0, device=DEV) < 0.2] = float("inf")
    cap[:1] = 0.0
    ref_packed, ref_scales, ref_err = R.worker_compress(x, e, block, cap=cap)
    err = e.clone()
    packed, scales = ops.worker_compress(x, err, block, cap=cap)
    assert torch.equal(packed, ref_packed)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    _assert_error_close(err, ref_err, ref_scales)
    cpu_err = e.cpu()
    cpu_packed, cpu_scales = ops.worker_compress(x.cpu(), cpu_err, block, cap=cap.cpu())
    assert torch.equal(packed.cpu(), cpu_packed)
    torch.testing.assert_close(scales.cpu(), cpu_scales, rtol=1e-6, atol=0)
    real = min(n0, m)
    s = torch.randn(m, device=DEV) * 0.3
    s[real:] = 0
    got_s = s.clone()
    pk2, sc2 = ops.server_compress(packed, scales, got_s, block, real, cap=cap[:real])
    rp2, rs2, re2 = R.server_compress(packed, scales, s.clone(), block, real, cap=cap[:real])
    assert torch.equal(pk2, rp2)
    torch.testing.assert_close(sc2, rs2, rtol=1e-6, atol=0)
    _assert_error_close(got_s, re2, rs2)
    out = torch.full((n0,), float("nan"), device=DEV)
    ops.unpack_into(packed, scales, block, out, cap=cap)
    assert torch.equal(out, R.unpack(packed, scales, n0, block, cap=cap))
    assert bool((out.abs() <= cap).all())


@pytest.mark.parametrize("block", [None, 32, 2048, 65536])
@pytest.mark.parametrize("p", [1, 2, 5])
@pytest.mark.parametrize("n0", SIZES)
def test_unpack_matches_reference(n0, p, block):
    m = R.chunk_size(n0, p)
    packed = torch.randint(0, 256, (p, m // 8), dtype=torch.uint8, device=DEV)
    scales = torch.rand(p, R.num_blocks(m, block), device=DEV)
    for numel in sorted({0, n0, max(p * m - 3, 0), p * m}):
        got = ops.unpack(packed, scales, numel, block)
        assert got.shape == (numel,) and got.device.type == "cuda"
        assert torch.equal(got, R.unpack(packed, scales, numel, block))


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_into_matches_reference(dtype):
    packed = torch.randint(0, 256, (3, 128), dtype=torch.uint8, device=DEV)
    scales = torch.rand(3, 16, device=DEV)
    out = torch.full((3000,), float("nan"), dtype=dtype, device=DEV)
    assert ops.unpack_into(packed, scales, 64, out) is out
    assert torch.equal(out, R.unpack(packed, scales, 3000, 64).to(dtype))


def test_compressed_allreduce_single_rank_nccl():
    """A one-rank NCCL group: the transport accepts CUDA tensors and returns the input."""
    import os
    import tempfile

    import torch.distributed as dist

    import lbcomm

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(d, 'init')}", rank=0, world_size=1)
        try:
            x = torch.randn(1000, device=DEV)
            state = lbcomm.CompressionState(1000)
            assert state.device.type == "cuda"
            assert lbcomm.compressed_allreduce_(x, state) is x
        finally:
            dist.destroy_process_group()


def test_unpack_strided_rows():
    p, m, block = 3, 2048 + 32, 64
    nb = R.num_blocks(m, block)
    packed = torch.randint(0, 256, (p, m // 8 + 5), dtype=torch.uint8, device=DEV)[:, : m // 8]
    scales = torch.rand(p, nb + 3, device=DEV)[:, :nb]
    want = R.unpack(packed.contiguous(), scales.contiguous(), p * m - 9, block)
    assert torch.equal(ops.unpack(packed, scales, p * m - 9, block), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [None, 32, 2048, 65536])
@pytest.mark.parametrize("n0,p", [(1, 1), (33, 2), (1000, 3), (70001, 4), (2**20 + 5, 5)])
def test_cuda_matches_cpu_kernels(n0, p, block, dtype):
    m = R.chunk_size(n0, p)
    x, e = _x(n0, dtype), _error(p, m, n0)
    e_cpu = e.cpu().clone()  # a separate copy even where DEV is the CPU
    packed, scales = ops.worker_compress(x, e, block)
    packed_c, scales_c = ops.worker_compress(x.cpu(), e_cpu, block)
    assert torch.equal(packed.cpu(), packed_c)
    torch.testing.assert_close(scales.cpu(), scales_c, rtol=1e-6, atol=0)
    _assert_error_close(e.cpu(), e_cpu, scales_c)

    real = min(n0, m)
    s = torch.randn(m, device=DEV) * 0.1
    s[real:] = 0
    s_cpu = s.cpu().clone()
    sp, ss = ops.server_compress(packed, scales, s, block, real)
    sp_c, ss_c = ops.server_compress(packed.cpu(), scales.cpu(), s_cpu, block, real)
    assert torch.equal(sp.cpu(), sp_c)
    torch.testing.assert_close(ss.cpu(), ss_c, rtol=1e-6, atol=0)
    _assert_error_close(s.cpu(), s_cpu, ss_c)

    got = ops.unpack(packed, scales, n0, block)
    assert torch.equal(got.cpu(), ops.unpack(packed.cpu(), scales.cpu(), n0, block))


def test_runs_on_the_current_stream():
    """Inputs produced late on a side stream: a kernel on any other stream would read them
    before they exist."""
    n0, p, block = 100_000, 3, 2048
    m = R.chunk_size(n0, p)
    x, e = _x(n0, torch.float32), _error(p, m, n0)
    ref_packed, ref_scales, ref_err = R.worker_compress(x, e, block)
    slow = torch.randn(4096, 4096, device=DEV)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(8):
            slow = slow @ slow  # keeps the side stream busy for a while
        x2, e2 = x.clone(), e.clone()
        packed, scales = ops.worker_compress(x2, e2, block)
        out = ops.unpack(packed, scales, n0, block)
    stream.synchronize()
    assert torch.equal(packed, ref_packed)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    _assert_error_close(e2, ref_err, ref_scales)
    assert torch.equal(out, R.unpack(ref_packed, scales, n0, block))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_device():
    n0, p, block = 5000, 2, 64
    m = R.chunk_size(n0, p)
    x = torch.randn(n0, device="cuda:1")
    e = torch.randn(p, m, device="cuda:1")
    e.view(-1)[n0:] = 0
    ref_packed, ref_scales, ref_err = R.worker_compress(x, e, block)
    packed, scales = ops.worker_compress(x, e, block)
    assert packed.device == x.device and torch.equal(packed, ref_packed)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    _assert_error_close(e, ref_err, ref_scales)


def test_nonfinite_input_stays_in_its_block():
    x = torch.randn(256, device=DEV)
    x[70] = float("nan")
    _, scales = ops.worker_compress(x, torch.zeros(1, 256, device=DEV), 64)
    assert torch.isfinite(scales).tolist() == [[True, False, True, True]]


def test_mixed_devices_are_refused():
    with pytest.raises(ValueError, match="lbcomm::worker_compress"):
        torch.ops.lbcomm.worker_compress(torch.randn(8), torch.zeros(1, 32, device=DEV), None, None)


@pytest.mark.parametrize("block", [None, 64])
def test_opcheck(block):
    n0, p = 1000, 2
    m = R.chunk_size(n0, p)
    x, e = _x(n0, torch.float32), _error(p, m, n0)
    torch.library.opcheck(torch.ops.lbcomm.worker_compress.default, (x, e.clone(), block, None))
    torch.library.opcheck(torch.ops.lbcomm.worker_compress.default, (x, e.clone(), block, torch.empty_like(e)))
    packed = torch.randint(0, 256, (p, m // 8), dtype=torch.uint8, device=DEV)
    scales = torch.rand(p, R.num_blocks(m, block), device=DEV)
    s = torch.randn(m, device=DEV)
    torch.library.opcheck(torch.ops.lbcomm.server_compress.default, (packed, scales, s, block, m - 7, None))
    torch.library.opcheck(torch.ops.lbcomm.unpack.default, (packed, scales, p * m - 9, block))
