"""Caps the kernels compute from the optimizer's variance (`TableCaps`: the capped decode
of the 1-bit optimizers on the CPU) against the same caps passed as a tensor and the
plain-torch reference."""

import numpy as np
import pytest
import torch

from lbcomm import ops
from lbcomm.reduce.inputs import ComputedCaps, TableCaps
from lbcomm.testing import kernels as R
from test_kernels import _worker_inputs, run_without_avx2

pytestmark = pytest.mark.skipif(not ops.HAS_EXTENSION, reason=f"extension not built: {ops.extension_problem()}")


def _table_caps(numels, seed=0):
    """A parameter layout's variance and per-parameter (a, b, s) table (uncapped, scaled and
    empty parameters among them) as `TableCaps`, and the same caps as a tensor."""
    from lbcomm.optim import kernels as K
    g = torch.Generator().manual_seed(seed)
    starts = torch.tensor([0] + np.cumsum(numels).tolist(), dtype=torch.int64)
    total = int(starts[-1])
    v = torch.exp(torch.randn(total, generator=g) * 2) * 1e-3
    v[torch.rand(total, generator=g) < 0.05] = 0.0
    table = torch.tensor([(0.0, float("inf"), 1.0) if i % 4 == 2 else (0.3 + 0.1 * i, 1e-4 * (i % 3), 1.0 + (i % 2))
                          for i in range(len(numels))], dtype=torch.float32)
    caps = torch.empty(total)
    K.decode_caps_table_(caps, v, 0, starts, table)
    fill = lambda lo, hi, buf: K.decode_caps_table_(buf[:hi - lo], v, lo, starts, table)  # noqa: E731
    return TableCaps(v, starts, table, fill, total), caps


@pytest.mark.parametrize("block", [32, 64, 2048])
@pytest.mark.parametrize("n0,p,off", [(1, 1, 0), (33, 3, 7), (5000, 3, 1234), (9001, 4, 0)])
def test_table_caps_are_the_caps_they_stand_for(n0, p, off, block):
    """Caps the kernels compute from the variance (`TableCaps`, the optimizers' capped
    decode on the CPU) give bitwise what the same caps passed as a tensor give: worker,
    server and unpack, calls that start inside the layout; plain `ComputedCaps` (filled
    into a tensor first) too."""
    tc, caps = _table_caps([3, 0, 700, 4100, 1, 2048, 77, 3000, 1500], seed=n0)
    x, e = _worker_inputs(n0, p, err_scale=0.5)
    m = e.shape[1]
    part, want_caps = tc[off:off + n0], caps[off:off + n0]
    computed = ComputedCaps(tc.fill_fn, n0, off)
    s0_ref = torch.linspace(-0.3, 0.3, m)
    s0_ref[min(n0, m):] = 0
    results = []
    for cap in (want_caps, part, computed):
        err = e.clone()
        packed, scales = ops.worker_compress(x, err, block, cap=cap)
        real = min(n0, m)
        s0 = torch.linspace(-0.3, 0.3, m)
        s0[real:] = 0
        pk2, sc2 = ops.server_compress(packed, scales, s0, block, real, cap=cap[:real])
        out = torch.full((n0,), float("nan"))
        ops.unpack_into(packed, scales, block, out, cap=cap)
        results.append((packed, scales, err, pk2, sc2, s0, out))
    packed, scales, _, pk2, _, _, out = results[0]
    assert torch.equal(out, R.unpack(packed, scales, n0, block, cap=want_caps))  # the tensor caps' path itself
    assert torch.equal(pk2, R.server_compress(packed, scales, s0_ref, block, min(n0, m), cap=want_caps[:min(n0, m)])[0])
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], got))


def test_table_caps_portable_path():
    """The same with the AVX2 bodies off (LBCOMM_DISABLE_AVX2=1): the portable bodies."""
    run_without_avx2(f"{__file__}::test_table_caps_are_the_caps_they_stand_for", 12)


