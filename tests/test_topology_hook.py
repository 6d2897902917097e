"""lbcomm.onebit_hook on a topology (2 nodes x 2 gloo ranks, from a DeviceMesh or from
torchrun's variables): DDP's gradients bitwise those of hierarchical_allreduce_ by hand,
identical replicas, the bytes it reports, and a resume from the hook's state_dict bitwise
the run that never stopped (also with exact_numel)."""
import os

import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks
from lbcomm.topology import HierarchicalState, hierarchical_allreduce_
from topology_util import G, N, mesh_topology


def _hook_training(rank, p, how):
    """DDP + onebit_hook on a topology; beside it the same local gradients reduced by
    hand with hierarchical_allreduce_ on a state of their own: bitwise the same."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lbcomm

    if how == "auto":
        os.environ.update(LOCAL_WORLD_SIZE=str(G), WORLD_SIZE=str(p), LOCAL_RANK=str(rank % G))
        topo = "auto"
    else:
        topo = mesh_topology(N, G)
    torch.manual_seed(0)
    lin = torch.nn.Linear(37, 29, bias=False)  # one parameter: one bucket
    shadow = torch.nn.Linear(37, 29, bias=False)
    shadow.load_state_dict(lin.state_dict())
    model = DDP(lin)
    # normalize=None: the published compression, which the reference below runs
    state = lbcomm.OneBitHookState(2, normalize=None, comm=lbcomm.CommConfig(block_size=64, topology=topo, exact_numel=0))
    model.register_comm_hook(state, lbcomm.onebit_hook)
    ref_topo = mesh_topology(N, G)
    ref = HierarchicalState(lin.weight.numel(), ref_topo, block_size=64, nonfinite="skip")
    opt = torch.optim.SGD(model.parameters(), lr=4.0)
    target = torch.randn(29, 37, generator=torch.Generator().manual_seed(7))
    losses, same = [], []
    for step in range(20):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(16, 37, generator=g)
        y = x @ target.T
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        shadow.zero_grad()
        torch.nn.functional.mse_loss(shadow(x), y).backward()
        want = shadow.weight.grad.clone()
        if step >= 2:  # the hook compresses from iteration start_iter on
            hierarchical_allreduce_(want, ref)
        else:
            dist.all_reduce(want)
            want /= p
        same.append(torch.equal(lin.weight.grad, want))
        opt.step()
        with torch.no_grad():
            shadow.weight.copy_(lin.weight)
        losses.append(loss.item())
    stats = state.compression_stats()
    return {"weight": lin.weight.detach().clone(), "losses": losses, "same": same, "stats": stats,
            "hier": state.hier_topology is not None, "bytes": ref.bytes_per_call()}


@pytest.mark.parametrize("how", ["mesh", "auto"])
def test_onebit_hook_with_topology(how):
    res = run_ranks(_hook_training, 4, how, timeout=300)
    for r in res:
        assert r["hier"] and all(r["same"]), r["same"]
        assert torch.equal(r["weight"], res[0]["weight"])  # replicas identical
        assert r["stats"]["compressed_calls"] == 18
    mean_loss = [sum(r["losses"][t] for r in res) / 4 for t in range(20)]
    assert mean_loss[-1] < 0.5 * mean_loss[0], mean_loss
    # bytes_sent counts the inter-node 1-bit stage: 18 compressed calls, 2 full-precision ones
    full = res[0]["stats"]["bytes_uncompressed"] / 20
    assert res[0]["stats"]["bytes_sent"] == 2 * full + 18 * res[0]["bytes"]


def _hook_resume(rank, p):
    """onebit_hook with a topology: a run resumed from every rank's hook state_dict
    continues bitwise as the run that never stopped; also with exact_numel (the biases
    averaged exactly beside the hierarchical call)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lbcomm

    def run(steps, saved=None, save_at=None, exact_numel=0):
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(13, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5)))
        if saved is not None:
            model.module.load_state_dict(saved["model"])
        state = lbcomm.OneBitHookState(2, comm=lbcomm.CommConfig(block_size=32, topology=mesh_topology(N, G),
                                                                 exact_numel=exact_numel))
        if saved is not None:
            state.load_state_dict(saved["hook"])
        model.register_comm_hook(state, lbcomm.onebit_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        first = 0 if saved is None else saved["step"]
        snapshot = None
        for step in range(first, steps):
            x = torch.randn(8, 13, generator=torch.Generator().manual_seed(50 * rank + step))
            loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x[:, :5]))
            opt.zero_grad()
            loss.backward()
            opt.step()  # plain SGD: no optimizer state to carry
            if step + 1 == save_at:
                snapshot = {"model": {k: v.clone() for k, v in model.module.state_dict().items()},
                            "hook": state.state_dict(), "step": save_at}
        errors = []  # per unit: (largest |worker error| at exact coordinates, elsewhere) of this rank's slice
        for unit in state.planner.units():
            st, index = unit.compression, unit.exact[1] if unit.exact else None
            if index is not None:
                lo, hi = st.span
                err = st.worker_error.reshape(-1)[:hi - lo]
                at = torch.zeros(hi - lo, dtype=torch.bool)
                at[index[(index >= lo) & (index < hi)] - lo] = True
                errors.append((float(err[at].abs().max()) if bool(at.any()) else 0.0, float(err[~at].abs().max())))
        return {k: v.clone() for k, v in model.module.state_dict().items()}, snapshot, errors

    out = {}
    for exact in (0, 64):  # 64: the two biases (40 and 5 elements) exact, the weights compressed
        whole, snap, errors = run(8, save_at=4, exact_numel=exact)
        resumed, _, _ = run(8, saved=snap, exact_numel=exact)
        out[exact] = (all(torch.equal(whole[k], resumed[k]) for k in whole), whole, errors)
    return out


def test_onebit_hook_with_topology_resumes_bitwise():
    res = run_ranks(_hook_resume, 4, timeout=300)
    for exact in (0, 64):
        assert all(r[exact][0] for r in res), f"exact_numel={exact}: a resumed rank differs"
        for r in res[1:]:  # replicas identical
            assert all(torch.equal(v, r[exact][1][k]) for k, v in res[0][exact][1].items())
    # the exact biases change the run (they are not compressed), the weights too through them
    assert not torch.equal(res[0][0][1]["0.bias"], res[0][64][1]["0.bias"])
    # the exact coordinates' errors are held at zero in every rank's slice, the others' not
    for r in res:
        assert r[64][2] and all(at == 0.0 and elsewhere > 0.0 for at, elsewhere in r[64][2]), r[64][2]
