"""The compressed allreduce on real gloo process groups against the reference algorithm."""
import pytest
import torch

import lbcomm
from lbcomm.testing import kernels as R
from lbcomm.compressed import PIECE_MIN, reduce_
from dist_util import run_ranks

SIZES = [1, 7, 1000, 4099]
STEPS = 20


def _inputs(rank, t, n0, dtype=torch.float32):
    """Deterministic per (rank, step): any process can rebuild every rank's input."""
    g = torch.Generator().manual_seed(1000 * t + rank)
    return (torch.randn(n0, generator=g) * (1 + rank)).to(dtype)


def _run_blocks(rank, p, sizes, blocks, steps, dtype):
    return {block: _run_steps(rank, p, sizes, block, steps, dtype, False) for block in blocks}


def _run_steps(rank, p, sizes, block, steps, dtype, use_async):
    results = {}
    for n0 in sizes:
        state = lbcomm.CompressionState(n0, block_size=block)
        outs = []
        for t in range(steps):
            x = _inputs(rank, t, n0, dtype)
            if use_async:
                out = lbcomm.compressed_allreduce(x, state, out=torch.empty_like(x), async_op=True).wait()
            elif t % 2:  # odd steps reduce in place through out=
                out = x.clone()
                assert lbcomm.compressed_allreduce(out, state, out=out) is out
            elif t % 4 == 2:  # the primary entry point: in place, no allocation
                out = x.clone()
                assert lbcomm.compressed_allreduce_(out, state) is out
            else:  # into a separate output
                out = torch.empty_like(x)
                assert lbcomm.compressed_allreduce(x, state, out=out) is out
            assert out.dtype == dtype and out.shape == x.shape
            outs.append(out.clone())
        results[n0] = (outs, state.worker_error.clone(), state.server_error.clone())
    return results