def test_table_caps_are_refused_clearly():
    """The ops' computed-caps arguments: with each other, inside the layout, no weights."""
    tc, _ = _table_caps([100, 60])
    x, e = _worker_inputs(100, 2)
    op = torch.ops.lbcomm.worker_compress
    with pytest.raises(ValueError, match="go together"):
        op(x, e, 64, None, None, tc.v, tc.table, None, 0)
    with pytest.raises(ValueError, match="needs the variance"):
        op(x, e, 64, None, None, None, tc.table, tc.starts, 0)
    with pytest.raises(ValueError, match="must lie in the layout"):
        op(x, e, 64, None, None, tc.v, tc.table, tc.starts, 61)
    with pytest.raises(ValueError, match="cannot be combined"):
        op(x, e, 64, None, torch.ones(100), tc.v, tc.table, tc.starts, 0)
    with pytest.raises(ValueError, match="not decrease"):
        op(x, e, 64, None, None, tc.v, tc.table, torch.tensor([0, 100, 90]), 0)
    with pytest.raises(ValueError, match="cover 100 elements, the call 99"):
        ops.worker_compress(x[:99], e, 64, cap=ComputedCaps(tc.fill_fn, 100))
    packed, scales = ops.worker_compress(x, e, 64)
    torch.library.opcheck(torch.ops.lbcomm.unpack_into.default, (packed, scales, 64, torch.empty(100)),
                          {"cap": tc.v, "cap_table": tc.table, "cap_starts": tc.starts, "cap_lo": 60})


def test_one_rule_says_which_caps_the_kernels_compute(monkeypatch):
    """`ops.kernel_computes_caps`, which the ops and the reduction both follow: table caps
    over a CPU variance, while the CPU kernels run; never other caps."""
    tc, caps = _table_caps([100, 28])
    cpu = torch.device("cpu")
    assert ops.kernel_computes_caps(tc, cpu) and ops.kernel_computes_caps(tc[5:50], cpu)
    assert not ops.kernel_computes_caps(ComputedCaps(tc.fill_fn, tc.numel), cpu)
    assert not ops.kernel_computes_caps(caps, cpu) and not ops.kernel_computes_caps(None, cpu)
    meta = TableCaps(tc.v.to("meta"), tc.starts, tc.table, tc.fill_fn, tc.numel)
    assert not ops.kernel_computes_caps(meta, torch.device("meta"))
    monkeypatch.setattr(ops, "HAS_EXTENSION", False)
    monkeypatch.setattr(ops, "_warned", set())  # the fallback's one-time warning, fresh
    with pytest.warns(RuntimeWarning, match="reference"):
        assert not ops.kernel_computes_caps(tc, cpu)


