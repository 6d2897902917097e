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