def _check(results, p, sizes, block, steps, dtype):
    for n0 in sizes:
        per_rank = [r[n0] for r in results]
        # bitwise identical on every rank, every step
        for t in range(steps):
            for r in range(1, p):
                assert torch.equal(per_rank[0][0][t], per_rank[r][0][t]), f"rank {r} differs at step {t}"
        if p == 1:
            for t in range(steps):
                assert torch.equal(per_rank[0][0][t], _inputs(0, t, n0, dtype))
            continue
        # equal to the reference algorithm, step by step, from the same (zero) start
        m = R.chunk_size(n0, p)
        we = [torch.zeros(p, m) for _ in range(p)]
        se = [torch.zeros(m) for _ in range(p)]
        sum_out = torch.zeros(n0, dtype=torch.float64)
        sum_mean = torch.zeros(n0, dtype=torch.float64)
        for t in range(steps):
            xs = [_inputs(r, t, n0, dtype) for r in range(p)]
            ref_out, we, se = R.compressed_allreduce(xs, we, se, block)
            torch.testing.assert_close(per_rank[0][0][t].float(), ref_out.to(dtype).float(), rtol=1e-5, atol=1e-6)
            sum_out += per_rank[0][0][t].double() if dtype == torch.float32 else ref_out.double()
            sum_mean += torch.stack([x.double() for x in xs]).mean(0)
        # the exact telescoping invariant (docs/concepts.md), on the errors the ranks hold
        worker = torch.stack([pr[1].double() for pr in per_rank]).mean(0)[:n0]
        server = torch.cat([pr[2].double() for pr in per_rank])[:n0]
        residual = sum_out - (sum_mean - worker - server)
        scale = sum_mean.abs().max().item() + 1
        assert residual.abs().max().item() < 1e-5 * scale * steps, residual.abs().max()
        # and the padding never carries error
        for pr in per_rank:
            assert torch.all(pr[1][n0:] == 0)
        torch.testing.assert_close(torch.stack([pr[1] for pr in per_rank]).view(p, -1),
                                   torch.stack([w.view(-1) for w in we]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_matches_reference_and_invariant(p):
    blocks = (None, lbcomm.config.DEFAULT_BLOCK_SIZE, 64)
    results = run_ranks(_run_blocks, p, SIZES, blocks, STEPS, torch.float32)
    for block in blocks:
        _check([r[block] for r in results], p, SIZES, block, STEPS, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_across_ranks(dtype):
    results = run_ranks(_run_steps, 3, [1000], 256, 5, dtype, False)
    _check(results, 3, [1000], 256, 5, dtype)


def test_async_matches_sync():
    sync = run_ranks(_run_steps, 3, [4099], 2048, 5, torch.float32, False)
    asyn = run_ranks(_run_steps, 3, [4099], 2048, 5, torch.float32, True)
    for r in range(3):
        for a, b in zip(sync[r][4099][0], asyn[r][4099][0]):
            assert torch.equal(a, b)


def _run_pieces(rank, p, n0, block, pieces, steps):
    """The same inputs through a state cut into pieces and one that is not; sync, in
    place, async and half inputs; then a non-finite value in the last piece only."""
    whole = lbcomm.CompressionState(n0, block_size=block, pieces=1)
    cut = lbcomm.CompressionState(n0, block_size=block, pieces=pieces)
    outs = []
    for t in range(steps):
        x = _inputs(rank, t, n0, torch.float16 if t == 3 else torch.float32)
        a = lbcomm.compressed_allreduce(x, whole, out=torch.empty_like(x))
        if t % 3 == 0:
            b = lbcomm.compressed_allreduce(x, cut, out=torch.empty_like(x))
        elif t % 3 == 1:
            b = x.clone()
            lbcomm.compressed_allreduce(b, cut, out=b)
        else:
            b = lbcomm.compressed_allreduce_(x.clone(), cut, async_op=True).wait()
        outs.append((a, b))
    errors = [(whole.worker_error.clone(), cut.worker_error.clone()),
              (whole.server_error.clone(), cut.server_error.clone())]
    skip = lbcomm.CompressionState(n0, block_size=block, pieces=pieces, nonfinite="skip")
    lbcomm.compressed_allreduce_(_inputs(rank, 0, n0), skip)
    before = (skip.worker_error.clone(), skip.server_error.clone())
    x = _inputs(rank, 1, n0)
    if rank == p - 1:
        x[-1] = float("nan")
    kept = x.clone()
    lbcomm.compressed_allreduce(x, skip, out=x)
    untouched = torch.equal(x[:-1], kept[:-1]) and skip.last_skipped
    untouched = untouched and torch.equal(before[0], skip.worker_error) and torch.equal(before[1], skip.server_error)
    return outs, errors, [hi - lo for lo, hi in cut.piece_spans], cut.bytes_per_call() - whole.bytes_per_call(), untouched


@pytest.mark.parametrize("p,n0,block,pieces,lengths", [
    (3, 4099, 64, 3, [512, 512, 352]),
    (4, 10000, 256, 2, [1280, 1248]),
    (2, 4000, 2048, 7, [2016]),  # a chunk of one block stays whole
])
def test_pieces_are_bitwise_the_whole(p, n0, block, pieces, lengths):
    for outs, errors, got, extra, untouched in run_ranks(_run_pieces, p, n0, block, pieces, 8):
        for t, (a, b) in enumerate(outs):
            assert torch.equal(a, b), t
        for a, b in errors:
            assert torch.equal(a, b)
        assert got == lengths
        assert extra == 2 * (p - 1) * (len(lengths) - 1) * 24  # a header per extra piece
        assert untouched, "a skipped call must leave out and the errors alone"


def _run_weights(rank, p, n0, steps):
    """Per-coordinate weights (the same on every rank) fused into the call, next to a twin
    state fed x / w and multiplied by w afterwards; whole and cut states, in place, out=,
    a callable source and a half sink; fp32 and bf16 weights."""
    w32 = torch.exp(torch.randn(n0, generator=torch.Generator().manual_seed(7)))
    got = {}
    for block, pieces, wdt in ((None, 1, torch.float32), (64, 1, torch.float32), (64, 3, torch.float32),
                               (64, 3, torch.bfloat16), (None, 1, torch.bfloat16)):
        w = w32.to(wdt)
        fused = lbcomm.CompressionState(n0, block_size=block, pieces=pieces)
        twin = lbcomm.CompressionState(n0, block_size=block, pieces=pieces)
        outs = []
        for t in range(steps):
            x = _inputs(rank, t, n0)
            if t % 3 == 0:
                out = x.clone()
                lbcomm.compressed_allreduce_(out, fused, weights=w)
            elif t % 3 == 1:
                out = lbcomm.compressed_allreduce(x, fused, out=torch.empty_like(x), weights=w)
            else:
                def source(lo, hi, buf, x=x):
                    buf.copy_(x[lo:hi])
                half = torch.empty(n0, dtype=torch.bfloat16)
                assert reduce_(fused, source, half, checked=True, weights=w) is True
                out = half
            old = x / w.float()
            lbcomm.compressed_allreduce_(old, twin)
            old.mul_(w.float())
            outs.append((out.clone(), old.to(out.dtype)))
        same_errors = torch.equal(fused.worker_error, twin.worker_error) and \
            torch.equal(fused.server_error, twin.server_error)
        got[(block, pieces, wdt)] = (outs, same_errors)
    return got


@pytest.mark.parametrize("p,n0", [(2, 1000), (3, 4099)])
def test_weights_fused_match_reference_and_divide_multiply(p, n0):
    steps = 6
    results = run_ranks(_run_weights, p, n0, steps)
    w32 = torch.exp(torch.randn(n0, generator=torch.Generator().manual_seed(7)))
    for (block, pieces, wdt), (outs, same_errors) in results[0].items():
        w = w32.to(wdt)
        assert same_errors, "the errors must be those of dividing first"
        m = R.chunk_size(n0, p)
        we, se = [torch.zeros(p, m) for _ in range(p)], [torch.zeros(m) for _ in range(p)]
        for t, (fused, old) in enumerate(outs):
            assert torch.equal(fused, old), (block, pieces, t)  # bitwise: divide, reduce, multiply
            for r in range(1, p):
                assert torch.equal(results[r][(block, pieces, wdt)][0][t][0], fused)
            ref, we, se = R.compressed_allreduce([_inputs(r, t, n0) for r in range(p)], we, se, block, w)
            assert torch.equal(fused, ref.to(fused.dtype)), (block, pieces, t)


def test_bad_weights_are_refused():
    state = lbcomm.CompressionState(10)
    with pytest.raises(ValueError, match="weights must be a float32 or bfloat16 tensor of 10 elements"):
        lbcomm.compressed_allreduce_(torch.ones(10), state, weights=torch.ones(9))
    with pytest.raises(ValueError, match="got torch.float16"):
        lbcomm.compressed_allreduce_(torch.ones(10), state, weights=torch.ones(10, dtype=torch.float16))


def _caps(n0):
    """Caps of the capped decode, the same on every rank: around the inputs' magnitudes,
    some +inf (no bound)."""
    g = torch.Generator().manual_seed(11)
    c = torch.exp(torch.randn(n0, generator=g)) * 0.7
    c[torch.rand(n0, generator=g) < 0.25] = float("inf")
    return c


def _run_capped(rank, p, n0, steps):
    """The capped decode through reduce_: whole and cut states, tensor and callable
    source/sink; every call's result and the errors after the last."""
    cap = _caps(n0)
    got = {}
    for pieces in (1, 3):
        st = lbcomm.CompressionState(n0, block_size=64, pieces=pieces)
        outs = []
        for t in range(steps):
            x = _inputs(rank, t, n0)
            if t % 2:
                out = torch.empty(n0)
                assert st.reduce_(x, out, cap=cap) is True
            else:
                out = torch.empty(n0, dtype=torch.bfloat16)  # a half sink goes range by range

                def source(lo, hi, buf, x=x):
                    buf.copy_(x[lo:hi])
                assert st.reduce_(source, out, checked=True, cap=cap) is True
                out = out.float()
            outs.append(out)
        got[pieces] = (outs, st.worker_error.clone(), st.server_error.clone())
    return got


@pytest.mark.parametrize("p,n0", [(2, 1000), (3, 4099)])
def test_capped_decode_matches_reference_and_bounds_every_value(p, n0):
    """Bitwise the reference on every rank; no result above its cap; the errors: what the
    cap held back, within 3 caps (flat error feedback invariant with the clamp)."""
    steps = 6
    results = run_ranks(_run_capped, p, n0, steps)
    cap = _caps(n0)
    m = R.chunk_size(n0, p)
    for pieces in (1, 3):
        we, se = [torch.zeros(p, m) for _ in range(p)], [torch.zeros(m) for _ in range(p)]
        for t in range(steps):
            ref, we, se = R.compressed_allreduce([_inputs(r, t, n0) for r in range(p)], we, se, 64, cap=cap)
            for r in range(p):
                got = results[r][pieces][0][t]
                want = ref if t % 2 else ref.to(torch.bfloat16).float()
                assert torch.equal(got, want), (pieces, t, r)
            assert torch.all(ref.abs() <= cap)
        for r in range(p):
            assert torch.equal(results[r][pieces][1].view(-1), we[r].view(-1))
            assert torch.equal(results[r][pieces][2], se[r])
            assert torch.all(we[r].view(-1)[:n0].abs() <= 3 * cap)
            bound = torch.cat([cap, torch.full((p * m - n0,), float("inf"))])[r * m:(r + 1) * m]
            assert torch.all(se[r].abs() <= 3 * bound)
    # the cap binds: the same inputs without it give other results
    plain, _, _ = R.compressed_allreduce([_inputs(r, 0, n0) for r in range(p)], [torch.zeros(p, m)] * p,
                                         [torch.zeros(m)] * p, 64)
    assert not torch.equal(plain, results[0][1][0][0])


def test_bad_caps_are_refused():
    state = lbcomm.CompressionState(10, block_size=64)
    with pytest.raises(ValueError, match="cap must be a float32 tensor of 10 elements"):
        state.reduce_(torch.ones(10), torch.empty(10), cap=torch.ones(9))
    with pytest.raises(ValueError, match="needs blocks"):
        lbcomm.CompressionState(10, block_size=None).reduce_(torch.ones(10), torch.empty(10), cap=torch.ones(10))
    with pytest.raises(ValueError, match="cannot be combined"):
        state.reduce_(torch.ones(10), torch.empty(10), cap=torch.ones(10), weights=torch.ones(10))


def _auto_pieces(rank, p):
    return [len(lbcomm.CompressionState(n, block_size=b).piece_spans)
            for n, b in ((1000, 2048), (p * PIECE_MIN, 2048), (3 * p * PIECE_MIN, 2048),
                         (64 * p * PIECE_MIN, 2048), (64 * p * PIECE_MIN, None))]


def test_automatic_pieces():
    assert run_ranks(_auto_pieces, 2)[0] == [1, 1, 3, 4, 1]


def _nonfinite_ranks(rank, p, policy):
    state = lbcomm.CompressionState(300, block_size=64, nonfinite=policy)
    lbcomm.compressed_allreduce_(torch.randn(300), state)
    before = (state.worker_error.clone(), state.server_error.clone())
    x = torch.randn(300)
    if rank == 1:
        x[123] = float("inf")
    outcome = "ok"
    try:
        out = torch.full_like(x, float("nan"))  # a skipped call leaves its output alone
        lbcomm.compressed_allreduce(x, state, out=out)
        outcome = "nan" if torch.isnan(out).all() else "values"
    except lbcomm.NonFiniteError:
        outcome = "raised"
    same = torch.equal(before[0], state.worker_error) and torch.equal(before[1], state.server_error)
    # the state keeps working afterwards
    lbcomm.compressed_allreduce_(torch.randn(300), state)
    return outcome, same, state.last_skipped, state.skipped


@pytest.mark.parametrize("policy,expected", [("raise", "raised"), ("skip", "nan")])
def test_nonfinite_is_seen_by_every_rank_and_errors_stay(policy, expected):
    for outcome, same, last_skipped, skipped in run_ranks(_nonfinite_ranks, 3, policy):
        assert outcome == expected
        assert same, "error buffers changed by a non-finite call"
        assert not last_skipped and skipped == 1


def test_world_size_one_returns_input():
    x = torch.randn(10)
    state = lbcomm.CompressionState(10)
    assert lbcomm.compressed_allreduce_(x, state) is x
    assert lbcomm.compressed_allreduce_(x, state, async_op=True).wait() is x
    out = torch.empty_like(x)
    assert lbcomm.compressed_allreduce(x, state, out=out) is out and torch.equal(out, x)
    assert torch.count_nonzero(state.worker_error) == 0


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda s: lbcomm.compressed_allreduce_(torch.arange(10), s), TypeError, "float32/float16/bfloat16"),
        (lambda s: lbcomm.compressed_allreduce_(torch.randn(11), s), ValueError, "11 elements"),
        (lambda s: lbcomm.compressed_allreduce_(torch.randn(10, device="meta"), s), ValueError, "meta"),
        (lambda s: lbcomm.compressed_allreduce_(torch.randn(10), object()), TypeError, "CompressionState"),
        (lambda s: lbcomm.compressed_allreduce(torch.randn(10), s, out=torch.randn(11)), ValueError, "11 elements"),
        (lambda s: lbcomm.compressed_allreduce(torch.randn(10), s), TypeError, "out"),
        (lambda s: lbcomm.CompressionState(10, block_size=100), ValueError, "block_size"),
        (lambda s: lbcomm.CompressionState(-1), ValueError, "numel"),
        (lambda s: lbcomm.CompressionState(10, nonfinite="ignore"), ValueError, "nonfinite"),
        (lambda s: lbcomm.CompressionState(10, pieces=0), ValueError, "pieces"),
        (lambda s: lbcomm.CompressionState(10, block_size=None, pieces=2), ValueError, "block scales"),
    ],
)
def test_bad_input_is_refused_clearly(make, exc, match):
    with pytest.raises(exc, match=match):
        make(lbcomm.CompressionState(10))


