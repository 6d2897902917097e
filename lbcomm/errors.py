"""Every exception and warning class lbcomm raises (docs/troubleshooting.md); the modules
that raise them import them from here."""

__all__ = ["NonFiniteError", "DoubleCompressionError", "AveragedGradientsError", "NotInitializedError",
           "ReplicaDivergenceError", "MissingRankLocalError", "MissingHookStateWarning", "NotCompressedWarning",
           "ClippingTakenOverWarning"]


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

class NonFiniteError(FloatingPointError):
    """A compressed allreduce saw NaN/Inf; raised on every rank (the message says whether
    the error buffers are unchanged or were reset)."""


class MissingHookStateWarning(RuntimeWarning):
    """The optimizer was restored from a checkpoint, the hook state was not: warned at the
    hook's first call (`ResumeCheck`) and by `lbcomm.load_sharded` when the shard holds a
    hook state (or `OneBitLocalUpdates`' state) that the call does not restore."""


class MissingRankLocalError(ValueError):
    """A DCP checkpoint holds the per-rank state of a lbcomm object (saved with `RankLocal`)
    that the load does not restore. Raised by `LoadPlanner` inside ``dcp.load``, which
    reports it in its ``CheckpointException`` (``failures`` holds it per rank)."""


class ClippingTakenOverWarning(UserWarning):
    """`LbcommCallback` turned the Trainer's clipping by norm off
    (``TrainingArguments.max_grad_norm`` set to 0) and clips itself by one norm shared by
    all ranks: the Trainer's clipping would use each rank's own norm of its local gradient."""
