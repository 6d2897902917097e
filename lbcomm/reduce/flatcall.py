"""One flat compressed allreduce, `FlatCall`: its validation, its collective schedule and
its phases (the call behind `lbcomm.reduce.compressed.reduce_`). The state it works on is
`lbcomm.reduce.compression.CompressionState`, through its public API only: the errors
(`worker_error_rows`, `server_error`), the counters (`count`), `in_flight`, and its
buffers (`state.buffers`, `lbcomm.reduce.buffers.FlatBuffers`).

Per call and rank:

    agree    all_reduce(max) of a small vector    every rank's input finite? same call?
    phase 0  worker_compress(x, e)            -> signs + block scales of x + e; e updated in place
    phase 1  all-to-all                          rank k receives chunk k from every rank
    phase 2  server_compress(chunks, s)       -> signs + block scales of the chunk mean + s; s in place
    phase 3  all-gather                          every rank receives every server chunk
    decode   unpack                            -> approximate mean, bitwise equal on all ranks

One schedule: the collective order of a call is written once (`FlatCall.steps`, a
generator that yields each future it must wait for); `lbcomm.common.drive` waits on them
in turn, or resumes the generator from each future's callback (async_op). Every rank
issues the same collectives in the same order either way. The hierarchical call runs a
flat call's steps inside its own schedule (`lbcomm.reduce.hiercall`).

Pipelining: with block scales, every block is independent, so each chunk is cut into
pieces (runs of whole blocks, `CompressionState.piece_spans`) and the phases run piece by
piece: piece s+1 is compressed while piece s crosses the network, and the server reduces
piece s while later pieces travel. Results are bitwise those of one piece (tests check it);
a call then costs 2 x pieces collectives.

Wire rows (`lbcomm.reduce.wire`): a piece's sign bytes, its fp32 block scales, then a 24-byte
header (numel, call count, block size, piece, pieces), so every rank sees every other
rank's header in the all-to-all. Different row lengths would abort the process inside
gloo, so each state first checks the layout once with a fixed-size all-gather (its first
call).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Generator, List, Optional

import torch
from torch import Tensor

from .. import ops
from ..common import NonFiniteError
from .buffers import WireBuffers
from .inputs import Cap, ComputedCaps, Sink, Source, check_cap, check_tensor, check_weights, result_caps
from .wire import agreement_vector, block_ranges, check_headers, encode_header, num_blocks, read_agreement

# The argument types and checks live in lbcomm.reduce.inputs; re-exported here for the 0.2 imports.
__all__ = ["FlatCall", "check_tensor", "check_weights", "check_cap", "ComputedCaps", "Source", "Sink", "Cap"]

_log = logging.getLogger("lbcomm.flatcall")  # the 0.2 logger name, kept for users' logging settings


class FlatCall:
    """One compressed allreduce: validation, the schedule and the phases."""

    def __init__(self, name: str, state, source: Source, sink: Sink, checked: bool,
                 result: Callable[[bool], Any], weights: Optional[Tensor] = None, cap: Optional[Cap] = None):
        self.name, self.state, self.checked, self.result = name, state, bool(checked), result
        kind = type(state).__name__
        if isinstance(source, Tensor):
            check_tensor(name, source, state.numel, state.device, "the tensor", kind)
        elif not callable(source):
            raise TypeError(f"{name}: expected a tensor or a callable source(lo, hi, buf), got {type(source).__name__}")
        elif not checked:
            raise ValueError(f"{name}: a callable source cannot be checked for NaN/Inf before the call; agree on "
                             "finiteness with the other ranks first and pass checked=True, or pass a tensor")
        if isinstance(sink, Tensor):
            check_tensor(name, sink, state.numel, state.device, "the output", kind)
        elif not callable(sink):
            raise TypeError(f"{name}: expected a tensor or a callable sink(lo, hi, values), got {type(sink).__name__}")
        weights = check_weights(name, weights, state.numel, state.device)
        cap = check_cap(name, cap, state.numel, state.device, state.block_size, weights)
        state.ensure_idle()
        self.source, self.sink, self.weights, self.cap = source, sink, weights, cap
        # computed caps: every phase runs range by range (whole blocks, the staging size),
        # except caps the kernels compute themselves: sliced like a tensor
        self.computed = isinstance(cap, ComputedCaps) and not ops.kernel_computes_caps(cap, state.device)
        self.flat_source: Optional[Tensor] = None  # the tensor source as one flat view (made on first use)
        self.buffers = state.buffers  # the state's wire rows and staging (lbcomm.reduce.buffers)
        self.wire: List[WireBuffers] = []  # the wire rows, once the call reaches phase 0

    # ---------------------------------------------------------------- schedule
    def steps(self) -> Generator[torch.futures.Future, None, Any]:
        """The collective order of a call, once: yields each future the call must wait for
        and returns `result(applied)`."""
        st, tr = self.state, self.state.transport
        deferred = st.pop_load_warning()
        if deferred is not None:  # no rank-own shard followed the foreign one
            _log.warning("%s", deferred)
        if st.world_size == 1 or st.numel == 0:  # nothing to communicate: the result is the input
            self._copy_through()
            return self.result(True)
        with st.in_flight():
            if not st.verified:
                yield from self._handshake()
            if not self.checked:
                vec = agreement_vector(self._header(0), not self._input_finite()).to(st.device)
                fut = tr.all_reduce(vec, "max", async_op=True)
                yield fut
                fut.value()
                if read_agreement(vec, "the error buffers are unchanged"):
                    return self.result(self._conclude(False, errors_changed=False))
            wire = self.wire = st.wire_buffers()
            count = len(st.piece_spans)
            # The all-to-alls of all pieces (each as soon as its piece is compressed), then
            # the all-gathers in piece order (each as soon as its all-to-all has arrived).
            sent = [tr.all_to_all(wire[s].recv, self._compress_piece(s), async_op=True) for s in range(count)]
            gathered = []
            for s in range(count):
                yield sent[s]
                sent[s].value()
                gathered.append(tr.all_gather(wire[s].gathered, self._serve_piece(s), async_op=True))
            for fut in gathered:
                yield fut
                fut.value()
            # Every rank holds every server scale now, so all reach the same verdict.
            finite = all(bool(torch.isfinite(self.buffers.scales(w.gathered, s)).all()) for s, w in enumerate(wire))
            if not self._conclude(finite, errors_changed=True):
                return self.result(False)
            st.record_sent()
            self._decode()
            return self.result(True)

    def _handshake(self):
        """Once per state: every rank's layout, compared before any variable-size collective."""
        st = self.state
        mine = torch.tensor([st.numel, st.block_size or 0, st.chunk, st.calls, len(st.piece_spans)],
                            dtype=torch.int64)
        k = mine.numel()
        everyone = torch.empty(st.world_size * k, dtype=torch.int64, device=st.device)
        local = mine.to(st.device)
        fut = st.transport.all_gather(everyone.view(torch.uint8), local.view(torch.uint8), async_op=True)
        yield fut
        fut.value()
        rows = everyone.view(st.world_size, k).cpu()
        if not bool((rows == mine).all()):
            desc = ", ".join(f"rank {r}: numel={int(v[0])} block_size={int(v[1]) or None} calls={int(v[3])} "
                             f"pieces={int(v[4])}" for r, v in enumerate(rows))
            raise ValueError("compressed_allreduce: ranks called with different tensors or state layouts "
                             f"({desc}); every rank must reduce the same sizes in the same order")
        st.verified = True

    def _header(self, piece: int) -> Tensor:
        st = self.state
        return encode_header(st.numel, st.calls, st.block_size, piece, len(st.piece_spans))

    def _input_finite(self) -> bool:
        """Whether this rank's (tensor) input is all finite: one cheap pass (the sum is
        finite only if every element is), the exact check only when the sum is not (an
        overflowing sum of finite values must not skip a call)."""
        if bool(torch.isfinite(self.source.sum(dtype=torch.float32))):
            return True
        return bool(torch.isfinite(self.source).all())

    def _conclude(self, finite: bool, *, errors_changed: bool) -> bool:
        """Count the call; for a non-finite verdict reset the errors if they changed, then
        raise or return False per the state's policy. Every rank reaches the same verdict."""
        st = self.state
        st.count(skipped=not finite)
        if finite:
            return True
        if errors_changed:
            st.reset()
            what = ("a block scale overflowed to Inf/NaN although every rank's input was checked finite: x + error "
                    "or the server's sum went beyond the float32 range (|values| near 3e38), or an input was not "
                    "finite under checked=True. The error feedback was reset to zero on every rank")
        else:
            what = "the input holds NaN or Inf on at least one rank (the error buffers are unchanged)"
        if st.nonfinite == "raise":
            raise NonFiniteError(f"{self.name}: {what}; check for overflow, or pass nonfinite='skip' to the "
                                 "CompressionState")
        _log.debug("%s: skipped: %s", self.name, what)
        return False

    # ---------------------------------------------------------------- phases
    def _input(self, lo: int, hi: int) -> Tensor:
        """Input elements [lo, hi): a view of a tensor source, or a callable source's
        values in the staging buffer."""
        if isinstance(self.source, Tensor):
            if self.flat_source is None:
                self.flat_source = self.source.reshape(-1)
            return self.flat_source[lo:hi]
        buf = self.buffers.staging(max(hi - lo, self.buffers.staging_cap))[:hi - lo]
        if hi > lo:
            self.source(lo, hi, buf)
        return buf

    def _caps(self, lo: int, hi: int) -> Optional[Tensor]:
        """The caps of input elements [lo, hi): a view of tensor caps, or computed caps in
        the state's cap staging buffer (reused by the next range)."""
        if self.cap is None:
            return None
        if self.computed:
            return self.cap.fill(lo, hi, self.buffers.cap_staging())
        return self.cap[lo:hi]

    def _compress_piece(self, s: int) -> Tensor:
        """Phase 0: worker compress of piece s of every chunk into its send rows, the
        worker error updated in place."""
        st = self.state
        send, layout = self.wire[s].send, self.buffers.layouts[s]
        lo, hi = st.piece_spans[s]
        q8, block, m, n0 = layout.sign_bytes, st.block_size, st.chunk, st.numel
        direct = isinstance(self.source, Tensor) and not self.computed  # no staging needed
        if len(st.piece_spans) == 1 and (block is None or direct):
            # one kernel call over every chunk (the only way with one scale for everything)
            packed, scales = ops.worker_compress(self._input(0, n0), st.worker_error_rows, block,
                                                 weights=self.weights, cap=self.cap)
            send[:, :q8].copy_(packed)
            self.buffers.scales(send, s).copy_(scales)
        else:
            span = hi - lo if direct else self.buffers.staging_cap
            for j in range(st.world_size):
                for a, b in block_ranges(lo, hi, block, span):
                    g0 = j * m + a
                    g1 = max(g0, min(j * m + b, n0))
                    w = None if self.weights is None else self.weights[g0:g1]
                    c = self._caps(g0, g1)
                    packed, scales = ops.worker_compress(self._input(g0, g1), st.worker_error_rows[j, a:b], block,
                                                         weights=w, cap=c)
                    send[j, (a - lo) // 8:(b - lo) // 8].copy_(packed)
                    first = (a - lo) // block
                    self.buffers.scales(send[j], s)[first:first + scales.numel()].copy_(scales)
        send[:, layout.scales_end:].copy_(self._header(s).view(torch.uint8))
        return send

    def _serve_piece(self, s: int) -> Tensor:
        """Phase 2: server reduce + compress of piece s of this rank's chunk into its
        all-gather row, the server error updated in place."""
        st = self.state
        wire, layout = self.wire[s], self.buffers.layouts[s]
        try:  # every rank sees every header: all raise, or none
            check_headers(wire.recv, self._header(s), "the error buffers were reset to zero on every rank")
        except ValueError:
            st.reset()  # phase 0 has already updated the worker error
            raise
        lo, hi = st.piece_spans[s]
        block, base = st.block_size, st.rank * st.chunk
        # computed caps: runs of whole blocks through the cap staging buffer (every block is
        # reduced on its own, so the result is that of one run)
        for a, b in block_ranges(lo, hi, block, self.buffers.staging_cap) if self.computed else [(lo, hi)]:
            real = min(max(st.numel - base - a, 0), b - a)
            first = (a - lo) // block if block else 0
            count = num_blocks(b - a, block)
            packed, scales = ops.server_compress(wire.recv[:, (a - lo) // 8:(b - lo) // 8],
                                                 self.buffers.scales(wire.recv, s)[:, first:first + count],
                                                 st.server_error[a:b], block, real,
                                                 cap=self._caps(base + a, base + a + real))
            wire.server_send[(a - lo) // 8:(b - lo) // 8].copy_(packed)
            self.buffers.scales(wire.server_send, s)[first:first + count].copy_(scales)
        wire.server_send[layout.scales_end:].copy_(self._header(s).view(torch.uint8))
        return wire.server_send

    def _decode(self) -> None:
        """Decode every server chunk into the sink: straight into a contiguous float32
        tensor, else range by range (whole blocks) through the staging buffer."""
        st, sink = self.state, self.sink
        block, m, n0 = st.block_size, st.chunk, st.numel
        whole, write, copy_back = self._sink_target()
        cap = result_caps(self.cap)
        computed = self.computed and cap is not None
        if whole is not None and len(st.piece_spans) == 1 and not computed:
            g = self.wire[0].gathered
            ops.unpack_into(g[:, :self.buffers.layouts[0].sign_bytes], self.buffers.scales(g, 0), block, whole,
                            weights=self.weights, cap=cap)
        else:
            for s, (lo, hi) in enumerate(st.piece_spans):
                g = self.wire[s].gathered
                for k in range(st.world_size):
                    span = hi - lo if write is None and not computed else self.buffers.staging_cap
                    for a, b in block_ranges(lo, hi, block, span):
                        g0, g1 = k * m + a, min(k * m + b, n0)
                        if g1 <= g0:
                            continue
                        first = (a - lo) // block if block else 0
                        count = -(-(b - a) // block) if block else 1
                        scales = self.buffers.scales(g[k:k + 1], s)[:, first:first + count]
                        staged = write is not None
                        out = self.buffers.staging(self.buffers.staging_cap)[:g1 - g0] if staged else whole[g0:g1]
                        w = None if self.weights is None else self.weights[g0:g1]
                        c = None if cap is None else self._caps(g0, g1)
                        ops.unpack_into(g[k:k + 1, (a - lo) // 8:(b - lo) // 8], scales, block, out, weights=w,
                                        cap=c)
                        if write is not None:
                            write(g0, g1, out)
        if copy_back:
            sink.copy_(whole.view(sink.shape))

    def _sink_target(self):
        """(whole, write, copy_back): a flat float32 tensor that takes the result directly
        (the sink itself, or a temporary for a non-contiguous sink, then copy_back), or a
        write(lo, hi, values) callback fed range by range (a callable or half sink)."""
        sink = self.sink
        if not isinstance(sink, Tensor):
            return None, sink, False
        if not sink.is_contiguous():
            return torch.empty(self.state.numel, dtype=torch.float32, device=self.state.device), None, True
        flat = sink.view(-1)
        if sink.dtype == torch.float32:
            return flat, None, False
        return None, lambda lo, hi, values: flat[lo:hi].copy_(values), False

    def _copy_through(self) -> None:
        """One rank (or nothing to reduce): the sink receives the input unchanged."""
        source, sink, st = self.source, self.sink, self.state
        if isinstance(source, Tensor) and isinstance(sink, Tensor):
            if sink is not source:
                sink.copy_(source.reshape(sink.shape))
            return
        whole, write, copy_back = self._sink_target()
        for lo, hi in block_ranges(0, st.numel, None, self.buffers.staging_cap):
            values = self._input(lo, hi)
            if write is None:
                whole[lo:hi].copy_(values)
                continue
            buf = self.buffers.staging(self.buffers.staging_cap)[:hi - lo]
            if buf.data_ptr() != values.data_ptr():
                buf.copy_(values)
            write(lo, hi, buf)
        if copy_back:
            sink.copy_(whole.view(sink.shape))