def _checkpoint_ranks(rank, p):
    a = lbcomm.CompressionState(500, block_size=64)
    for t in range(3):
        lbcomm.compressed_allreduce_(_inputs(rank, t, 500), a)
    sd = a.state_dict()
    b = lbcomm.CompressionState(500, block_size=64)
    assert b.load_state_dict(sd)
    outs = [(lbcomm.compressed_allreduce_(_inputs(rank, t, 500), a),
             lbcomm.compressed_allreduce_(_inputs(rank, t, 500), b)) for t in range(3, 6)]
    return all(torch.equal(x, y) for x, y in outs)


def test_state_dict_resumes_bitwise():
    assert all(run_ranks(_checkpoint_ranks, 3))


def test_state_dict_of_another_layout_resets_with_warning(caplog):
    a = lbcomm.CompressionState(100)
    sd = a.state_dict()
    other = dict(sd, numel=99, worker_error=torch.ones(99))  # another tensor: warned at once
    with caplog.at_level("WARNING"):
        assert not a.load_state_dict(other)
    assert "resetting" in caplog.text
    assert torch.count_nonzero(a.worker_error) == 0
    caplog.clear()
    # another world size: logged at INFO (a redistributed load may follow, as the callbacks
    # do after the framework's own load), warned at the next call if none did
    elastic = dict(sd, world_size=4, worker_error=torch.ones(4 * 32))
    with caplog.at_level("INFO"):
        assert not a.load_state_dict(elastic)
    assert [r.levelname for r in caplog.records if "resetting" in r.getMessage()] == ["INFO"]
    caplog.clear()
    with caplog.at_level("WARNING"):
        lbcomm.compressed_allreduce_(torch.ones(100), a)
    assert "resetting" in caplog.text and "redistributes them exactly" in caplog.text
