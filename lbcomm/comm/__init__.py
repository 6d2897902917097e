"""Transports: the only code in lbcomm that touches the network.

Every transport conforms to the `Transport` protocol (`lbcomm.comm.base`): `world_size`,
`rank`, `backend`, `check_device(device)` and:

* `all_to_all(out, inp)`: uint8 buffers; row j of `inp` [p, L] goes to rank j and row j
  of `out` came from rank j (phase 1 of the compressed allreduce);
* `all_gather(out, inp)`: uint8; every rank's [L] `inp` into a flat [p * L] `out` (phase 3);
* `all_reduce(tensor, op="sum", bucket_bytes=None)`: in place, op one of "sum", "mean",
  "max", "min"; with bucket_bytes the flat tensor is cut into buckets that are all in
  flight at once (the optimizers' warmup averaging, the hooks' full-precision start);
* `barrier()`: blocks until every rank has called it (checkpoints);
* `all_gather_v(inp)`: every rank's 1-D uint8 `inp` of any length, a list of p tensors
  (blocking; lengths first, then a zero-padded all-gather: the sparse exchanges of DCT);
* `send_v(inp, dst)` / `recv_v(src)`: point-to-point of a 1-D uint8 tensor of any length
  (blocking; transports that connect processes: torch.distributed, shared memory through
  its group, counted by `CountingTransport`; the model-parallel boundary of DCT);
* `sendrecv(sends, recvs)`: point-to-point messages with a few peers, all in flight at
  once ((peer, tensor) pairs; the neighbour exchange of `lbcomm.DecentLaM`);
* `rows_out(rows, row_bytes, device)`, then `all_to_all_rows()` / `all_gather_rows()`: the
  row collectives of the hierarchical call, into buffers the transport owns (shared memory
  read in place by `ShmTransport`, the byte collectives above elsewhere).

With async_op=True the collectives return a torch.futures.Future that completes when the
output is filled (`all_reduce`'s holds the tensor); otherwise they block and return None.

Collectives start in the order they are called on each rank, and every rank must call
them in the same order (as with any collective library).

Backends (`get_transport(group, backend=...)`):

* ``"torch"``: a torch.distributed process group (gloo for CPU tensors, NCCL for CUDA
  tensors); launch with torchrun or mp.spawn.
* ``"mpi"``: MPI through mpi4py (`MPITransport`); launch with mpirun.
* `LoopTransport(p)`: one process playing rank 0 of p ranks that all hold the same data
  (no network; the cost model times the compute of a call with it).
* ``"auto"`` (default): torch.distributed when it is initialized, else MPI when this
  process was started by an MPI launcher and mpi4py is installed, else a one-rank torch
  transport (nothing to communicate).

A world of one while a launcher says there are several ranks (torchrun's WORLD_SIZE, an
MPI launcher's size without mpi4py or with backend "torch") raises
`lbcomm.errors.NotInitializedError` (`world_info`): the script forgot
``init_process_group``, and every rank would otherwise train alone.
"""
from .base import REDUCE_OPS, Transport
from .loop import LoopTransport
from .torch_dist import TorchTransport, all_gather_objects, check_not_launched_alone, gather_objects, world_info

__all__ = ["Transport", "TorchTransport", "MPITransport", "LoopTransport", "world_info", "gather_objects", "all_gather_objects", "get_transport", "BACKENDS",
           "REDUCE_OPS"]

BACKENDS = ("auto", "torch", "mpi")


def __getattr__(name):
    if name == "MPITransport":  # imported lazily: importing mpi4py.MPI initializes MPI
        from .mpi import MPITransport

        return MPITransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_mpi_comm(group) -> bool:
    return type(group).__module__.startswith("mpi4py")


def _check_mpi_launcher(auto: bool) -> None:
    """mpirun started several ranks but they would talk over a torch.distributed world of one
    (no mpi4py for the MPI backend, or backend='torch' without init_process_group)."""
    from .mpi import _INSTALL_HINT, launcher_world_size

    found = launcher_world_size()
    if found is not None:
        var, n = found
        fix = (f", or install mpi4py for lbcomm's MPI backend ({_INSTALL_HINT})" if auto
               else ", or pass backend='mpi' (or 'auto') to communicate through MPI")
        check_not_launched_alone(n, f"the MPI launcher ({var}={n})", fix)


def get_transport(group=None, backend: str = "auto"):
    """The transport for `group` on `backend`.

    Args:
        group (optional): a torch.distributed ProcessGroup for ``"torch"``, an mpi4py
            communicator for ``"mpi"`` (default: None, the whole world).
        backend (str, optional): ``"auto"``, ``"torch"`` or ``"mpi"`` (default: "auto").
    """
    if backend not in BACKENDS:
        raise ValueError(f"Invalid backend: {backend!r} (use one of {BACKENDS})")
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    auto = backend == "auto"
    if auto:
        if _is_mpi_comm(group):
            backend = "mpi"
        elif group is not None or initialized:
            backend = "torch"
        else:
            from .mpi import launched_by_mpirun, mpi_available

            backend = "mpi" if launched_by_mpirun() and mpi_available() else "torch"
    if backend == "torch" and group is None and not initialized:
        _check_mpi_launcher(auto)
    if backend == "mpi":
        if group is not None and not _is_mpi_comm(group):
            raise TypeError(f"backend='mpi' needs an mpi4py communicator as the group (or None for COMM_WORLD), got "
                            f"{type(group).__name__}; use backend='torch' for torch.distributed process groups")
        from .mpi import MPITransport

        return MPITransport(group)
    if _is_mpi_comm(group):
        raise TypeError("backend='torch' needs a torch.distributed process group, got an mpi4py communicator; use "
                        "backend='mpi' (or 'auto')")
    return TorchTransport(group)
