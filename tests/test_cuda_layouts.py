"""The CUDA kernels' layouts (tests/test_cuda.py has the rest): every block layout of the
server's four-elements-per-lane kernel and its fallbacks, rows and buffers off their
alignment, against the plain-torch reference."""
import pytest
import torch

from lbcomm import ops
from lbcomm.testing import kernels as R
from test_cuda import DEV, _assert_error_close, pytestmark  # noqa: F401 (pytestmark: the same skip)


@pytest.mark.parametrize("cap", [False, True])
@pytest.mark.parametrize("p", [3, 9])
@pytest.mark.parametrize("block", [96, 128, 160, 256, 480, 512, 1024, 1056, 4096, 8192])
def test_server_compress_block_layouts(block, p, cap):
    """Every layout of the server's block mode (a group per warp or per thread block, one
    to four 128-element slabs per warp, a last slab cut short, the fallback for blocks too
    short or too long), ranks in one batch of loads or two, real prefixes ending inside a
    quad: bits, scales and errors as the reference."""
    m = 3 * block + 4096
    nb = R.num_blocks(m, block)
    for real in (m, m - 5, m - 130):
        packed = torch.randint(0, 256, (p, m // 8), dtype=torch.uint8, device=DEV)
        scales = torch.rand(p, nb, device=DEV) * 2
        s = torch.randn(m, device=DEV) * 0.5
        s[real:] = 0
        caps = torch.rand(real, device=DEV) + 0.3 if cap else None
        ref = R.server_compress(packed, scales, s.clone(), block, real, cap=caps)
        err = s.clone()
        got = ops.server_compress(packed, scales, err, block, real, cap=caps)
        assert torch.equal(got[0], ref[0]), f"real={real}"
        torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=0)
        _assert_error_close(err, ref[2], ref[1])


@pytest.mark.parametrize("cap", [False, True])
@pytest.mark.parametrize("block", [128, 2048])
@pytest.mark.parametrize("offset,pad", [(1, 3), (2, 0), (0, 1)])
def test_server_compress_reads_unaligned_rows(offset, pad, block, cap):
    """Rows whose start or stride is not a multiple of 4 bytes (the kernel then loads bytes
    instead of 32-bit words): the same bits, scales and errors as the reference."""
    p, m = 6, 4096 + 96
    nb = R.num_blocks(m, block)
    buf = torch.randint(0, 256, (p, offset + m // 8 + pad), dtype=torch.uint8, device=DEV)
    packed = buf[:, offset : offset + m // 8]
    scales = torch.rand(p, nb, device=DEV) * 2
    s = torch.randn(m, device=DEV)
    caps = torch.rand(m - 40, device=DEV) + 0.5 if cap else None
    ref = R.server_compress(packed.contiguous(), scales, s.clone(), block, m - 40, cap=caps)
    err = s.clone()
    got = ops.server_compress(packed, scales, err, block, m - 40, cap=caps)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=0)
    _assert_error_close(err, ref[2], ref[1])


@pytest.mark.parametrize("kind", ["plain", "fp32 weights", "bf16 weights", "cap"])
@pytest.mark.parametrize("offset", [0, 1, 2])
def test_unpack_into_unaligned_buffers(offset, kind):
    """Output, weights and caps that start off a 16-byte boundary (element stores and loads
    instead of float4 ones), a length ending inside a quad: the reference's values."""
    p, m, block, n = 3, 2048 + 32, 64, 3 * (2048 + 32) - 7
    packed = torch.randint(0, 256, (p, m // 8), dtype=torch.uint8, device=DEV)
    scales = torch.rand(p, R.num_blocks(m, block), device=DEV)
    out = torch.full((n + offset,), float("nan"), device=DEV)[offset:]
    aux = (torch.rand(n + offset, device=DEV) + 0.5)[offset:]
    if kind == "cap":
        ops.unpack_into(packed, scales, block, out, cap=aux)
        want = R.unpack(packed, scales, n, block, cap=aux)
    elif kind == "plain":
        ops.unpack_into(packed, scales, block, out)
        want = R.unpack(packed, scales, n, block)
    else:
        w = aux if kind == "fp32 weights" else (torch.rand(n + offset, device=DEV) + 0.5).to(torch.bfloat16)[offset:]
        ops.unpack_into(packed, scales, block, out, weights=w)
        want = R.unpack(packed, scales, n, block, w)
    assert torch.equal(out, want)
