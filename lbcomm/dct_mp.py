"""DCT for model parallelism: the thresholded exchange of activations and their gradients
across a model-parallel boundary between two ranks (`DCTBoundary`).

The rank that owns the lower part of the model (e.g. the embedding tables of a
recommendation model) sends its output activations to the rank that owns the upper part
(e.g. the MLP); that one sends back the gradients of the loss with respect to them. With
DCT only the activations of magnitude at least a threshold travel, as (index, value)
pairs (the threshold refreshed every ``refresh_every`` calls from the top ``density``
share of the magnitudes; `lbcomm.dct.Sparsifier`); what is not sent stays in a residual
added to the next batch's activations at the same positions (``residual=True``, the
default) or is dropped (``residual=False``). Activations belong to one batch's samples, so
the residual grows until much of it passes: at a given density it sends more (and reaches a
lower loss) than without; bench/dct_mp.py measures both. The upper part sees the other activations as zero, so the
gradient of the loss with respect to the sender's activations is zero there: only the
gradients at the positions sent forward travel back, as values (the receiver knows the
indices). The backward is thus the exact gradient of the thresholded forward and needs no
threshold of its own.

``density=None`` is the dense exchange (every activation and gradient, fp32), the
baseline; ``threshold=0.0`` sends every nonzero activation, which computes the same
losses and gradients as the dense exchange.

Both directions go through the transport's point-to-point `send_v` / `recv_v` (a
torch.distributed or shared-memory transport of the two ranks; wrap it in a
`lbcomm.comm.counting.CountingTransport` to count the bytes on the wire).

Example (rank 0 holds ``emb``, rank 1 holds ``mlp``)::

    >>> # xdoctest: +SKIP
    >>> link = DCTBoundary(transport, density=0.05, refresh_every=100)
    >>> if rank == 0:
    ...     x = emb(tokens)                # [batch, dim]
    ...     link.send(x)
    ...     x.backward(link.recv_grad())
    ... else:
    ...     x = link.recv((batch, dim))    # requires grad
    ...     loss = F.cross_entropy(mlp(x), labels)
    ...     loss.backward()
    ...     link.send_grad(x.grad)
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from .common import error_ratio
from .dct import Sparsifier, check_density, check_refresh_every, pack, unpack

__all__ = ["DCTBoundary"]


class DCTBoundary:
    """One side of a two-rank model-parallel boundary with DCT (see the module docs).

    Args:
        transport: a transport of the two ranks with `send_v` / `recv_v` (world size 2).
        density (float or None): the share of the activations the refreshed threshold lets
            through, in (0, 1]; None: the dense exchange (default: 0.01).
        refresh_every (int): calls between threshold refreshes, >= 1 (default: 1000).
        residual (bool): keep the activations not sent and add them to the next call's
            (default: True).
        threshold (float, optional): a fixed threshold instead of the refreshed one
            (0.0: every nonzero activation) (default: None).
        src (int): the rank that sends the activations (default: 0).

    Attributes:
        bytes_sent (int): payload bytes this rank sent so far (lengths included: 8 bytes
            per message); ``activation_bytes`` / ``gradient_bytes`` split it by direction.
        sent_fraction (float): activations sent / activations offered (the sender).
        calls (int): thresholded messages this rank sent: activations (the sender) or
            their gradients (the receiver); 0 for the dense exchange.
    """

    def __init__(self, transport, *, density: Optional[float] = 0.01, refresh_every: int = 1000,
                 residual: bool = True, threshold: Optional[float] = None, src: int = 0):
        if transport.world_size != 2:
            raise ValueError(f"DCTBoundary: the boundary joins two ranks; the transport has {transport.world_size}")
        if not (hasattr(transport, "send_v") and hasattr(transport, "recv_v")):
            raise TypeError(f"DCTBoundary: {type(transport).__name__} has no point-to-point send_v / recv_v (use a "
                            "torch.distributed or shared-memory transport)")
        if src not in (0, 1):
            raise ValueError(f"DCTBoundary: invalid src {src!r} (0 or 1)")
        self.density = None if density is None else check_density(density, "DCTBoundary")
        self.refresh_every = check_refresh_every(refresh_every, "DCTBoundary")
        if density is None and threshold is not None:
            raise ValueError("DCTBoundary: a threshold needs the sparse exchange (density not None)")
        self.transport, self.src = transport, src
        self.peer = 1 - transport.rank
        self.residual, self.threshold = residual, threshold
        self.sparsifier: Optional[Sparsifier] = None  # made at the first send, for its shape
        self._index: Optional[Tensor] = None  # positions of the last exchange (None: dense)
        self._shape: Optional[Tuple[int, ...]] = None
        self.activation_bytes = self.gradient_bytes = 0
        self.sent_entries = self.offered_entries = 0
        self.calls = 0

    @property
    def bytes_sent(self) -> int:
        return self.activation_bytes + self.gradient_bytes

    @property
    def sent_fraction(self) -> float:
        return self.sent_entries / self.offered_entries if self.offered_entries else 0.0

    def _check_side(self, sender: bool, what: str) -> None:
        if (self.transport.rank == self.src) != sender:
            raise RuntimeError(f"DCTBoundary.{what}: called on rank {self.transport.rank}, but the activations go "
                               f"from rank {self.src} (send, recv_grad) to rank {1 - self.src} (recv, send_grad)")

    def _send(self, buf: Tensor) -> int:
        self.transport.send_v(buf, self.peer)
        return 8 + buf.numel()

    # ------------------------------------------------------------------ the sender of activations
    def send(self, x: Tensor) -> None:
        """Send the activations `x` (any shape, float); keep what `recv_grad` needs."""
        self._check_side(True, "send")
        flat = x.detach().reshape(-1)
        self._shape = tuple(x.shape)
        self.offered_entries += flat.numel()
        if self.density is None:
            self._index = None
            self.activation_bytes += self._send(flat.float().contiguous().view(torch.uint8))
            self.sent_entries += flat.numel()
            return
        sp = self.sparsifier
        if sp is None or sp.numel != flat.numel():
            if sp is not None:
                raise ValueError(f"DCTBoundary.send: activations of {flat.numel()} elements after {sp.numel}; the "
                                 "residual belongs to one shape (drop the last partial batch, or make a new boundary)")
            sp = self.sparsifier = Sparsifier(flat.numel(), self.density, self.refresh_every,
                                              residual=self.residual, threshold=self.threshold, device=flat.device)
        acc, index, thr = sp.select(flat)
        vals = acc.index_select(0, index)
        self.activation_bytes += self._send(pack(index, vals, flat.numel()))
        sp.commit(acc, index, thr, sent=vals)
        self._index = index
        self.sent_entries += index.numel()
        self.calls += 1

    def recv_grad(self) -> Tensor:
        """The gradient of the loss with respect to the last activations sent (zero where
        they were not sent), of their shape, to pass to ``x.backward``."""
        self._check_side(True, "recv_grad")
        if self._shape is None:
            raise RuntimeError("DCTBoundary.recv_grad: no activations were sent")
        buf = self.transport.recv_v(self.peer)
        n = int(torch.Size(self._shape).numel())
        if self._index is None:
            return buf.view(torch.float32).reshape(self._shape)
        grad = torch.zeros(n, dtype=torch.float32, device=buf.device)
        grad[self._index] = buf.view(torch.float32)
        return grad.reshape(self._shape)

    # ------------------------------------------------------------------ the receiver of activations
    def recv(self, shape, device=None) -> Tensor:
        """The activations the peer sent, of `shape` (zero where not sent), as a leaf that
        requires grad: after the backward pass, `send_grad` its ``.grad``."""
        self._check_side(False, "recv")
        self._shape = tuple(shape)
        n = int(torch.Size(self._shape).numel())
        buf = self.transport.recv_v(self.peer, device)
        if self.density is None:
            self._index = None
            x = buf.view(torch.float32).clone()
        else:
            self._index, vals = unpack(buf, n)
            x = torch.zeros(n, dtype=torch.float32, device=buf.device)
            x[self._index] = vals
        return x.reshape(self._shape).requires_grad_(True)

    def send_grad(self, grad: Optional[Tensor]) -> None:
        """Send the gradient with respect to the activations of the last `recv` (None:
        they did not reach the loss, zero)."""
        self._check_side(False, "send_grad")
        if self._shape is None:
            raise RuntimeError("DCTBoundary.send_grad: no activations were received")
        n = int(torch.Size(self._shape).numel())
        g = torch.zeros(n) if grad is None else grad.detach().reshape(-1).float()
        if self._index is not None:
            g = g.index_select(0, self._index)
            self.calls += 1
        self.gradient_bytes += self._send(g.contiguous().view(torch.uint8))

    # ------------------------------------------------------------------ statistics
    def compression_stats(self) -> Dict[str, Any]:
        """The keys every lbcomm compressor reports (`lbcomm.common.STATS_KEYS`), as they
        apply to the thresholded exchange: ``compressed_calls`` (`calls`), ``skipped_calls``
        (always 0: the boundary has no NaN/Inf agreement and never skips an exchange),
        ``bytes_sent``, ``error_norm`` (the norm of the sender's residual: what waits to be
        sent; 0 on the receiver, with ``residual=False`` and for the dense exchange) and
        ``error_ratio`` (that norm over the norm of the activations the last `send` sent);
        plus ``sent_fraction``."""
        sp = self.sparsifier
        err = 0.0 if sp is None or sp.residual is None else float(sp.residual.double().norm())
        return {"compressed_calls": self.calls, "skipped_calls": 0, "bytes_sent": self.bytes_sent,
                "error_norm": err, "error_ratio": error_ratio(err, 0.0 if sp is None else sp.last_sent_norm),
                "sent_fraction": self.sent_fraction}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """The sender's residual, threshold and statistics."""
        return {"sparsifier": None if self.sparsifier is None else self.sparsifier.state_dict(),
                "numel": None if self.sparsifier is None else self.sparsifier.numel,
                "activation_bytes": self.activation_bytes, "gradient_bytes": self.gradient_bytes,
                "sent_entries": self.sent_entries, "offered_entries": self.offered_entries, "calls": self.calls}

    def load_state_dict(self, sd: Dict[str, Any]) -> bool:
        """Restore a `state_dict` (the residuals and the counters); True, as every
        compressor's load returns whether its error feedback carried over (a boundary
        between two fixed ranks has no world size to change)."""
        if sd.get("sparsifier") is not None:
            self.sparsifier = Sparsifier(sd["numel"], self.density or 1.0, self.refresh_every, residual=self.residual,
                                         threshold=self.threshold)
            self.sparsifier.load_state_dict(sd["sparsifier"])
        for k in ("activation_bytes", "gradient_bytes", "sent_entries", "offered_entries"):
            setattr(self, k, int(sd[k]))
        self.calls = int(sd.get("calls", 0))  # absent from states saved before it was counted
        return True
