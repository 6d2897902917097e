"""lbcomm.wire, the in-place entry point, the deprecated allocating form, the finiteness
agreement, the overflow reset and reduce_ with callable sources and sinks."""
import warnings

import pytest
import torch

import lbcomm
from lbcomm.testing import kernels as R
from lbcomm import wire
from lbcomm.compressed import reduce_
from dist_util import run_ranks


# ------------------------------------------------------------------ wire
def test_layout_math_is_shared_with_the_reference():
    assert R.ALIGN is wire.ALIGN and R.chunk_size is wire.chunk_size and R.num_blocks is wire.num_blocks
    assert wire.chunk_size(1000, 3) == 352 and wire.padded_numel(1000, 3) == 1056
    assert wire.chunk_size(0, 4) == 0 and wire.chunk_size(1, 1) == 32
    assert wire.num_blocks(352, 64) == 6 and wire.num_blocks(352, None) == 1


@pytest.mark.parametrize("bad", [0, -32, 100, 32.0, True, "64"])
def test_check_block_size_refuses(bad):
    with pytest.raises(ValueError, match="block_size"):
        wire.check_block_size(bad)
    wire.check_block_size(None)
    wire.check_block_size(64)


def test_piece_spans_and_block_ranges():
    assert wire.piece_spans(1376, 64, 3) == [(0, 512), (512, 1024), (1024, 1376)]
    assert wire.piece_spans(2016, 2048, 7) == [(0, 2016)]  # one block: one piece
    assert wire.piece_spans(4096, None, 4) == [(0, 4096)]
    assert wire.block_ranges(512, 1376, 64, 200) == [(512, 704), (704, 896), (896, 1088), (1088, 1280), (1280, 1376)]
    assert wire.block_ranges(0, 100, 64, 10) == [(0, 64), (64, 100)]  # at least one block per range
    assert wire.block_ranges(0, 96, None, 40) == [(0, 32), (32, 64), (64, 96)]
    assert wire.block_ranges(5, 5, 64, 64) == []


def test_row_layout_and_headers():
    layout = wire.row_layout(4096, 2048)
    assert layout == wire.RowLayout(512, 520, 544)
    assert wire.row_layout(4096, None).scales_end == 516
    head = wire.encode_header(2**33 + 5, 7, None, 1, 3)
    rows = torch.zeros(2, 40, dtype=torch.uint8)
    rows[:, -wire.HEADER_BYTES:] = head.view(torch.uint8)
    wire.check_headers(rows, head, "unused")  # all equal: no error
    rows[1, -wire.HEADER_BYTES:] = wire.encode_header(2**33 + 5, 8, None, 1, 3).view(torch.uint8)
    with pytest.raises(ValueError, match=r"out of step .*rank 1: numel=8589934597 call=8.*; the consequence"):
        wire.check_headers(rows, head, "the consequence")


def test_agreement_vector():
    a = wire.agreement_vector(wire.encode_header(100, 3, 64, 0, 1), False)
    b = wire.agreement_vector(wire.encode_header(100, 3, 64, 0, 1), True)
    assert not wire.read_agreement(torch.maximum(a, a), "x")
    assert wire.read_agreement(torch.maximum(a, b), "x")
    c = wire.agreement_vector(wire.encode_header(100, 4, 64, 0, 1), False)
    with pytest.raises(ValueError, match="out of step .*call from 3 to 4.*; errors kept"):
        wire.read_agreement(torch.maximum(a, c), "errors kept")


# ------------------------------------------------------------------ entry points, one rank
def test_in_place_entry_and_out_form():
    state = lbcomm.CompressionState(10)
    x = torch.randn(10)
    kept = x.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fast path and out= never warn
        assert lbcomm.compressed_allreduce_(x, state) is x
        assert lbcomm.compressed_allreduce_(x, state, async_op=True).wait() is x
        out = torch.empty(10)
        assert lbcomm.compressed_allreduce(x, state, out=out) is out
    assert torch.equal(x, kept) and torch.equal(out, kept)
    with pytest.raises(TypeError, match="out"):  # the allocating form is gone: out is required
        lbcomm.compressed_allreduce(x, state)
    assert state.piece_spans == [(0, 32)] and not hasattr(state, "pieces")


