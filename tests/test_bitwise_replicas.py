"""Replicas stay bitwise identical on a model whose gradients are mostly exact zeros: an
nn.EmbeddingBag over 4000 rows looked up with Zipf-distributed ids (most rows rarely or
never seen), 4 gloo ranks, each with its own data. Checked where lbcomm averages in full
precision (the transport's allreduce, the optimizer's warmup, the DDP warmup hook) and
after the freeze; parameters are compared by their bytes, gathered from every rank."""
import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lbcomm
from dist_util import run_ranks
from lbcomm.comm.torch_dist import TorchTransport
from lbcomm.ddp import WarmupAverage, warmup_average_hook

ROWS, DIM, BAGS, PER_BAG = 4000, 32, 128, 16


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _zipf_ids(n: int, gen: torch.Generator) -> torch.Tensor:
    weights = torch.arange(1, ROWS + 1, dtype=torch.float64).pow(-1.2)
    return torch.multinomial(weights / weights.sum(), n, replacement=True, generator=gen)


def _batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    ids = _zipf_ids(BAGS * PER_BAG, gen)
    return ids, torch.arange(0, BAGS * PER_BAG, PER_BAG), torch.randn(BAGS, generator=gen)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="mean")
        self.head = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids, offsets):
        return self.head(self.emb(ids, offsets)).squeeze(-1)


def _zipf_gradient(rank: int) -> torch.Tensor:
    """This rank's local gradient of the model's parameters, flat: mostly exact zeros (the
    unseen rows), values of mixed magnitudes elsewhere."""
    torch.manual_seed(0)
    model = _Model()
    ids, offsets, y = _batch(rank, 0)
    ((model(ids, offsets) - y) ** 2).mean().backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _transport_ranks(rank, p):
    tr = TorchTransport()
    g = _zipf_gradient(rank)
    mixed = torch.randn(1_000_003, generator=torch.Generator().manual_seed(rank))
    mixed.mul_(torch.pow(10.0, torch.randint(-20, 20, mixed.shape, generator=torch.Generator().manual_seed(9))))
    mixed[::3] = 0.0
    out = {}
    for name, x in (("zipf", g), ("mixed", mixed)):
        for op, bucket in (("sum", None), ("mean", 1 << 16)):
            t = x.clone()
            tr.all_reduce(t, op=op, bucket_bytes=bucket)
            out[(name, op)] = _digest([t])
    exact = torch.zeros_like(g, dtype=torch.float64)
    for r in range(p):
        exact += _zipf_gradient(r).double()
    t = g.clone()
    tr.all_reduce(t, op="sum")
    out["zipf_error"] = float((t.double() - exact).abs().max() / exact.abs().max())
    out["zipf_zero_fraction"] = float((g == 0).double().mean())
    return out


def test_transport_all_reduce_returns_the_same_bits_on_every_rank():
    results = run_ranks(_transport_ranks, 4)
    assert results[0]["zipf_zero_fraction"] > 0.5  # the gradient is mostly unseen rows
    assert results[0]["zipf_error"] < 1e-6
    for key in results[0]:
        if isinstance(key, tuple):
            assert len({r[key] for r in results}) == 1, f"{key}: the ranks' results differ bitwise"


def _optimizer_ranks(rank, p, kind, ddp):
    torch.manual_seed(0)
    model = _Model()
    params = list(model.parameters())
    comm = lbcomm.CommConfig(exact_numel=64)  # the small head biases averaged exactly after the freeze
    opt = (lbcomm.OneBitAdam(params, lr=1e-3, freeze_step=3, comm=comm) if kind == "adam"
           else lbcomm.OneBitLamb(params, lr=1e-3, freeze_step=3, comm=comm))
    net = model
    if ddp:
        net = DDP(model)
        net.register_comm_hook(WarmupAverage(opt), warmup_average_hook)
    digests = []
    for step in range(5):
        ids, offsets, y = _batch(rank, step)
        opt.zero_grad()
        ((net(ids, offsets) - y) ** 2).mean().backward()
        opt.step()
        digests.append(_digest(params))
    return digests, opt.frozen


def test_onebit_optimizers_keep_embeddingbag_replicas_bitwise_identical():
    for kind, ddp in (("adam", False), ("lamb", False), ("adam", True)):
        results = run_ranks(_optimizer_ranks, 4, kind, ddp)
        assert all(frozen for _, frozen in results), "the run should reach the compression stage"
        for step in range(5):
            got = {digests[step] for digests, _ in results}
            assert len(got) == 1, f"{kind} (ddp={ddp}): the ranks' parameters differ after step {step + 1}"


def _diverging_ranks(rank, p, kind, cause):
    """A model whose parameters the ranks change differently outside the optimizer: the
    embedding's max_norm renormalizes the rows each rank looks up, in place, during the
    forward pass; or each rank initializes the model with its own seed."""
    torch.manual_seed(rank if cause == "seed" else 0)
    model = _Model()
    if cause == "max_norm":
        model.emb.max_norm = 1.0
    cls = lbcomm.OneBitAdam if kind == "adam" else lbcomm.OneBitLamb
    opt = cls(model.parameters(), lr=1e-3, freeze_step=3)
    for step in range(5):
        ids, offsets, y = _batch(rank, step)
        opt.zero_grad()
        ((model(ids, offsets) - y) ** 2).mean().backward()
        try:
            opt.step()
        except lbcomm.errors.ReplicaDivergenceError as exc:
            return step + 1, str(exc)
    return None, None


def test_parameters_changed_outside_the_optimizer_are_caught_after_the_first_step():
    for kind, cause in (("adam", "max_norm"), ("lamb", "max_norm"), ("adam", "seed")):
        for step, msg in run_ranks(_diverging_ranks, 2, kind, cause):
            assert step == 1, (kind, cause, step)
            assert "parameters differ between the 2 ranks" in msg and "max_norm" in msg and "manual_seed" in msg
