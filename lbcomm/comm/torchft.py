"""The transport over a torchft process group (`lbcomm.ft`): the byte collectives of
lbcomm on the reconfigurable group a torchft ``Manager`` configures at every quorum.

torchft's groups (``torchft.process_group.ProcessGroupGloo`` and its kin) are not
registered with torch.distributed, so the `TorchTransport` functions (which take a
``group=`` argument) cannot drive them; this transport calls the group's own methods
(``alltoall_base``, ``allgather``, ``allreduce``, ``barrier``). One instance holds the rank
and size of one quorum: the owner builds a new one when the quorum changes. Collectives
that fail (a peer left) raise from ``wait``/``value``; the owner hands the error to the
manager (``report_error``), which then refuses to commit the step.

Importing this module does not import torchft: the option types are torch's.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions, BarrierOptions,
                                                ReduceOp)

from .base import (GatherVThroughBytes, RowsThroughBytes, StagedRows, all_gather_one_round, all_reduce_one_round,
                   buckets, check_all_reduce, finish_all_reduce, one_round, small_for_one_round)
from .torch_dist import _keep

__all__ = ["TorchFTTransport"]

_OPS = {"sum": ReduceOp.SUM, "mean": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN}


class TorchFTTransport(RowsThroughBytes, GatherVThroughBytes):
    """lbcomm's `Transport` over a torchft process group, for one quorum.

    Args:
        pg: the torchft process group the Manager reconfigures (the one passed to
            ``Manager(pg=...)``).
        rank (int): this replica group's rank in the quorum
            (``manager.participating_rank()``).
        world_size (int): the replica groups in the quorum (``manager.num_participants()``).
    """

    def __init__(self, pg, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"TorchFTTransport: rank {rank} is not in a quorum of {world_size}")
        size = pg.size()
        if size != world_size:
            raise ValueError(f"TorchFTTransport: the process group spans {size} replica groups but the quorum has "
                             f"{world_size} participants; create the torchft Manager with use_async_quorum=False, "
                             "so that every member of the group takes part in every step")
        self.pg = pg
        self.group = None  # not a torch.distributed group
        self.rank, self.world_size = rank, world_size
        self.backend = pg.getBackendName()
        self._rows = StagedRows(self)

    def check_device(self, device: torch.device) -> None:
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"TorchFTTransport: the torchft group moves CPU (or CUDA) tensors; got one on {device}")

    @staticmethod
    def _finish(work, tensors, async_op: bool):
        _keep(work, tensors)
        if async_op:
            return work.get_future()
        work.wait()
        return None

    def all_to_all(self, out: Tensor, inp: Tensor, async_op: bool = False):
        o, i = out.reshape(-1), inp.reshape(-1)
        return self._finish(self.pg.alltoall_base(o, i, [], [], AllToAllOptions()), (o, i), async_op)

    def all_gather(self, out: Tensor, inp: Tensor, async_op: bool = False):
        if one_round(self.backend, inp):  # one round instead of gloo's p - 1 (lbcomm.comm.base)
            return all_gather_one_round(self.all_to_all, out, inp, self.world_size, async_op)
        i = inp.reshape(-1)
        outs = list(out.reshape(self.world_size, -1).unbind(0))
        return self._finish(self.pg.allgather([outs], [i], AllgatherOptions()), (out, i), async_op)

    def all_reduce(self, tensor: Tensor, op: str = "sum", async_op: bool = False,
                   bucket_bytes: Optional[int] = None):
        check_all_reduce(tensor, op, bucket_bytes)
        if one_round(self.backend, tensor) and small_for_one_round(tensor, self.world_size):
            return all_reduce_one_round(self.all_to_all, tensor, op, self.world_size, async_op)
        futures = []
        for piece in buckets(tensor.view(-1), bucket_bytes):
            opts = AllreduceOptions()
            opts.reduceOp = _OPS[op]
            work = self.pg.allreduce([piece], opts)
            _keep(work, (piece,))
            futures.append(work.get_future())
        return finish_all_reduce(tensor, op, self.world_size, futures, async_op)

    def barrier(self) -> None:
        self.pg.barrier(BarrierOptions()).wait()

    def sendrecv(self, sends, recvs, async_op: bool = False):
        raise NotImplementedError("TorchFTTransport: point-to-point exchanges (the decentralized optimizers) are not "
                                  "supported over a torchft group; use lbcomm.ft's local updates")