@pytest.mark.parametrize("block", [64, 2048])
def test_caps_left_to_the_update_give_the_capped_decodes_bits(block):
    """`on_result=False` (OneBitAdam's and ZeroOneAdam's update on the CPU): the result
    decoded without caps, then capped inside the update (`frozen_adamw_capped_`, and its
    torch fallback `functional.cap_momentum_` + `frozen_adamw_`), gives bitwise the
    momentum and the parameters of the capped decode followed by the plain update:
    uncapped parameters (b = inf), zero variance (c = b), caps above the scale and caps
    that bind among them."""
    from lbcomm.optim import functional as F
    from lbcomm.optim import kernels as K

    numels = [3, 0, 700, 4100, 1, 2048, 77, 3000, 1500]
    tc, caps = _table_caps(numels, seed=block)
    tc.table[:, 2] = 1.0  # Adam's momentum is not scaled
    K.decode_caps_table_(caps, tc.v, 0, tc.starts, tc.table)
    n0 = tc.numel
    x, e = _worker_inputs(n0, 1, err_scale=0.5)
    packed, scales = ops.worker_compress(x * 1e-2, e, block)
    capped, plain = torch.empty(n0), torch.empty(n0)
    ops.unpack_into(packed, scales, block, capped, cap=tc)
    ops.unpack_into(packed, scales, block, plain)
    assert torch.equal(capped, R.unpack(packed, scales, n0, block, cap=caps))
    binds = caps < plain.abs()
    assert bool(binds.any()) and bool((~binds).any())  # both kinds of coordinate
    w0 = torch.randn(n0)
    args = (0.3, 1e-8, 1e-3, 2e-3)
    want_w, fused_w, torch_w = w0.clone(), w0.clone(), w0.clone()
    fused_m, torch_m = plain.clone(), plain.clone()
    for i in range(len(numels)):
        lo, hi = int(tc.starts[i]), int(tc.starts[i + 1])
        a, b, _ = tc.table[i].tolist()
        cap = None if b == float("inf") else (a, b)
        v = tc.v[lo:hi]
        for bound in (None, 5e-3):
            w = w0[lo:hi].clone()
            K.frozen_adamw_(w, capped[lo:hi], v, *args, torch.empty(max(hi - lo, 1)), bound)
            if bound is None:
                want_w[lo:hi] = w
            else:
                bounded = w
        K.frozen_adamw_(fused_w[lo:hi], fused_m[lo:hi], v, *args, torch.empty(max(hi - lo, 1)), None, cap)
        F.frozen_adamw_(torch_w[lo:hi], torch_m[lo:hi], v, *args, torch.empty(max(hi - lo, 1)), None, cap)
        w = w0[lo:hi].clone()
        m = plain[lo:hi].clone()
        K.frozen_adamw_(w, m, v, *args, torch.empty(max(hi - lo, 1)), 5e-3, cap)
        assert torch.equal(w, bounded) and torch.equal(m, capped[lo:hi]), i
    for m, w in ((fused_m, fused_w), (torch_m, torch_w)):
        assert torch.equal(m, capped) and torch.equal(w, want_w)
    # a NaN cap (inf * 0) leaves the value, as the capped decode's MINPS does
    m = plain[:8].clone()
    F.cap_momentum_(m, torch.full((8,), float("inf")), 0.0, 0.0, torch.empty(8))
    assert torch.equal(m, plain[:8])


def test_capped_update_op_opcheck_and_errors():
    w, m, v = torch.randn(300), torch.randn(300) * 1e-2, torch.rand(300) * 1e-4
    op = torch.ops.lbcomm.frozen_adamw_capped_
    torch.library.opcheck(op, (w, m, v, 0.7, 1e-8, 0.999, -1e-3, None, 0.5, 1e-3))
    torch.library.opcheck(op, (w, m, v, 0.7, 1e-8, 0.999, -1e-3, 1e-4, 0.5, 0.0))
    with pytest.raises(ValueError, match="cap coefficients must be >= 0"):
        op(w, m, v, 0.7, 1e-8, 1.0, -1e-3, None, -0.5, 0.0)
    with pytest.raises(ValueError, match="bound must be >= 0"):
        op(w, m, v, 0.7, 1e-8, 1.0, -1e-3, -1.0, 0.5, 0.0)
    with pytest.raises(ValueError, match="as many elements"):
        op(w, m[:-1], v, 0.7, 1e-8, 1.0, -1e-3, None, 0.5, 0.0)


def test_left_caps_skip_uncapped_and_exact_parameters():
    """`bounds.left_caps`: what the update must cap once the decode left the result's caps:
    (a, b) per parameter, nothing for an uncapped parameter (b = inf) or one averaged
    exactly (its exact mean replaced the decoded value), nothing at all when the decode
    applied the caps itself."""
    from lbcomm.optim.bounds import left_caps

    tc, _ = _table_caps([3, 5, 7, 2, 4])  # parameter 2 is uncapped
    left = TableCaps(tc.v, tc.starts, tc.table, tc.fill_fn, tc.numel, on_result=False)
    a = tc.table[:, :2].tolist()
    assert left_caps(left, None) == [tuple(a[0]), tuple(a[1]), None, tuple(a[3]), tuple(a[4])]
    exact_part = (torch.tensor([3, 4, 5, 6, 7]), [(1, 0)])  # parameter 1 averaged exactly
    assert left_caps(left, exact_part) == [tuple(a[0]), None, None, tuple(a[3]), tuple(a[4])]
    assert left_caps(tc, None) is None and left_caps(None, None) is None
