"""Gossip: the neighbour averaging of the decentralized optimizers (`lbcomm.DecentLaM`,
`lbcomm.DmSGD`). Instead of a global allreduce, each rank mixes a flat vector y with its
neighbours' in a sparse graph, z_i = sum_j w_ij y_j, through the transport's
point-to-point `sendrecv`.

Graphs (`GRAPHS`); W is doubly stochastic for every world size n >= 2:

* ``"ring"``: rank i averages with i - 1 and i + 1 (mod n), weight 1/3 each, 1/3 for itself:
  W = (I + S + S^-1) / 3 with S the cyclic shift (at n = 2 both neighbours are the other
  rank: weight 2/3). Every step the same two messages per rank.
* ``"exponential"``: the one-peer exponential graph. At step k rank i receives from
  (i + 2^t) mod n and sends to (i - 2^t) mod n, t = k mod ceil(log2 n), weights 1/2:
  W_k = (I + S^(2^t)) / 2, one message per rank per step. For n a power of two the product
  of log2 n consecutive W_k is exactly the global average; for other n each W_k is still
  doubly stochastic and the graphs together connected, only that exactness is lost.

The mixed vector is summed in a fixed order (this rank's term first, then the peers in
ascending rank), so the result does not depend on message arrival and a plain-torch
simulation of all ranks reproduces it bit for bit.

Compression (experimental, ``compress=True``): per directed link a shared estimate x^ of the
sender's vector, held by both ends (CHOCO-SGD's public copies, one per channel: the ring sends
one message to both neighbours, so one estimate per sender; the exponential graph has one per
shift). The sender transmits q = C(y - x^), the 1-bit sign + block-RMS-scale compression of
lbcomm's kernels, and both ends add the decoded q to their copy of x^: what the compression
dropped stays in y - x^ and is sent at the next step (error feedback through the estimate).
The mixed vector is z_i = y_i + c (sum_j w_ij x^_(j->i) - (1 - w_ii) x^_(i->out)) with the
consensus step c (CHOCO's gamma, 0 < c <= 1): it keeps the average over the ranks exactly (up
to rounding) whatever the compression error, and equals ((1 - c) I + c W) y once the
estimates are exact. c = 1 diverges with the 1-bit messages (the estimates' errors are
amplified by the mixing); the default 0.5 reaches consensus on the ring and the
exponential graph alike.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .. import ops
from ..wire import ALIGN, num_blocks

__all__ = ["GRAPHS", "Neighbours", "neighbours", "shifts", "Gossip"]

GRAPHS = ("ring", "exponential")


class Neighbours(NamedTuple):
    """One rank's part of W at one step."""

    self_weight: float  # w_ii
    recvs: List[Tuple[int, float, int]]  # (peer j, w_ij, channel), ascending j
    sends: List[int]  # the peers this rank's message goes to (each gets the same message)
    out_channel: int  # the channel of this rank's message (compression: its estimate)


def shifts(n: int) -> List[int]:
    """The exponential graph's shifts 1, 2, 4, ... below n (ceil(log2 n) of them)."""
    out, s = [], 1
    while s < n:
        out.append(s)
        s *= 2
    return out


def check_graph(topology, n: int, who: str) -> None:
    if topology not in GRAPHS:
        raise ValueError(f"{who}: unknown graph {topology!r} (use one of {GRAPHS})")
    if n < 2:
        raise ValueError(f"{who}: the world has {n} rank: there is nothing to decentralize (each rank averages with "
                         "its neighbours in the graph). Run it on 2 or more ranks (torchrun, mpirun), or use "
                         "torch.optim.SGD(momentum=...) on one process")


