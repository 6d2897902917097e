"""The exceptions lbcomm raises for a misconfigured stack (docs/troubleshooting.md)."""

__all__ = ["DoubleCompressionError", "AveragedGradientsError", "NotInitializedError", "NotCompressedWarning", "ReplicaDivergenceError"]


class DoubleCompressionError(RuntimeError):
    """Two lbcomm compressors (onebit_hook and a 1-bit optimizer) on the same gradients."""


class AveragedGradientsError(RuntimeError):
    """A 1-bit optimizer received gradients that are identical on every rank: something
    (DDP's full-precision allreduce, or a compressing hook) has already averaged them."""


class NotInitializedError(RuntimeError):
    """The launcher started several ranks (torchrun's WORLD_SIZE, or mpirun without mpi4py)
    but torch.distributed is not initialized: each rank would train alone, nothing averaged."""


class NotCompressedWarning(UserWarning):
    """A 1-bit optimizer was checkpointed, or its run ended, before it ever compressed:
    every step so far averaged the gradients in full precision (freeze_step not reached)."""


class ReplicaDivergenceError(RuntimeError):
    """The parameters differ between the ranks although every rank applied the same update:
    something changes them outside the optimizer (per-rank initialization, an embedding's
    max_norm renormalizing the rows each rank looks up in place)."""
