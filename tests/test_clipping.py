"""Gradient clipping with the lbcomm optimizers (`clip_grad_norm_`): one norm on every rank,
one scalar allreduce, the averaged gradient keeps its direction and stays within max_norm;
with gradients already averaged it is torch.nn.utils.clip_grad_norm_ bitwise. 2 gloo ranks."""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import lbcomm
from dist_util import run_ranks
from lbcomm.ddp import WarmupAverage, warmup_average_hook
from optim_util import OPTS, _loss, _mlp

FREEZE, MAX = 2, 0.05


def _flat(model):
    return torch.cat([q.grad.reshape(-1) for q in model.parameters()])


def _clip(rank, p):
    out = {}
    for name, cls in {**OPTS, "plain_lamb": lbcomm.Lamb}.items():
        model = _mlp(seed=3)
        kw = {} if name == "plain_lamb" else dict(freeze_step=FREEZE)
        opt = cls(model.parameters(), lr=1e-2, **kw)
        steps = []
        for t in range(FREEZE + 2):
            opt.zero_grad()
            _loss(model, rank, t).backward()
            before = _flat(model).clone()
            everyone = [torch.empty_like(before) for _ in range(p)]
            dist.all_gather(everyone, before)
            norm = opt.clip_grad_norm_(MAX)
            steps.append({"frozen": opt.frozen, "norm": norm.clone(), "before": everyone,
                          "after": _flat(model).clone()})
            opt.step()
        out[name] = steps
    # warmup with lbcomm's hook: the gradients are averaged already, torch's clipping exactly
    model = _mlp(seed=3)
    ddp = DDP(model)
    opt = lbcomm.OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=5)
    ddp.register_comm_hook(WarmupAverage(opt), warmup_average_hook)
    twin = _mlp(seed=3)
    _loss(ddp, rank, 0).backward()
    for a, b in zip(twin.parameters(), model.parameters()):
        a.grad = b.grad.clone()
    out["hook"] = {"norm": opt.clip_grad_norm_(MAX), "grads": _flat(model),
                   "torch_norm": torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX), "torch_grads": _flat(twin)}
    return out


@pytest.fixture(scope="module")
def clipped():
    return run_ranks(_clip, 2, timeout=180)


@pytest.mark.parametrize("name", ["adam", "lamb", "plain_lamb"])
def test_local_gradients_are_clipped_by_one_norm(clipped, name):
    for t, (s0, s1) in enumerate(zip(clipped[0][name], clipped[1][name])):
        assert torch.equal(s0["norm"], s1["norm"]), t  # identical on every rank
        local = torch.stack([g.norm() for g in s0["before"]])
        assert torch.allclose(s0["norm"], local.square().mean().sqrt(), rtol=1e-5), t
        mean = torch.stack(s0["before"]).mean(0)
        assert s0["norm"] >= mean.norm() * (1 - 1e-5)  # an upper bound of the averaged gradient's norm
        coef = min(1.0, MAX / (float(s0["norm"]) + 1e-6))
        assert coef < 1, "the test must clip"
        for r, s in enumerate((s0, s1)):  # every rank scaled by the same coefficient
            torch.testing.assert_close(s["after"], s["before"][r] * coef, rtol=1e-5, atol=1e-8)
        avg = (s0["after"] + s1["after"]) / 2
        assert avg.norm() <= MAX * (1 + 1e-5)
    if name != "plain_lamb":
        assert [s["frozen"] for s in clipped[0][name]] == [False] * FREEZE + [True] * 2


def test_averaged_gradients_are_clipped_like_torch(clipped):
    for r in range(2):
        h = clipped[r]["hook"]
        assert torch.equal(h["norm"], h["torch_norm"]) and torch.equal(h["grads"], h["torch_grads"])


def test_only_the_two_norm():
    opt = lbcomm.OneBitAdam(_mlp().parameters())
    with pytest.raises(ValueError, match="only norm_type=2.0"):
        opt.clip_grad_norm_(1.0, norm_type=float("inf"))
    assert float(opt.clip_grad_norm_(1.0)) == 0.0  # no gradients yet: nothing to clip