def test_reduce_one_rank_copies_through_callables():
    state = lbcomm.CompressionState(1000, block_size=64)
    x = torch.randn(1000)
    got = torch.zeros(1000)
    assert reduce_(state, lambda lo, hi, buf: buf.copy_(x[lo:hi]), lambda lo, hi, v: got[lo:hi].copy_(v),
                   checked=True) is True
    assert torch.equal(got, x)
    half = torch.zeros(1000, dtype=torch.float16)
    assert reduce_(state, x, half, async_op=True).wait() is True
    assert torch.equal(half, x.half())


def test_reduce_refuses_unchecked_callable_and_bad_arguments():
    state = lbcomm.CompressionState(10)
    with pytest.raises(ValueError, match="checked=True"):
        reduce_(state, lambda lo, hi, buf: None, torch.empty(10))
    with pytest.raises(TypeError, match="callable sink"):
        reduce_(state, torch.randn(10), 3)
    with pytest.raises(ValueError, match="the output has 9 elements"):
        reduce_(state, torch.randn(10), torch.empty(9))


# ------------------------------------------------------------------ source / sink vs tensors
def _inputs(rank, t, n0):
    g = torch.Generator().manual_seed(31 * t + rank)
    return torch.randn(n0, generator=g) * (1 + rank)


def _source_sink_ranks(rank, p, n0, steps):
    import lbcomm.reduce.buffers as C  # STAGING_MIN lives there since 0.3

    C.STAGING_MIN = 64  # many small ranges: whole blocks at a time
    results = []
    for block in (None, 64, 2048):
        for pieces in ((1,) if block is None else (1, 3)):
            ref = lbcomm.CompressionState(n0, block_size=block, pieces=pieces)
            cut = lbcomm.CompressionState(n0, block_size=block, pieces=pieces)
            same, ranges_ok = True, True
            for t in range(steps):
                x = _inputs(rank, t, n0)
                want = x.clone()
                assert lbcomm.compressed_allreduce_(want, ref) is want
                got = torch.full((n0,), float("nan"))
                seen_in, seen_out = [], []

                def source(lo, hi, buf):
                    seen_in.append((lo, hi))
                    buf.copy_(x[lo:hi])

                def sink(lo, hi, values):
                    seen_out.append((lo, hi))
                    got[lo:hi] = values

                applied = reduce_(cut, source, sink, checked=True, async_op=bool(t % 2))
                applied = applied.wait() if t % 2 else applied
                same = same and applied is True and torch.equal(got, want)
                for seen, bound in ((seen_in, n0 if block is None else cut._staging_cap), (seen_out, cut._staging_cap)):
                    covered = sorted(seen)
                    ranges_ok = ranges_ok and sum(hi - lo for lo, hi in covered) == n0
                    ranges_ok = ranges_ok and all(hi - lo <= bound for lo, hi in covered)
                    ranges_ok = ranges_ok and all(a[1] <= b[0] for a, b in zip(covered, covered[1:]))
            same = same and torch.equal(ref.worker_error, cut.worker_error)
            same = same and torch.equal(ref.server_error, cut.server_error)
            results.append((block, pieces, same, ranges_ok))
    return results


@pytest.mark.parametrize("p,n0", [(2, 4099), (3, 5003), (4, 10007)])
def test_callable_source_and_sink_are_bitwise_the_tensor_path(p, n0):
    for per_rank in run_ranks(_source_sink_ranks, p, n0, 3):
        for block, pieces, same, ranges_ok in per_rank:
            assert same, (block, pieces)
            assert ranges_ok, (block, pieces)


