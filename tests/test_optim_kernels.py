"""lbcomm::frozen_adamw_ (csrc/optim.cpp), the fused frozen-variance AdamW update, against
the pure-torch sequence it replaces (lbcomm.optim.functional.frozen_adamw_) and a sequence
written here, bitwise. The root is the correctly rounded one (the fp64 root rounded to
fp32); the inputs include values whose torch fp32 sqrt differs from it (torch's CPU sqrt is
not correctly rounded on every host)."""
import math

import pytest
import torch

from lbcomm import ops
from lbcomm.optim import functional as F
from lbcomm.optim import kernels as K
from test_kernels import run_without_avx2

needs_op = pytest.mark.skipif(not (ops.HAS_EXTENSION and hasattr(torch.ops.lbcomm, "frozen_adamw_")),
                              reason="lbcomm._C without frozen_adamw_ (rebuild: python setup.py build_ext --inplace)")


def _inputs(n, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 3
    m = torch.randn(n, generator=g) * 1e-2
    v = torch.rand(n, generator=g) ** 4 * 1e-3
    if n > 4:
        v[:3] = 0.0  # d = eps exactly
        m[3] = 0.0
    return w.to(device), m.to(device), v.to(device)


def _torch_sequence(w, m, v, bc2, eps, decay, step_size, bound=None):
    d = torch.sqrt(v.double()).to(v.dtype).div_(bc2 ** 0.5).add_(eps)
    if decay != 0:
        w.mul_(1 - decay)
    if bound is None:
        w.addcdiv_(m, d, value=-step_size)
    else:  # max_update: each coordinate's step clamped
        w.add_(torch.mul(m, -step_size).div_(d).clamp_(-bound, bound))


CASES = [(0, 0.0), (1, 0.0), (31, 1e-4), (1000, 0.0), (100003, 3e-5), ((1 << 20) + 7, 1e-4)]


@needs_op
@pytest.mark.parametrize("n, decay", CASES)
def test_fused_op_equals_the_torch_sequence_bitwise(n, decay):
    bc2, eps, step_size = 1 - 0.999 ** 37, 1e-8, 1e-3 / (1 - 0.9 ** 51)
    w, m, v = _inputs(n)
    ref = w.clone()
    _torch_sequence(ref, m, v, bc2, eps, decay, step_size)
    staged = w.clone()
    F.frozen_adamw_(staged, m, v, bc2, eps, decay, step_size, torch.empty(min(n, F.STAGE)))
    fused = w.clone()
    K.frozen_adamw_(fused, m, v, bc2, eps, decay, step_size, torch.empty(min(n, F.STAGE)))
    assert torch.equal(staged, ref) and torch.equal(fused, ref)
    if n > 4:
        assert not torch.equal(fused, w)  # it did update


@needs_op
@pytest.mark.parametrize("n, decay", CASES)
@pytest.mark.parametrize("bound", [0.0, 3e-4, math.inf])
def test_bounded_fused_op_equals_the_torch_sequence_bitwise(n, decay, bound):
    bc2, eps, step_size = 1 - 0.999 ** 37, 1e-8, 1e-3 / (1 - 0.9 ** 51)
    w, m, v = _inputs(n)
    ref = w.clone()
    _torch_sequence(ref, m, v, bc2, eps, decay, step_size, bound)
    staged = w.clone()
    F.frozen_adamw_(staged, m, v, bc2, eps, decay, step_size, torch.empty(min(n, F.STAGE)), bound)
    fused = w.clone()
    K.frozen_adamw_(fused, m, v, bc2, eps, decay, step_size, torch.empty(min(n, F.STAGE)), bound)
    assert torch.equal(staged, ref) and torch.equal(fused, ref)
    if n > 4:
        step = fused - w * (1 - decay)
        assert float(step.abs().max()) <= bound * (1 + 1e-6) + 1e-6 * float(w.abs().max())
        unbounded = w.clone()
        _torch_sequence(unbounded, m, v, bc2, eps, decay, step_size)
        # the clamp is active at 3e-4, and an inactive bound is bitwise the unbounded update
        assert torch.equal(fused, unbounded) == (bound == math.inf)


@needs_op
def test_the_root_is_correctly_rounded_not_torchs():
    """Where torch's fp32 sqrt is off by an ulp (this host's is on about a sixth of these
    inputs), the update takes IEEE's root: the op and the fallback agree with each other and
    not with a sequence on torch's root."""
    n, bc2, eps, step_size = 100003, 1 - 0.999 ** 37, 1e-8, 1e-3
    w, m, v = _inputs(n)
    off = torch.sqrt(v) != F.ieee_sqrt(v)
    fused = w.clone()
    K.frozen_adamw_(fused, m, v, bc2, eps, 0.0, step_size, torch.empty(F.STAGE))
    with_torch_root = w.clone().addcdiv_(m, torch.sqrt(v).div_(bc2 ** 0.5).add_(eps), value=-step_size)
    assert torch.equal(fused[~off], with_torch_root[~off])  # the same root, the same update
    if bool(off.any()):
        assert not torch.equal(fused, with_torch_root)


@needs_op
def test_fused_op_opcheck_and_errors():
    w, m, v = _inputs(257)
    torch.library.opcheck(torch.ops.lbcomm.frozen_adamw_, (w, m, v, math.sqrt(0.5), 1e-8, 0.999, -1e-3))
    torch.library.opcheck(torch.ops.lbcomm.frozen_adamw_, (w, m, v, math.sqrt(0.5), 1e-8, 0.999, -1e-3, 1e-4))
    with pytest.raises(ValueError, match="frozen_adamw_: bound must be >= 0"):
        torch.ops.lbcomm.frozen_adamw_(w, m, v, 1.0, 1e-8, 1.0, -1e-3, -1.0)
    with pytest.raises(TypeError, match="frozen_adamw_: expected float32"):
        torch.ops.lbcomm.frozen_adamw_(w.double(), m, v, 1.0, 1e-8, 1.0, -1e-3)
    with pytest.raises(ValueError, match="frozen_adamw_: expected contiguous"):
        torch.ops.lbcomm.frozen_adamw_(torch.randn(20, 20).t(), torch.randn(400), torch.rand(400), 1.0, 1e-8, 1.0, 1.0)
    with pytest.raises(ValueError, match="as many elements"):
        torch.ops.lbcomm.frozen_adamw_(w, m[:-1], v, 1.0, 1e-8, 1.0, -1e-3)


def test_wrapper_falls_back_for_non_fp32():
    w, m, v = _inputs(100)
    w64 = w.double()
    K.frozen_adamw_(w64, m.double(), v.double(), 0.5, 1e-8, 0.0, 1e-3, torch.empty(100, dtype=torch.float64))
    ref = w.double()
    _torch_sequence(ref, m.double(), v.double(), 0.5, 1e-8, 0.0, 1e-3)
    assert torch.equal(w64, ref)
    w64, ref = w.double(), w.double()
    K.frozen_adamw_(w64, m.double(), v.double(), 0.5, 1e-8, 0.0, 1e-3, torch.empty(100, dtype=torch.float64), 1e-4)
    _torch_sequence(ref, m.double(), v.double(), 0.5, 1e-8, 0.0, 1e-3, 1e-4)
    assert torch.equal(w64, ref)


@needs_op
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n, decay", CASES)
def test_cuda_fused_op_equals_the_cuda_torch_sequence_bitwise(n, decay):
    """Not run here (no GPU on the development machine): until it passes on one, the
    wrapper sends CUDA tensors through the torch sequence (lbcomm/optim/kernels.py)."""
    bc2, eps, step_size = 1 - 0.999 ** 37, 1e-8, 1e-3 / (1 - 0.9 ** 51)
    w, m, v = _inputs(n, "cuda")
    ref = w.clone()
    _torch_sequence(ref, m, v, bc2, eps, decay, step_size)
    fused = w.clone()
    torch.ops.lbcomm.frozen_adamw_(fused, m, v, bc2 ** 0.5, eps, 1 - decay if decay else 1.0, -step_size)
    assert torch.equal(fused, ref)
    ref, fused = w.clone(), w.clone()
    _torch_sequence(ref, m, v, bc2, eps, decay, step_size, 3e-4)
    torch.ops.lbcomm.frozen_adamw_(fused, m, v, bc2 ** 0.5, eps, 1 - decay if decay else 1.0, -step_size,
                                   3e-4)
    assert torch.equal(fused, ref)


@pytest.mark.skipif(not K._CAPS_OP, reason="lbcomm._C without decode_caps_")
@pytest.mark.parametrize("n", [1, 7, 40000])
@pytest.mark.parametrize("with_scale", [False, True])
def test_decode_caps_op_is_the_caps_from_scratch(n, with_scale):
    """(sqrt(v) a + b) s with IEEE's sqrt (numpy's fp32 sqrt) and each op rounded, bitwise;
    the torch fallback (the fp64 root rounded) gives the same bits; zeros and an infinity in v."""
    import numpy as np

    v = _inputs(n, seed=4)[2]
    v[-1] = math.inf
    a, b = 0.37, 3e-9
    s = torch.tensor(1.7) if with_scale else None
    with np.errstate(over="ignore"):
        want = np.sqrt(v.numpy()) * np.float32(a) + np.float32(b)
        if with_scale:
            want = want * np.float32(1.7)
    out = torch.full_like(v, -1.0)
    K.decode_caps_(out, v, a, b, s)
    assert torch.equal(out, torch.from_numpy(want))
    fallback = torch.full_like(v, -1.0)
    fallback.copy_(torch.sqrt(v.double())).mul_(a).add_(b)
    if with_scale:
        fallback.mul_(s)
    assert torch.equal(out, fallback)
    torch.library.opcheck(torch.ops.lbcomm.decode_caps_.default, (out, v, a, b, s))
    with pytest.raises(ValueError, match="as many elements"):
        K.decode_caps_(out[:1].clone(), v if n > 1 else torch.zeros(2), a, b, s)


@pytest.mark.skipif(not K._CAPS_TABLE_OP, reason="lbcomm._C without decode_caps_table_")
@pytest.mark.parametrize("with_scale", [False, True])
def test_decode_caps_table_is_one_call_per_parameter(with_scale):
    """One call over any range of a layout gives the bits of one `decode_caps_` per
    parameter in it (+inf where a parameter is uncapped), parameters of every size,
    an empty one included, ranges that start and end inside them."""
    numels = [5, 0, 40000, 1, 3000, 7]
    starts = torch.tensor([0, 5, 5, 40005, 40006, 43006, 43013])
    v = _inputs(43013, seed=5)[2]
    coeffs = [(0.37, 3e-9), (0.5, 1e-8), None, (1.25, 0.0), (0.01, 2e-7), None]
    scale = torch.tensor([1.7, 0.3, 2.0, 1.0, 0.9, 4.0]) if with_scale else None
    inf = float("inf")
    table = torch.tensor([(0.0, inf, 1.0) if c is None else (*c, 1.0) for c in coeffs], dtype=torch.float32)
    if with_scale:
        table[:, 2] = scale
    want = torch.empty(43013)
    for i, c in enumerate(coeffs):
        part = want[int(starts[i]):int(starts[i + 1])]
        if c is None:
            part.fill_(inf)
        elif numels[i]:
            K.decode_caps_(part, v[int(starts[i]):int(starts[i + 1])], c[0], c[1],
                           None if scale is None else scale[i])
    for lo, hi in [(0, 43013), (3, 40010), (5, 40005), (40005, 40006), (43006, 43013), (100, 100)]:
        out = torch.full((hi - lo,), -1.0)
        K.decode_caps_table_(out, v, lo, starts, table)
        assert torch.equal(out, want[lo:hi]), (lo, hi)
    torch.library.opcheck(torch.ops.lbcomm.decode_caps_table_.default, (torch.empty(10), v, 2, starts, table))
    with pytest.raises(ValueError, match="must lie in the layout"):
        K.decode_caps_table_(torch.empty(10), v, 43010, starts, table)
    with pytest.raises(ValueError, match=r"\[6, 3\]"):
        K.decode_caps_table_(torch.empty(10), v, 0, starts, table[:, :2].contiguous())


@pytest.mark.skipif(not K._DIRECTION_OP, reason="lbcomm._C without lamb_direction_")
@pytest.mark.parametrize("n", [1, 7, 1000, 100003])
@pytest.mark.parametrize("bound", [None, 1.0, 0.0])
@pytest.mark.parametrize("fresh", [False, True])
def test_lamb_direction_is_the_torch_sequence(n, bound, fresh):
    """OneBitLamb's direction, roots included: the op gives the bits of its torch sequence
    (`direction_torch`) and of the direction written out here with IEEE's roots (the fp64
    root rounded once), each operation rounded as torch rounds it: u, and f's ratio, NaN
    where a ratio is NaN; a NaN momentum stays NaN through the clamp."""
    _, m, v = _inputs(n, seed=n)
    vf = v * torch.rand(n, generator=torch.Generator().manual_seed(1)) * 3
    if n > 10:
        m[5], m[6], m[7] = float("nan"), 1e30, -1e30  # NaN kept, huge values clamped (or not)
    bc1, bc2, eps = 0.271, 0.0953, 1e-8

    def denominator(x):
        return torch.sqrt(x.double()).float() / torch.tensor(bc2 ** 0.5, dtype=torch.float32) + eps

    d = denominator(v)
    want_ratio = torch.amax(d / denominator(vf)).reshape(1) if fresh else None
    want_u = (m / bc1) / d
    if bound is not None:
        want_u = want_u.clamp(-bound, bound)
    for fn in (K.lamb_direction_, K.direction_torch):
        u, stage = torch.full((n,), -1.0), torch.full((n,), -2.0)
        ratio = fn(u, m, v, vf if fresh else None, stage, bc2 ** 0.5, eps, bc1, bound)
        assert torch.equal(u.nan_to_num(7.0), want_u.nan_to_num(7.0)) and bool(u.isnan().eq(want_u.isnan()).all())
        assert (ratio is None) == (not fresh)
        if fresh:
            assert torch.equal(ratio, want_ratio)
    torch.library.opcheck(torch.ops.lbcomm.lamb_direction_.default,
                          (torch.empty(n), m, v, vf if fresh else None, torch.empty(n), bc2 ** 0.5, eps, bc1, bound))
    if fresh and n > 10:  # a NaN ratio wins the max, as torch.amax
        vf[9] = float("nan")
        ratio = K.lamb_direction_(torch.empty(n), m, v, vf, torch.empty(n), bc2 ** 0.5, eps, bc1, bound)
        assert bool(ratio.isnan().all())
    with pytest.raises(ValueError, match="contiguous CPU tensors of"):
        torch.ops.lbcomm.lamb_direction_(torch.empty(n), m, v, vf, torch.empty(n + 1), 1.0, eps, bc1, bound)


@pytest.mark.skipif(not K._IMPLIED_OP, reason="lbcomm._C without implied_variance_")
@pytest.mark.parametrize("n", [1, 7, 1000, 100003])
def test_implied_variance_is_the_torch_sequence(n):
    """OneBitLamb's fresh variance from the reduced momentum: the op gives the bits of
    `F.implied_grad_variance_` (six torch ops, addcmul_'s multiply-add fused as torch's CPU
    kernels do on this host) and of the formula written out with one fp32 fma, and commits
    m <- m_new; NaN and infinities go through as in torch."""
    g = torch.Generator().manual_seed(n)
    vf, m, mn = torch.rand(n, generator=g) * 1e-3, torch.randn(n, generator=g) * 1e-2, torch.randn(n, generator=g)
    if n > 10:
        mn[3], m[4], vf[5] = float("nan"), float("inf"), -0.0
    b1, b2 = 0.9, 0.999
    want_v, want_m = vf.clone(), m.clone()
    F.implied_grad_variance_(want_v, mn, want_m, b1, b2)
    gt = (mn - m * torch.tensor(b1)) / torch.tensor(1 - b1)
    w = torch.tensor(1 - b2, dtype=torch.float32)
    fused = (w * gt).double() * gt.double() + (vf * torch.tensor(b2)).double()  # the product exact in fp64
    assert torch.equal(want_v.nan_to_num(7.0), fused.float().nan_to_num(7.0)), \
        "torch's addcmul_ does not fuse its multiply-add on this host"
    got_v, got_m = vf.clone(), m.clone()
    K.implied_variance_(got_v, mn, got_m, b1, b2)
    assert torch.equal(got_v.nan_to_num(7.0), want_v.nan_to_num(7.0))
    assert torch.equal(got_v.isnan(), want_v.isnan()) and torch.equal(got_m.nan_to_num(7.0), mn.nan_to_num(7.0))
    torch.library.opcheck(torch.ops.lbcomm.implied_variance_.default, (vf.clone(), mn, m.clone(), b1, b2))
    with pytest.raises(ValueError, match="contiguous CPU tensors of"):
        torch.ops.lbcomm.implied_variance_(vf.clone(), mn[:-1] if n > 1 else torch.empty(2), m.clone(), b1, b2)


@pytest.mark.skipif(not K._IMPLIED_OP, reason="lbcomm._C without implied_variance_")
def test_implied_variance_portable_body():
    """The same with the AVX2 bodies off (LBCOMM_DISABLE_AVX2=1): the portable body's
    std::fma gives the same bits."""
    run_without_avx2(f"{__file__}::test_implied_variance_is_the_torch_sequence", 4)