def check_consensus_step(value, who: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{who}: invalid consensus_step {value!r} (a number in (0, 1]: the share of the "
                         "neighbours' compressed estimates mixed in per step)")


def neighbours(topology: str, rank: int, n: int, step: int) -> Neighbours:
    """Rank `rank`'s neighbours among `n` at `step` (0-based: the step being taken)."""
    if topology == "ring":
        if n == 2:
            return Neighbours(1 / 3, [(1 - rank, 2 / 3, 1)], [1 - rank], 0)
        left, right = (rank - 1) % n, (rank + 1) % n
        recvs = sorted([(left, 1 / 3, n - 1), (right, 1 / 3, 1)])
        return Neighbours(1 / 3, recvs, [left, right], 0)
    s = shifts(n)
    s = s[step % len(s)]
    return Neighbours(0.5, [((rank + s) % n, 0.5, s)], [(rank - s) % n], s)


def channels(topology: str, n: int) -> Tuple[List[int], List[int]]:
    """(out channels, in channels) of a rank: the estimates compression keeps."""
    if topology == "ring":
        return [0], ([1] if n == 2 else [1, n - 1])
    return shifts(n), shifts(n)


class Gossip:
    """The neighbour averaging of one optimizer over `transport` (a `lbcomm.comm`
    transport), optionally 1-bit compressed (see the module docstring).

    Attributes:
        bytes_sent (int): bytes this rank sent so far through `mix`.
        calls (int): mixes done so far.
        error_norm (float): compression: the norm of y - x^ after the last send (what its
            estimate still misses); 0 without compression.
    """

    def __init__(self, topology: str, transport, compress: bool = False, block_size: Optional[int] = 2048,
                 who: str = "DecentLaM", consensus_step: float = 0.5):
        check_graph(topology, transport.world_size, who)
        check_consensus_step(consensus_step, who)
        self.topology, self.transport, self.compress, self.block_size = topology, transport, compress, block_size
        self.consensus_step = float(consensus_step)
        self.bytes_sent, self.calls, self.error_norm = 0, 0, 0.0
        self._bufs: Dict[tuple, Tensor] = {}

    def buffer_names(self) -> Tuple[str, ...]:
        """The flat state buffers compression keeps (the estimates), none without it."""
        if not self.compress:
            return ()
        out, inn = channels(self.topology, self.transport.world_size)
        return tuple(f"sent_estimate_{c}" for c in out) + tuple(f"recv_estimate_{c}" for c in inn)

    def neighbours(self, step: int) -> Neighbours:
        return neighbours(self.topology, self.transport.rank, self.transport.world_size, step)

    def _buf(self, key, numel: int, dtype, device) -> Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.numel() != numel or buf.device != device:
            buf = self._bufs[key] = torch.zeros(numel, dtype=dtype, device=device)
        return buf

    def message_bytes(self, numel: int) -> int:
        """Bytes of one message for a flat vector of `numel` fp32 elements."""
        if not self.compress:
            return 4 * numel
        m = -(-numel // ALIGN) * ALIGN
        return m // 8 + 4 * num_blocks(m, self.block_size)

    def exchange(self, y: Tensor, step: int, estimates: Dict[str, Tensor]):
        """Send this rank's message for `y` (flat fp32) and receive the neighbours'.
        Returns a `commit()` that applies the step (updates the estimates when compressing)
        and returns z, the mixed vector; not calling it leaves every state unchanged (a
        skipped step)."""
        nb = self.neighbours(step)
        n, dev = y.numel(), y.device
        recv = [self._buf(("recv", k), self.message_bytes(n) if self.compress else n,
                          torch.uint8 if self.compress else torch.float32, dev) for k in range(len(nb.recvs))]
        if self.compress:
            msg = self._compress(y, estimates[f"sent_estimate_{nb.out_channel}"])
        else:
            msg = y
        self.transport.sendrecv([(p, msg) for p in nb.sends], [(j, r) for (j, _, _), r in zip(nb.recvs, recv)])
        sent = len(nb.sends) * msg.numel() * msg.element_size()

        def commit() -> Tensor:
            self.bytes_sent += sent
            self.calls += 1
            if not self.compress:
                z = torch.mul(y, nb.self_weight)
                for (_, w, _), r in zip(nb.recvs, recv):
                    z.add_(r, alpha=w)
                return z
            mine = estimates[f"sent_estimate_{nb.out_channel}"]
            scratch = self._buf("decoded", n, torch.float32, dev)
            mine.add_(self._decode(msg, n, scratch))
            for (_, _, c), r in zip(nb.recvs, recv):
                estimates[f"recv_estimate_{c}"].add_(self._decode(r, n, scratch))
            z, step_c = y.clone(), self.consensus_step
            for (_, w, c), r in zip(nb.recvs, recv):
                z.add_(estimates[f"recv_estimate_{c}"], alpha=step_c * w)
            z.add_(mine, alpha=-step_c * (1 - nb.self_weight))
            self.error_norm = float(torch.linalg.vector_norm(y - mine))
            return z

        return commit

    def _compress(self, y: Tensor, estimate: Tensor) -> Tensor:
        """The message C(y - x^): sign bytes, then fp32 block scales."""
        n = y.numel()
        m = -(-n // ALIGN) * ALIGN
        diff = torch.sub(y, estimate)
        zero = self._buf("zero_error", m, torch.float32, y.device)  # never written: the estimate carries the error
        residual = self._buf("residual", m, torch.float32, y.device)
        packed, scales = ops.worker_compress(diff, zero, self.block_size, error_out=residual)
        msg = self._buf(("send",), self.message_bytes(n), torch.uint8, y.device)
        msg[:m // 8].copy_(packed.reshape(-1))
        msg[m // 8:].view(torch.float32).copy_(scales.reshape(-1))
        return msg

    def _decode(self, msg: Tensor, n: int, out: Tensor) -> Tensor:
        m = -(-n // ALIGN) * ALIGN
        return ops.unpack_into(msg[:m // 8], msg[m // 8:].view(torch.float32), self.block_size, out)