# ------------------------------------------------------------------ non-finite agreement
def _nan_one_rank(rank, p, policy):
    state = lbcomm.CompressionState(700, block_size=64, pieces=2, nonfinite=policy)
    lbcomm.compressed_allreduce_(_inputs(rank, 0, 700), state)
    before = state.worker_error.clone(), state.server_error.clone()
    outcomes = []
    for entry in ("in_place", "reduce_sink"):
        x = _inputs(rank, 1, 700)
        if rank == p - 1:
            x[650] = float("nan")
        kept = x.clone()
        called = []
        try:
            if entry == "in_place":
                ok = lbcomm.compressed_allreduce_(x, state) is x and not state.last_skipped
            else:
                ok = reduce_(state, x, lambda lo, hi, v: called.append(lo))
            outcome = "applied" if ok else "skipped"
        except lbcomm.NonFiniteError as exc:
            outcome = "raised: " + str(exc)
        untouched = torch.equal(x, kept) if rank != p - 1 else torch.equal(x[:650], kept[:650])
        same = torch.equal(before[0], state.worker_error) and torch.equal(before[1], state.server_error)
        outcomes.append((outcome, untouched and not called, same, state.last_skipped))
    lbcomm.compressed_allreduce_(_inputs(rank, 2, 700), state)  # keeps working afterwards
    return outcomes, state.skipped, state.calls


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nan_on_one_rank_is_agreed_before_any_error_changes(policy):
    for outcomes, skipped, calls in run_ranks(_nan_one_rank, 3, policy):
        for outcome, untouched, same, last_skipped in outcomes:
            if policy == "skip":
                assert outcome == "skipped"
            else:
                assert outcome.startswith("raised") and "unchanged" in outcome
            assert untouched, "a skipped call must leave the tensor alone and never call the sink"
            assert same, "error buffers changed by a non-finite call"
            assert last_skipped
        assert skipped == 2 and calls == 4


def _overflow(rank, p, policy):
    state = lbcomm.CompressionState(300, block_size=64, nonfinite=policy)
    lbcomm.compressed_allreduce_(_inputs(rank, 0, 300), state)
    nonzero = bool(state.worker_error.abs().sum() > 0)
    x = torch.full((300,), 3e38)  # finite everywhere; the server's sum of p such values is not
    kept = x.clone()
    try:
        lbcomm.compressed_allreduce_(x, state)
        outcome = "skipped" if state.last_skipped else "applied"
    except lbcomm.NonFiniteError as exc:
        outcome = "raised: " + str(exc)
    reset = not bool(state.worker_error.any()) and not bool(state.server_error.any())
    untouched = torch.equal(x, kept)
    y = _inputs(rank, 1, 300)
    lbcomm.compressed_allreduce_(y, state)  # keeps working from zero errors
    return outcome, nonzero, reset, untouched, bool(torch.isfinite(y).all())


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_overflow_of_finite_inputs_resets_the_errors_on_every_rank(policy):
    for outcome, nonzero, reset, untouched, finite in run_ranks(_overflow, 3, policy):
        if policy == "skip":
            assert outcome == "skipped"
        else:
            assert outcome.startswith("raised") and "reset to zero" in outcome
        assert nonzero and reset and untouched and finite


# ------------------------------------------------------------------ make_reducer / resolve_topology
def test_make_reducer_builds_the_flat_reducer_from_comm():
    from lbcomm.config import CommConfig
    from lbcomm.reducer import Reducer, make_reducer, resolve_topology

    comm = CommConfig(block_size=64, nonfinite="raise", topology="flat")
    assert resolve_topology(comm) is None and resolve_topology(CommConfig()) is None  # one node
    r = make_reducer(100, comm, device="cpu")
    assert isinstance(r, lbcomm.CompressionState) and isinstance(r, Reducer)
    assert (r.numel, r.block_size, r.nonfinite, r.device) == (100, 64, "raise", torch.device("cpu"))
    d = make_reducer(10)  # CommConfig() defaults
    assert (d.block_size, d.nonfinite) == (lbcomm.config.DEFAULT_BLOCK_SIZE, "skip")
    x = torch.randn(10)
    assert d.reduce_(x, x) is True
    with pytest.raises(TypeError, match="resolve_topology"):
        make_reducer(10, comm, topology="auto")
    with pytest.raises(TypeError, match="CommConfig"):
        make_reducer(10, {"block_size": 64})
