"""Transports: the two byte collectives the compressed allreduce needs (DESIGN.md §2).

A transport moves uint8 buffers only: `all_to_all(out, inp)` where row j of `inp` [p, L]
goes to rank j and row j of `out` came from rank j, and `all_gather(out, inp)` of a [L]
buffer into a flat [p * L] one. With async_op=True both return a torch.futures.Future
that completes when `out` is filled; otherwise they block and return None.
"""
from .torch_dist import TorchTransport, world_info

__all__ = ["TorchTransport", "world_info", "get_transport"]


def get_transport(group=None):
    """The transport for a torch.distributed process group (None: the default group)."""
    return TorchTransport(group)
