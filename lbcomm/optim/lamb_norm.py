"""1-bit LAMB's per-tensor quantities in the compression stage, over the optimizer's
`FlatState` and its `OneBitStage`: the update direction u = clamp(m^ / d, -U, U) [+ wd p]
(`LambNorms.direction`), and the estimate of the norm the uncompressed direction would
have, behind the live trust ratio (`LambNorms.track_and_estimate`, from each rank's own
momentum ``exp_avg_local``, advanced in the same pass; see `OneBitLamb`'s docs)."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import functional as F
from . import kernels as K
from .flat import FlatLayout, Segment

__all__ = ["LambNorms", "estimated_norm", "AT_BOUND", "TRACKED", "PASS_BUDGET", "trust_mode", "samples", "pass_every"]

# the param-group entry (saved with the groups) that says whether the group's exp_avg_local
# was updated at its last compressed step; absent: it was (every group was, before)
TRACKED = "exp_avg_local_tracked"

# |u0| >= U * AT_BOUND counts as clamped: the capped decode leaves coordinates at U within
# a few roundings, on either side
AT_BOUND = 1 - 1e-5


# the coordinates of one parameter the estimate's pass covers at most: a larger one is
# sampled, every k-th run of K.SAMPLE_RUN elements (`pass_every`), and its sums scaled up
PASS_BUDGET = 1 << 17


def pass_every(n: int, sharded: bool) -> int:
    """k for a parameter (or shard) of n elements: the pass covers its runs 0, k, 2k, ... of
    K.SAMPLE_RUN elements, the least k that keeps them within PASS_BUDGET (1: all of it;
    always 1 on a sharded state, whose shards can move between resumes)."""
    if sharded:
        return 1
    return max(1, -(-(-(-n // K.SAMPLE_RUN)) // (PASS_BUDGET // K.SAMPLE_RUN)))


def trust_mode(group) -> str:
    """The group's trust_ratio; a checkpoint saved before the option existed continues with
    the rule it was trained with, "frozen"."""
    return group.get("trust_ratio", "frozen")


def samples(group) -> int:
    """The group's norm_samples (0: the live ratio takes the decoded direction's norm); a
    checkpoint saved before the option existed continues with that rule."""
    return 0 if trust_mode(group) == "frozen" else group.get("norm_samples", 0)


class LambNorms:
    """The direction and the clean-norm estimate of a OneBitLamb (`fs`: its flat state,
    `stage`: its `OneBitStage`); ``scratch_u`` holds the direction of a parameter larger than
    the stage's staging buffer (allocated only for one)."""

    def __init__(self, fs, stage):
        self.fs = fs
        self.stage = stage
        self.scratch_u: Optional[Tensor] = None
        fs.layout_listeners.append(self.on_layout)

    def on_layout(self, old, new) -> None:
        """The flat state's layout changed (a `FlatState` layout listener): a new scratch."""
        self.scratch_u = None

    def direction(self, L: FlatLayout, seg: Segment, i: int, bound: Optional[float], stats: bool = True,
                  norms: bool = False):
        """Parameter i's update direction u = clamp(m^ / d, -U, U) [+ wd p] in the update
        buffer, with (if `stats`) max(d / d~) and, under weight decay and if `stats` or
        `norms`, ||u0|| and ||u|| (1-element tensors) of this rank's elements."""
        m, v, vf = self.fs.buffers["exp_avg"], self.fs.buffers["exp_avg_sq"], self.fs.buffers["exp_avg_sq_fresh"]
        group = self.fs.param_groups[seg.group]
        bc1, bc2 = self.fs.bias_corrections(group, seg)
        eps, wd = group["eps"], group["weight_decay"]
        o, n = L.offsets[i], L.numels[i]
        u_buf, stage = self.update_buffers(L, n)
        u, step = u_buf[:n], stage.numel()
        # d = sqrt(v^) + eps, d~ likewise of the fresh variance, IEEE's roots (as the
        # compression stage's other fused ops); f = max(d / d~); u0 = m^ / d, clamped to
        # [-U, U] per coordinate (max_update): one pass (`kernels.lamb_direction_`)
        ratio_max = None
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            part = K.lamb_direction_(u[lo:hi], m[o + lo:o + hi], v[o + lo:o + hi], vf[o + lo:o + hi] if stats else None,
                                     stage[:hi - lo], bc2 ** 0.5, eps, bc1, bound)
            if stats:
                ratio_max = part if ratio_max is None else torch.maximum(ratio_max, part)
        u0n = un = None
        u = u.view(L.shapes[i])
        if wd != 0:
            u0n = F.norms([u]) if stats or norms else None
            u.add_(L.tensor(i), alpha=wd)
            un = F.norms([u]) if stats or norms else None
        return u, ratio_max, u0n, un


    def track_local_momentum(self, L: FlatLayout, segs, skip=()) -> None:
        """exp_avg_local <- exp_avg_local + (1 - b1) (g - exp_avg_local), this rank's own
        gradients, for the parameters of `segs` not in `skip` (`K.advance_local_`: in fp32,
        rounded once to the buffer's bf16; where torch ops do it, in the staging buffer, idle
        after the reduction), in the groups whose live ratio estimates the norm (`samples`):
        nothing else reads it. A group whose estimate was off at its last compressed step
        (its `TRACKED` entry) and is on again first restarts it from the momentum, as at the
        freeze, for all of its parameters."""
        ml, m = self.fs.buffers["exp_avg_local"], self.fs.buffers["exp_avg"]
        stage = self.stage.stage_buffer(L)
        on, restart = {}, set()
        for g in {seg.group for seg in segs}:
            group = self.fs.param_groups[g]
            on[g] = samples(group) > 0
            if on[g] and not group.get(TRACKED, True):
                restart.add(g)
            group[TRACKED] = on[g]
        for i in (i for i in range(len(L.params)) if L.group_of[i] in restart):
            L.view(ml, i).copy_(L.view(m, i))
        for seg in segs:
            if not on[seg.group]:
                continue
            w = 1 - self.fs.param_groups[seg.group]["betas"][0]
            for i in seg.idx:
                if i in skip:
                    continue
                g = L.grad(i)
                g = None if g is None else g.reshape(-1)
                o, n = L.offsets[i], L.numels[i]
                for lo in range(0, n, stage.numel()):
                    hi = min(n, lo + stage.numel())
                    K.advance_local_(ml[o + lo:o + hi], None if g is None else g[lo:hi], w, stage)

    def estimate_slots(self, L: FlatLayout) -> Optional[Tensor]:
        """Per parameter whose live ratio takes the estimated norm: its norm_samples (a long
        tensor in layout order, 0 for the others); None when no parameter does. Nothing
        to estimate where nothing is compressed: with one rank, and for the parameters
        averaged exactly (exact_numel), the decoded momentum is the clean one."""
        if self.stage.reducer is None:
            return None
        part = self.stage.exact.part(L)
        exact = set() if part is None else {i for i, _ in part[1]}
        k = [samples(self.fs.param_groups[L.group_of[i]]) if on and i not in exact else 0
             for i, on in enumerate(self.stage.participating(L))]
        return torch.tensor(k) if any(k) else None

    def track_and_estimate(self, L: FlatLayout, segs, bounds: List[Optional[float]]):
        """exp_avg_local advanced by this step's gradients (`track_local_momentum`; for the
        parameters estimated, inside their pass), then per parameter (fp64, this rank's
        shard), an estimate of ||u0*||^2 where u0* = clamp(m* / d, -U, U) is the direction
        before weight decay an uncompressed allreduce would give, m* the mean over the ranks
        of exp_avg_local; and the set of the parameters estimated (`estimate_slots`). (None,
        empty) when no parameter needs it. The weight decay's terms of ||u*||^2, 2 wd <u0,
        theta> + wd^2 ||theta||^2 with the decoded u0, are ||u||^2 - ||u0||^2 of the decoded
        direction: the caller adds them from the direction's norms (`wd_terms`).

        The ranks' mean of clamp(m_r / d) is projected on the decoded direction u0 where u0
        is neither clamped nor masked (one scalar per parameter, summed in fp64); where it
        is, the compression error is largest and not independent of u0, so norm_samples of
        those coordinates (the same ones on every rank) are averaged exactly, clamped, and
        their squares scaled up to all of them. One fp32 allreduce of (samples + 1) per
        parameter; one fused pass over each parameter (`kernels.lamb_clean_pass_`), STAGE
        elements at a time (nothing model-sized is allocated), and the sampled coordinates
        found again in their blocks only (`kernels.lamb_edge_find_`). Its u0 = m / (d bc1)
        by a reciprocal, d with IEEE's root: within a few ulps of the direction's. A
        parameter of more than PASS_BUDGET elements (not sharded) is sampled: the pass covers
        every k-th run of K.SAMPLE_RUN elements (`pass_every`), the same runs at every step,
        both sums are scaled by n / the covered elements, and its exp_avg_local is advanced
        in those runs only (docs/optimizers.md gives what that costs and saves).

        The estimate is a (parameters, 5) tensor of parts (`live_sq` combines them): the
        squared norm above; the same with <u0, u0*> in place of ||u0*||^2 on the edge (so
        <u0, u0*> in all); the projection's sum alone; and for the groups whose trust_ratio
        is "aligned", sum z^2 and sum u0 z over norm_samples coordinates drawn uniformly
        from those the pass covers (z = u0* there, u0 the decoded direction), whose ratio
        takes ||u0*||^2 / <u0, u0*> off the edge."""
        slots = self.estimate_slots(L)
        rows = [] if slots is None else [i for i in range(len(L.params)) if slots[i] > 0]
        self.track_local_momentum(L, segs, skip=set(rows))
        if slots is None:
            return None, set()
        dev = self.fs.device_of(L)
        row_of = {i: r for r, i in enumerate(rows)}
        width, uni = self.sent_columns(L, slots)
        sent = torch.zeros(len(rows), width, dtype=torch.float32, device=dev)
        out = torch.zeros(len(L.params), 5, dtype=torch.float64, device=dev)
        number = self.fs.param_indices()  # torch's numbering: the same on every shard
        picked = []
        m, v, ml = (self.fs.buffers[n] for n in ("exp_avg", "exp_avg_sq", "exp_avg_local"))
        for seg in segs:
            group = self.fs.param_groups[seg.group]
            bc1, bc2 = self.fs.bias_corrections(group, seg)
            for i in seg.idx:
                if i not in row_of:  # averaged exactly, or no estimate in this group
                    continue
                r = row_of[i]
                p = _Pass(self, L, i, bounds[i], group, bc1, bc2)
                acc, counts, starts = p.run()
                sent[r, 0] = acc[0]
                n_edge = starts[-1]
                k = min(int(slots[i]), n_edge)
                seed = 1009 * (self.fs.global_step + 1) + number[id(L.params[i])]

                def send(at: Tensor, col: int) -> Tensor:
                    """Puts this rank's y = m_local / (d bc1) at positions `at` into the
                    allreduce from column `col`; returns the decoded u0 there."""
                    at = at.to(dev) + L.offsets[i]
                    q = F.scaled_root(v[at], p.scale, p.eps).mul_(p.bc1)
                    sent[r, col:col + at.numel()] = torch.div(ml[at], q)
                    return _clamp(torch.div(m[at], q), bounds[i])

                u0_edge = send(self._edge_draws(p, counts, starts, k, n_edge, seed), 1) if k else None
                u0_uni = send(p.uniform_draws(int(slots[i]), seed), uni) if trust_mode(group) == "aligned" else None
                picked.append((i, k, n_edge, p.scale_up, u0_edge, u0_uni))
        self.fs.transport.all_reduce(sent, op="sum")
        sent.div_(self.fs.transport.world_size)
        for i, k, n_edge, scale_up, u0_edge, u0_uni in picked:
            r, bound = row_of[i], bounds[i]
            z = _clamp(sent[r, 1:1 + k], bound).double()
            # scale_up: a sampled pass's sums stand for the whole parameter (1.0: passed whole)
            proj = sent[r, 0].double()
            out[i, 0] = (proj + (z.square().sum() * (n_edge / k) if k else 0.0)) * scale_up
            if u0_uni is not None:  # "aligned": <u0, u0*> on the edge, and the uniform draws' sums
                out[i, 1] = (proj + ((u0_edge.double() * z).sum() * (n_edge / k) if k else 0.0)) * scale_up
                out[i, 2] = proj * scale_up
                y = _clamp(sent[r, uni:uni + u0_uni.numel()], bound).double()
                out[i, 3], out[i, 4] = y.square().sum(), (u0_uni.double() * y).sum()
        return out, set(row_of)

    def sent_columns(self, L: FlatLayout, slots: Tensor) -> Tuple[int, int]:
        """(columns of the estimate's allreduce per parameter, the first column of the
        uniform draws): 1 + the edge's norm_samples, and as many again where a group's
        trust_ratio is "aligned"."""
        k = int(slots.max())
        aligned = any(trust_mode(self.fs.param_groups[L.group_of[i]]) == "aligned"
                      for i in range(len(L.params)) if slots[i] > 0)
        return 1 + k + (k if aligned else 0), 1 + k

    @staticmethod
    def _edge_draws(p: "_Pass", counts, starts, k: int, n_edge: int, seed: int) -> Tensor:
        """The positions in the parameter of k of its n_edge edge coordinates (all of them
        when k = n_edge), the same draw on every rank: the decoded u0, and so the edge, is."""
        if n_edge > k:
            draws = torch.randint(n_edge, (k,), generator=torch.Generator().manual_seed(seed))
        else:
            draws = torch.arange(n_edge)
        return p.positions(counts, starts, draws.to(p.m.device))

    @staticmethod
    def live_sq(parts: Tensor, wd_terms, aligned: bool) -> Tensor:
        """The squared norm the live ratio divides by, from `track_and_estimate`'s parts of a
        parameter (summed over shards) and the weight decay's terms W: the clean direction's
        ||u*||^2 = ||u0*||^2 + W; "aligned": u's length along u*, <u, u*> / ||u*||, squared,
        with ||u0*||^2 off the edge taken as rho <u0, u0*>, rho = sum z^2 / sum u0 z of the
        uniform draws (1 where that is not positive), and ||u*||^2 where <u, u*> is not
        positive. Along u* the step is then Lamb's: the error feedback holds back part of
        each step's signal, so <u, u*> < ||u*||^2 and a step of ||theta|| along u covers less
        than ||theta|| along u*."""
        clean = parts[0] + wd_terms
        if not aligned:
            return clean
        rho = parts[3] / parts[4] if parts[4] > 0 else torch.ones((), dtype=parts.dtype)
        sq = parts[0] + (rho - 1) * parts[2] + wd_terms
        dot = parts[1] + wd_terms
        return dot.square() / sq if dot > 0 and sq > 0 else clean

    @staticmethod
    def wd_terms(u0n: Tensor, un: Tensor) -> Tensor:
        """||u||^2 - ||u0||^2 (fp64) from the decoded direction's norms before (u0n) and after
        (un) its weight decay: 2 wd <u0, theta> + wd^2 ||theta||^2, the weight decay's part
        of the estimated ||u*||^2 (to fp32 rounding of the norms, far below the estimate's
        own error)."""
        return un.double().square() - u0n.double().square()

    def update_buffers(self, L: FlatLayout, n: int) -> Tuple[Tensor, Tensor]:
        """(u, d): where a parameter of n elements holds its whole direction (its norms need
        all of it) and where its denominator is staged. The stage's staging buffer, idle
        after the reduction, holds u when it has room, and d goes through a transient
        quarter of a stage; a larger parameter's u takes ``scratch_u`` (the largest
        parameter's size) and d the staging buffer. The elementwise operations are the
        same in any staging: the direction's bits do not depend on it."""
        stage = self.stage.stage_buffer(L)
        if n <= stage.numel():
            return stage, torch.empty(max(1, min(n, F.STAGE // 4)), dtype=torch.float32, device=stage.device)
        if self.scratch_u is None:
            self.scratch_u = torch.empty(max(L.numels, default=0), dtype=torch.float32, device=stage.device)
        return self.scratch_u, stage


def estimated_norm(sq: Tensor, un: Tensor, group) -> Tensor:
    """The live ratio's ||u*||: the estimate's root, at least 0.1 ||u|| and, under
    norm_step_bound tau, at least ||u|| / max(1, tau / lr_peak), lr_peak the largest lr
    of the group in the compression stage: the coefficient is at most that factor times
    the decoded direction's, so a layer's step is at most max(lr, tau lr / lr_peak)
    ||theta||, and shrinks with the schedule. `un` = ||u|| of the decoded direction."""
    un64 = un.double()
    est = torch.sqrt(torch.maximum(sq, 0.01 * un64.square()))
    tau = group.get("norm_step_bound")
    if tau is not None:
        est = torch.maximum(est, un64 / max(1.0, tau / max(group["lr"], group.get("lr_peak", 0.0))))
    return est.float().reshape(1)


def _clamp(x: Tensor, bound: Optional[float]) -> Tensor:
    return x if bound is None else x.clamp(-bound, bound)


class _Pass:
    """The clean-norm pass over parameter i of a `LambNorms`, about STAGE elements at a
    time, and the search for its sampled edge coordinates, with the same arguments. With
    every > 1 (`pass_every`) the pass covers every every-th run of K.SAMPLE_RUN elements;
    each range then starts on a covered run, and ``scale_up`` is n / the covered elements."""

    def __init__(self, norms: LambNorms, L: FlatLayout, i: int, bound: Optional[float], group, bc1: float,
                 bc2: float):
        fs = norms.fs
        self.m, self.v, self.ml = (fs.buffers[n] for n in ("exp_avg", "exp_avg_sq", "exp_avg_local"))
        self.L, self.i, self.bound, self.group = L, i, bound, group
        self.mask = norms.stage.masks
        self.bc1, self.scale, self.eps = bc1, bc2 ** 0.5, group["eps"]
        self.edge_at = 0.0 if bound is None else bound * AT_BOUND
        self.o, self.n = L.offsets[i], L.numels[i]
        self.every = every = pass_every(self.n, fs.sharded())
        stride = K.SAMPLE_RUN * every
        step = max(stride, F.STAGE // stride * stride) if every > 1 else F.STAGE
        self.ranges = [(lo, min(self.n, lo + step)) for lo in range(0, self.n, step)]
        last = (-(-self.n // stride) - 1) * stride  # the last covered run's start
        self.covered = covered = last // stride * K.SAMPLE_RUN + min(K.SAMPLE_RUN, self.n - last)
        self.stride = stride
        self.scale_up = self.n / covered if every > 1 else 1.0

    def uniform_draws(self, k: int, seed: int) -> Tensor:
        """k positions drawn uniformly from the covered coordinates (all of them when there
        are at most k), the same on every rank: the j-th covered coordinate is in run
        j // SAMPLE_RUN, the runs `stride` apart."""
        if self.covered > k:
            j = torch.randint(self.covered, (k,), generator=torch.Generator().manual_seed(seed + (1 << 32)))
        else:
            j = torch.arange(self.covered)
        return j // K.SAMPLE_RUN * self.stride + j % K.SAMPLE_RUN

    def _masked(self, lo: int, hi: int) -> Optional[Tensor]:
        if self.mask.mask is None:
            return None
        out = torch.zeros(hi - lo, dtype=torch.bool, device=self.m.device)
        self.mask.mark(out, self.o + lo, self.o + hi)
        return out

    def run(self):
        """exp_avg_local advanced by the gradient (in the covered runs: nothing reads the
        others while the layout stands) and (acc, counts, starts): acc (fp64) = (sum
        off the edge of clamp(m_local / (d bc1)) u0, edge count); counts[c]: range c's
        per-block edge counts; starts[c]: the edge coordinates before range c (starts[-1]:
        all)."""
        L, o, n = self.L, self.o, self.n
        g = L.grad(self.i)
        g = None if g is None else g.reshape(-1)
        w = 1 - self.group["betas"][0]
        acc = torch.zeros(2, dtype=torch.float64, device=self.m.device)
        counts, starts = [], [0]
        for lo, hi in self.ranges:
            c = torch.empty(-(-(hi - lo) // K.EDGE_BLOCK), dtype=torch.int64, device=self.m.device)
            ml = self.ml[o + lo:o + hi]
            if g is None:  # no gradient: the momentum decays
                K.advance_local_(ml, None, w)
            K.lamb_clean_pass_(acc, c, self.m[o + lo:o + hi], self.v[o + lo:o + hi], ml,
                               None if g is None else g[lo:hi], w, self._masked(lo, hi), self.bc1, self.scale,
                               self.eps, self.bound, self.edge_at, self.every)
            counts.append(c)
            starts.append(int(acc[1]))
        return acc, counts, starts

    def positions(self, counts: List[Tensor], starts: List[int], draws: Tensor) -> Tensor:
        """The indices in the parameter of its draws-th edge coordinates (in draws' order)."""
        o, out = self.o, torch.empty_like(draws)
        for c, (lo, hi) in enumerate(self.ranges):
            if len(counts) == 1:  # one range: every draw is in it
                sel, local, found = None, draws, out
            else:
                sel = ((draws >= starts[c]) & (draws < starts[c + 1])).nonzero().view(-1)
                if not sel.numel():
                    continue
                local, found = draws[sel] - starts[c], torch.empty_like(sel)
            K.lamb_edge_find_(found, local, counts[c], self.m[o + lo:o + hi], self.v[o + lo:o + hi],
                              self._masked(lo, hi), self.bc1, self.scale, self.eps, self.bound, self.edge_at)
            if sel is not None:
                out[sel] = found + lo
        return out
