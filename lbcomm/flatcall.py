"""One flat compressed allreduce: its validation, its collective schedule and its phases
(the call behind `lbcomm.compressed.reduce_`; the state it works on is
`lbcomm.compressed.CompressionState`).

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
flat call's steps inside its own schedule (`lbcomm.hierarchical`).

Pipelining: with block scales, every block is independent, so each chunk is cut into
pieces (runs of whole blocks, `CompressionState.piece_spans`) and the phases run piece by
piece: piece s+1 is compressed while piece s crosses the network, and the server reduces
piece s while later pieces travel. Results are bitwise those of one piece (tests check it);
a call then costs 2 x pieces collectives.

Wire rows (lbcomm.wire): a piece's sign bytes, its fp32 block scales, then a 24-byte
header (numel, call count, block size, piece, pieces), so every rank sees every other
rank's header in the all-to-all. Different row lengths would abort the process inside
gloo, so each state first checks the layout once with a fixed-size all-gather (its first
call).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Generator, Optional, Union

import torch
from torch import Tensor

from . import ops
from .common import FLOAT_DTYPES, NonFiniteError
from .wire import agreement_vector, block_ranges, check_headers, encode_header, num_blocks, read_agreement

__all__ = ["FlatCall", "check_tensor", "check_weights", "check_cap", "ComputedCaps", "Source", "Sink", "Cap"]

_log = logging.getLogger(__name__)

Source = Union[Tensor, Callable[[int, int, Tensor], Any]]
Sink = Union[Tensor, Callable[[int, int, Tensor], Any]]


class ComputedCaps:
    """Caps of the capped decode produced on demand: ``fill(lo, hi, buf)`` writes the fp32
    caps of input elements [lo, hi) into `buf` (hi - lo elements), as a callable source
    writes its values. The call asks for each range when it needs it, through the state's
    bounded staging buffer, so the caps of the whole input never exist at once. Sliced like a
    tensor: ``caps[lo:hi]`` are the caps of elements lo..hi-1 (a call on part of the input
    takes its part)."""

    __slots__ = ("fill_fn", "offset", "numel")

    def __init__(self, fill: Callable[[int, int, Tensor], Any], numel: int, offset: int = 0):
        self.fill_fn, self.numel, self.offset = fill, numel, offset

    def fill(self, lo: int, hi: int, buf: Tensor) -> Tensor:
        """The caps of elements [lo, hi) written into (and returned as) buf[:hi - lo]."""
        out = buf[:hi - lo]
        if hi > lo:
            self.fill_fn(self.offset + lo, self.offset + hi, out)
        return out

    def __getitem__(self, s: slice) -> "ComputedCaps":
        lo, hi, step = s.indices(self.numel)
        if step != 1:
            raise ValueError("ComputedCaps: only contiguous slices")
        return ComputedCaps(self.fill_fn, max(hi - lo, 0), self.offset + lo)


Cap = Union[Tensor, ComputedCaps, Callable[[int, int, Tensor], Any]]


def check_tensor(name: str, t: Tensor, numel: int, device: torch.device, what: str, kind: str) -> None:
    """The checks every entry point makes of an input or output tensor: a float dtype,
    the state's size and device (`kind` names the state class in the message)."""
    if not isinstance(t, Tensor) or t.dtype not in FLOAT_DTYPES:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{name}: expected a float32/float16/bfloat16 tensor, got {got} ({what})")
    if t.numel() != numel:
        raise ValueError(f"{name}: {what} has {t.numel()} elements but the state was built for {numel}; "
                         f"use one {kind} per tensor size")
    if t.device != device:
        raise ValueError(f"{name}: {what} is on {t.device} but the state's buffers are on "
                         f"{device}; build the state with device={t.device!s}")


def check_weights(name: str, weights: Optional[Tensor], numel: int, device: torch.device) -> Optional[Tensor]:
    """Per-coordinate weights (see `lbcomm.compressed.reduce_`), flat, or None."""
    if weights is None:
        return None
    if not isinstance(weights, Tensor) or weights.dtype not in (torch.float32, torch.bfloat16) \
            or weights.numel() != numel or weights.device != device:
        got = (f"{weights.dtype} {tuple(weights.shape)} on {weights.device}" if isinstance(weights, Tensor)
               else type(weights).__name__)
        raise ValueError(f"{name}: weights must be a float32 or bfloat16 tensor of {numel} elements on "
                         f"{device} (one per coordinate), got {got}")
    return weights.reshape(-1)


