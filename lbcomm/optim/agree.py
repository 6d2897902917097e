"""What the ranks of an lbcomm optimizer agree on besides the update itself: the probe for
gradients that arrive averaged already (never silent), and the clipping norm.

* The probe (`replica_slots`, `replicas_identical`, `averaged_grads_error`): a per-rank
  checksum of the local gradients (their sum and sum of squares, 2 floats per rank) rides
  in a collective the optimizer makes anyway (the warmup's gradient allreduce, the
  compression stage's finiteness agreement); if every rank sent the same checksum, the
  gradients were averaged before the optimizer saw them: by DDP's own allreduce, or by a
  compressing hook such as ``lbcomm.onebit_hook`` (1-bit compression twice).
* `over_shards`, `per_tensor`: verdicts and per-tensor values agreed over the shard group
  of FSDP2-sharded parameters.
* `clip_grad_norm_`: a clipping norm that is the same on every rank, at most one scalar
  allreduce (`BaseOptimizer.clip_grad_norm_`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ..errors import AveragedGradientsError, ReplicaDivergenceError
from .flat import local_tensor

__all__ = ["replica_slots", "replicas_identical", "averaged_grads_error", "clip_grad_norm_", "over_shards",
           "per_tensor"]


def replica_slots(tensors: Sequence[Tensor], rank: int, world_size: int, device: torch.device) -> Tensor:
    """2 x world_size fp32 zeros with this rank's checksum of `tensors` (their sum and their
    sum of squares, in fp32) in slots 2 rank, 2 rank + 1. Summed (or averaged) over the
    ranks, slot pair r holds rank r's checksum exactly (x + 0 is exact)."""
    slots = torch.zeros(2 * world_size, dtype=torch.float32, device=device)
    for t in tensors:
        slots[2 * rank] += t.sum(dtype=torch.float32)
        slots[2 * rank + 1] += torch.linalg.vector_norm(t, dtype=torch.float32).square()
    return slots


def replicas_identical(slots: Tensor) -> Optional[bool]:
    """From reduced `replica_slots`: True when every rank's checksum is the same, False when
    they differ, None when undecided (a rank's gradients are all zero or not finite)."""
    rows = slots.view(-1, 2)
    if not bool(torch.isfinite(rows).all()) or not bool((rows[:, 1] > 0).all()):
        return None
    return bool((rows == rows[0]).all())


def averaged_grads_error(name: str, step: int, world_size: int, stage: str) -> AveragedGradientsError:
    """The error of a 1-bit optimizer whose gradients were identical on every rank at `step`
    (`stage`: "warmup" or "compression"); it names both causes and their fixes."""
    if stage == "warmup":
        why = ("the optimizer averages them a second time, and after the freeze the other reduction would keep "
               "running next to the compressed one")
    else:
        why = "another reduction runs next to the optimizer's compressed allreduce, so nothing is saved"
    return AveragedGradientsError(
        f"{name}: at step {step} ({stage}) the gradients are identical on all {world_size} ranks: something "
        f"averaged them before the optimizer, either DistributedDataParallel's own full-precision allreduce (no "
        f"lbcomm hook registered) or a compressing hook such as lbcomm.onebit_hook (1-bit compression twice); {why}. "
        "Register lbcomm's warmup hook instead: lbcomm.attach(ddp_model, optimizer) (it finds the DDP inside "
        "accelerate, Lightning and torch.compile wrappers) or ddp_model.register_comm_hook(lbcomm.WarmupAverage("
        "optimizer), lbcomm.warmup_average_hook); with the Hugging Face Trainer trainer.add_callback(lbcomm."
        "integrations.transformers.LbcommCallback(trainer)), with Lightning callbacks=[lbcomm.integrations.lightning."
        "LbcommCallback()]. If every rank really computes the same gradients (the same batch on every rank), pass "
        f"{name}(..., comm=lbcomm.CommConfig(detect_averaged_grads=False)).")


