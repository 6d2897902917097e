"""`stats_hook`: the gradient statistics measured around any DDP communication hook."""
import math
from typing import Any, Callable, Optional

import torch

from .noise import GradientNoiseScale

__all__ = ["StatsHookState", "stats_hook"]


# ---------------------------------------------------------------------- DDP
class StatsHookState:
    """State of `stats_hook`: the gradient statistics around any DDP communication hook.

    Per bucket, the hook measures this rank's bucket before `hook` sees it (a pass over the
    bucket; with ``exact=False`` also a coordinate sample of it); at the last bucket the
    measurements of all buckets are averaged over the ranks with ONE small async allreduce
    (a scalar, or the samples). With ``exact=True`` the global norm is read from `hook`'s
    result (a second pass, in the future's callback; the hook must return the exact mean:
    torch's allreduce or fp16 hooks, lbcomm's optimizer hooks in warmup); with
    ``exact=False`` the sampled coordinates give it (any hook, compressed ones included).
    One step's statistics are folded in when the next backward pass starts, or by `flush`
    (call it before reading them). A 1-bit optimizer state in its compression stage
    measures inside its own step (``optimizer.gradient_stats``); the hook then measures
    nothing.

    Args:
        stats (GradientNoiseScale): where to fold the statistics.
        hook (callable): the wrapped hook, hook(hook_state, bucket) -> Future[Tensor].
        hook_state: its state (e.g. None, a PowerSGDState, an lbcomm optimizer).
        exact (bool): see above.
        process_group (optional): the DDP model's group (default: the whole world).

    Example::

        >>> # xdoctest: +SKIP
        >>> from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        >>> state = lbcomm.stats.StatsHookState(stats, allreduce_hook, None, exact=True)
        >>> ddp_model.register_comm_hook(state, lbcomm.stats.stats_hook)
    """

    __slots__ = ("stats", "hook", "hook_state", "exact", "process_group", "_pending", "_current", "_transport")

    def __init__(self, stats: GradientNoiseScale, hook: Callable, hook_state: Any = None, *, exact: bool,
                 process_group=None):
        self.stats, self.hook, self.hook_state, self.exact = stats, hook, hook_state, bool(exact)
        self.process_group = process_group
        self._pending: Optional[tuple] = None
        self._current: list = []  # this step's (measurement, [global |result|^2]) per bucket
        self._transport = None

    @property
    def transport(self):
        if self._transport is None:
            from ..comm import get_transport

            self._transport = get_transport(self.process_group)
        return self._transport

    def __getstate__(self):
        """Pickled without the process group and the step in flight (as torch's PowerSGDState);
        the default group is used after unpickling."""
        return {k: getattr(self, k) for k in ("stats", "hook", "hook_state", "exact")}

    def __setstate__(self, state):
        self.__init__(state["stats"], state["hook"], state["hook_state"], exact=state["exact"])

    def measure(self, bucket) -> list:
        """Measure one bucket before the inner hook runs; at the last bucket, start the
        step's one small allreduce. Returns the slot for the exact result's squared norm
        (set by the hook's callback, no device sync there)."""
        if bucket.index() == 0:
            self._current = []
        v = self.stats.measure([bucket.buffer()], exact=self.exact)
        result: list = [None]
        self._current.append((v, result))
        if bucket.is_last():
            parts, self._current = self._current, []
            if self.exact:
                vec = torch.stack([m[0] for m, _ in parts]).sum().reshape(1)
            else:
                vec = torch.cat([m for m, _ in parts])
            fut = self.transport.all_reduce(vec, op="mean", async_op=True)
            self._pending = (vec, fut, [m.numel() for m, _ in parts], [r for _, r in parts])
        return result

    def flush(self) -> None:
        """Fold in the last finished step (waits for its small allreduce)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        v, fut, sizes, results = pending
        fut.wait()
        p = self.transport.world_size
        if self.exact:
            self.stats.observe(v[:1], p, sum(float(r[0]) for r in results))
            return
        # per bucket [|g|^2, |x|^2, x]; the buckets' sums add up to the whole gradient's
        local = sub_local = glob = 0.0
        o = 0
        for n in sizes:
            part = v[o:o + n].double()
            local, sub_local, glob = local + float(part[0]), sub_local + float(part[1]), \
                glob + float(part[2:].square().sum())
            o += n
        self.stats.observe(torch.tensor([local, sub_local, math.sqrt(glob)], dtype=torch.float64), p)


def stats_hook(state: StatsHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: `state.hook` with the gradient statistics measured around it
    (see `StatsHookState`)."""
    inner_state = state.hook_state
    if getattr(inner_state, "frozen", False) or state.transport.world_size < 2:
        return state.hook(inner_state, bucket)
    if bucket.index() == 0:
        state.flush()
    result = state.measure(bucket)
    out = state.hook(inner_state, bucket)
    if not state.exact:
        return out

    def record(f):
        res = f.value()
        t = res[0] if isinstance(res, (list, tuple)) else res
        result[0] = torch.linalg.vector_norm(t, dtype=torch.float32).square()
        return res

    return out.then(record)