def check_cap(name: str, cap: Optional[Cap], numel: int, device: torch.device, block_size: Optional[int],
              weights: Optional[Tensor]) -> Union[None, Tensor, ComputedCaps]:
    """Per-coordinate caps of the capped decode (see `lbcomm.compressed.reduce_`): a flat
    tensor, a `ComputedCaps` (a callable cap(lo, hi, buf) is wrapped in one), or None."""
    if cap is None:
        return None
    if isinstance(cap, ComputedCaps) or (callable(cap) and not isinstance(cap, Tensor)):
        cap = cap if isinstance(cap, ComputedCaps) else ComputedCaps(cap, numel)
        if cap.numel != numel:
            raise ValueError(f"{name}: cap covers {cap.numel} elements, the state was built for {numel}")
    elif not isinstance(cap, Tensor) or cap.dtype != torch.float32 or cap.numel() != numel or cap.device != device:
        got = f"{cap.dtype} {tuple(cap.shape)} on {cap.device}" if isinstance(cap, Tensor) else type(cap).__name__
        raise ValueError(f"{name}: cap must be a float32 tensor of {numel} elements on {device}, or a callable "
                         f"cap(lo, hi, buf), got {got}")
    if block_size is None:
        raise ValueError(f"{name}: the capped decode needs blocks (this state has block_size=None: one scale)")
    if weights is not None:
        raise ValueError(f"{name}: cap and weights cannot be combined")
    return cap if isinstance(cap, ComputedCaps) else cap.reshape(-1)


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
        state._ensure_idle()
        self.source, self.sink, self.weights, self.cap = source, sink, weights, cap
        # computed caps: every phase runs range by range (whole blocks, the staging size)
        self.computed = isinstance(cap, ComputedCaps)
        self.flat_source: Optional[Tensor] = None  # the tensor source as one flat view (made on first use)

    # ---------------------------------------------------------------- schedule
    def steps(self) -> Generator[torch.futures.Future, None, Any]:
        """The collective order of a call, once: yields each future the call must wait for
        and returns `result(applied)`."""
        st, tr = self.state, self.state.transport
        if st._foreign_shard is not None:  # no rank-own shard followed the foreign one
            _log.warning("%s", st._foreign_shard)
            st._foreign_shard = None
        if st.world_size == 1 or st.numel == 0:  # nothing to communicate: the result is the input
            self._copy_through()
            return self.result(True)
        st._busy = True
        try:
            if not st._verified:
                yield from self._handshake()
            if not self.checked:
                vec = agreement_vector(self._header(0), not self._input_finite()).to(st.device)
                fut = tr.all_reduce(vec, "max", async_op=True)
                yield fut
                fut.value()
                if read_agreement(vec, "the error buffers are unchanged"):
                    return self.result(self._conclude(False, errors_changed=False))
            wire = st._wire_buffers()
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
            finite = all(bool(torch.isfinite(self._scales(w.gathered, s)).all()) for s, w in enumerate(wire))
            if not self._conclude(finite, errors_changed=True):
                return self.result(False)
            self._record_sent()
            self._decode()
            return self.result(True)
        finally:
            st._busy = False

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
        st._verified = True

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
        st.calls += 1
        st.last_skipped = not finite
        if finite:
            return True
        st.skipped += 1
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
        buf = self.state._staging_buffer(max(hi - lo, self.state._staging_cap))[:hi - lo]
        if hi > lo:
            self.source(lo, hi, buf)
        return buf

    def _caps(self, lo: int, hi: int) -> Optional[Tensor]:
        """The caps of input elements [lo, hi): a view of tensor caps, or computed caps in
        the state's cap staging buffer (reused by the next range)."""
        if self.cap is None:
            return None
        if self.computed:
            return self.cap.fill(lo, hi, self.state._cap_staging_buffer())
        return self.cap[lo:hi]

    def _scales(self, rows: Tensor, s: int) -> Tensor:
        layout = self.state._row_layouts[s]
        return rows[..., layout.sign_bytes:layout.scales_end].view(torch.float32)

    def _compress_piece(self, s: int) -> Tensor:
        """Phase 0: worker compress of piece s of every chunk into its send rows, the
        worker error updated in place."""
        st = self.state
        send, layout = st._wire[s].send, st._row_layouts[s]
        lo, hi = st.piece_spans[s]
        q8, block, m, n0 = layout.sign_bytes, st.block_size, st.chunk, st.numel
        direct = isinstance(self.source, Tensor) and not self.computed  # no staging needed
        if len(st.piece_spans) == 1 and (block is None or direct):
            # one kernel call over every chunk (the only way with one scale for everything)
            packed, scales = ops.worker_compress(self._input(0, n0), st._worker_error, block,
                                                 weights=self.weights, cap=self.cap)
            send[:, :q8].copy_(packed)
            self._scales(send, s).copy_(scales)
        else:
            span = hi - lo if direct else st._staging_cap
            for j in range(st.world_size):
                for a, b in block_ranges(lo, hi, block, span):
                    g0 = j * m + a
                    g1 = max(g0, min(j * m + b, n0))
                    w = None if self.weights is None else self.weights[g0:g1]
                    c = self._caps(g0, g1)
                    packed, scales = ops.worker_compress(self._input(g0, g1), st._worker_error[j, a:b], block,
                                                         weights=w, cap=c)
                    send[j, (a - lo) // 8:(b - lo) // 8].copy_(packed)
                    first = (a - lo) // block
                    self._scales(send[j], s)[first:first + scales.numel()].copy_(scales)
        send[:, layout.scales_end:].copy_(self._header(s).view(torch.uint8))
        return send

    def _serve_piece(self, s: int) -> Tensor:
        """Phase 2: server reduce + compress of piece s of this rank's chunk into its
        all-gather row, the server error updated in place."""
        st = self.state
        wire, layout = st._wire[s], st._row_layouts[s]
        try:  # every rank sees every header: all raise, or none
            check_headers(wire.recv, self._header(s), "the error buffers were reset to zero on every rank")
        except ValueError:
            st.reset()  # phase 0 has already updated the worker error
            raise
        lo, hi = st.piece_spans[s]
        block, base = st.block_size, st.rank * st.chunk
        # computed caps: runs of whole blocks through the cap staging buffer (every block is
        # reduced on its own, so the result is that of one run)
        for a, b in block_ranges(lo, hi, block, st._staging_cap) if self.computed else [(lo, hi)]:
            real = min(max(st.numel - base - a, 0), b - a)
            first = (a - lo) // block if block else 0
            count = num_blocks(b - a, block)
            packed, scales = ops.server_compress(wire.recv[:, (a - lo) // 8:(b - lo) // 8],
                                                 self._scales(wire.recv, s)[:, first:first + count],
                                                 st._server_error[a:b], block, real,
                                                 cap=self._caps(base + a, base + a + real))
            wire.server_send[(a - lo) // 8:(b - lo) // 8].copy_(packed)
            self._scales(wire.server_send, s)[first:first + count].copy_(scales)
        wire.server_send[layout.scales_end:].copy_(self._header(s).view(torch.uint8))
        return wire.server_send

    def _record_sent(self) -> None:
        """Keep the squared norm of what this rank sent, decoded (`CompressionState.last_sent_norm`),
        from the block scales of its rows: a pass over the scales only, kept as a tensor so
        that nothing waits for a device here."""
        st = self.state
        total = None
        for s, w in enumerate(st._wire):
            worker_n, server_n = st._block_counts(s)
            part = ((self._scales(w.send, s).double().square() * worker_n).sum()
                    + (self._scales(w.server_send, s).double().square() * server_n).sum())
            total = part if total is None else total + part
        st._sent_sq = total

    def _decode(self) -> None:
        """Decode every server chunk into the sink: straight into a contiguous float32
        tensor, else range by range (whole blocks) through the staging buffer."""
        st, sink = self.state, self.sink
        block, m, n0 = st.block_size, st.chunk, st.numel
        whole, write, copy_back = self._sink_target()
        if whole is not None and len(st.piece_spans) == 1 and not self.computed:
            g = st._wire[0].gathered
            ops.unpack_into(g[:, :st._row_layouts[0].sign_bytes], self._scales(g, 0), block, whole,
                            weights=self.weights, cap=self.cap)
        else:
            for s, (lo, hi) in enumerate(st.piece_spans):
                g = st._wire[s].gathered
                for k in range(st.world_size):
                    span = hi - lo if write is None and not self.computed else st._staging_cap
                    for a, b in block_ranges(lo, hi, block, span):
                        g0, g1 = k * m + a, min(k * m + b, n0)
                        if g1 <= g0:
                            continue
                        first = (a - lo) // block if block else 0
                        count = -(-(b - a) // block) if block else 1
                        scales = self._scales(g[k:k + 1], s)[:, first:first + count]
                        out = whole[g0:g1] if write is None else st._staging_buffer(st._staging_cap)[:g1 - g0]
                        w = None if self.weights is None else self.weights[g0:g1]
                        c = self._caps(g0, g1)
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
        for lo, hi in block_ranges(0, st.numel, None, st._staging_cap):
            values = self._input(lo, hi)
            if write is None:
                whole[lo:hi].copy_(values)
                continue
            buf = st._staging_buffer(st._staging_cap)[:hi - lo]
            if buf.data_ptr() != values.data_ptr():
                buf.copy_(values)
            write(lo, hi, buf)
        if copy_back:
            sink.copy_(whole.view(sink.shape))