@torch.no_grad()
def clip_grad_norm_(opt, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
    """Clip the gradients of the lbcomm optimizer `opt` by a norm that is the same on every
    rank, with at most one scalar allreduce; call it between backward and `step`
    instead of ``torch.nn.utils.clip_grad_norm_``.

    * Gradients already averaged over the ranks (warmup with lbcomm's DDP hook, or one
      rank): exactly ``torch.nn.utils.clip_grad_norm_`` (the norm of the averaged
      gradient; no communication).
    * Local gradients (the compression stage of the 1-bit optimizers, or a warmup
      that the optimizer averages itself): N = sqrt(mean_r ||g_r||^2), one scalar
      allreduce, and every rank scales by the same min(1, max_norm / (N + 1e-6)). N
      bounds the norm of the averaged gradient from above (it adds the spread of the
      ranks' gradients), so the gradient that the optimizer effectively averages keeps
      its direction and its norm stays at most max_norm. Clipping each rank's local
      gradient by its own norm instead (what frameworks do) also keeps the mean within
      max_norm, but weighs the ranks unequally and reports rank 0's local norm.

    Args:
        max_norm (float): max norm of the gradients.
        norm_type (float, optional): only 2.0 is supported (default: 2.0).
        error_if_nonfinite (bool, optional): raise if the norm is NaN/Inf (on every
            rank alike) (default: False).

    Returns:
        The norm used (a 0-dim fp32 tensor, identical on every rank): log it as the
        gradient norm.
    """
    name = type(opt).__name__
    if float(norm_type) != 2.0:
        raise ValueError(f"{name}.clip_grad_norm_: only norm_type=2.0 is supported, got {norm_type}")
    if opt.shard_group is not None:
        raise NotImplementedError(f"{name}.clip_grad_norm_ does not support sharded (FSDP2) parameters yet; clip "
                                  "with torch.nn.utils.clip_grad_norm_ during the warmup or not at all")
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    tr = opt.transport
    if params:
        local = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    else:
        local = torch.zeros((), dtype=torch.float32)
    total = local
    if tr.world_size > 1 and (opt.frozen or not opt.grads_averaged):
        sq = local.float().square().reshape(1)
        tr.all_reduce(sq, op="mean")
        total = sq.sqrt().reshape(())
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"{name}.clip_grad_norm_: the total gradient norm is {float(total)} (NaN/Inf on at least "
                           "one rank); the gradients were not clipped")
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def over_shards(fs, ok: bool) -> bool:
    """Whether `ok` holds on every rank of the shard group of the flat state `fs` (a
    `FlatState`; one scalar allreduce; `ok` itself when unsharded)."""
    if not fs.sharded():
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device=fs.device)
    fs.shard_transport.all_reduce(flag, op="sum")
    return float(flag) == 0.0


def per_tensor(fs, L, local: Tensor, op: str = "sum", full: bool = False):
    """Per parameter tensor: `local` ([len(L.params), k], this rank's shard's values)
    reduced over the shard group of the flat state `fs` (sum of the shards' sums, or their max), in layout
    order; `local` itself when unsharded. One allreduce, indexed by the parameters'
    numbering in param_groups (torch's state_dict numbering), so that ranks whose layouts
    differ (a parameter whose local shard is empty) take part in the same collective. With
    `full`: the reduced values of every parameter in that numbering, and the index of each
    layout parameter in it."""
    index = fs.param_indices()
    n = max(index.values(), default=-1) + 1
    fill = 0.0 if op == "sum" else float("-inf")
    out = torch.full((n,) + tuple(local.shape[1:]), fill, dtype=torch.float32, device=local.device)
    where = torch.tensor([index[id(p)] for p in L.params], dtype=torch.int64, device=local.device)
    if where.numel():
        out[where] = local.float()
    if fs.sharded():
        fs.shard_transport.all_reduce(out, op=op)
    elif not full:
        return local
    return (out, where) if full else out[where]


def check_params_identical(fs, L) -> None:
    """After the first step and at the freeze: raise `ReplicaDivergenceError` when the
    parameters differ between the ranks of ``comm.process_group`` (one allreduce of
    2 x world_size checksums). Every rank applied the same update, so a difference comes
    from outside the optimizer, and after the freeze no averaging would pull the replicas
    back together."""
    tr = fs.transport
    if tr.world_size == 1 or not L.params:
        return
    slots = replica_slots([local_tensor(p).detach() for p in L.params], tr.rank, tr.world_size, fs.device_of(L))
    tr.all_reduce(slots, op="sum")
    rows = slots.view(-1, 2)
    if bool(torch.isnan(rows).any()) or bool((rows == rows[0]).all()):
        return  # identical (or not finite, which the non-finite policy reports)
    raise ReplicaDivergenceError(
        f"{fs.name}: after step {fs.global_step} the parameters differ between the {tr.world_size} "
        "ranks, although every rank applied the same averaged update: something changes them outside the "
        "optimizer, so the replicas drift apart (and after the freeze nothing pulls them back). Common causes: "
        "each rank initialized the model with another seed (call torch.manual_seed with the same seed on every "
        "rank before building the model, or broadcast rank 0's parameters), or an nn.Embedding / nn.EmbeddingBag "
        "with max_norm, which renormalizes the rows each rank looks up in place during the forward pass (drop "
        "max_norm, or renormalize the weights after optimizer.step() on every rank alike)")
