"""HSDP with 1 bit across nodes (lbcomm.fsdp) on 4 real gloo ranks as 2 nodes x 2: FSDP2
shards inside the node; the all-reduce hook compresses each parameter group's gradient
shard across the nodes. Checked: every hook call equals the plain-torch reference of the
compressed allreduce step by step (error feedback included), the hook's input is the
node's mean gradient shard of a pure-torch replica, replicas stay identical, loss falls;
with exact_numel (the biases' shards averaged exactly, their errors zero) likewise, and with
a full-precision start and normalize="warmup" (weights from the start's mean squares)."""
import pytest
import torch

from dist_util import run_ranks
from lbcomm.testing import kernels as reference
from lbcomm.config import CommConfig

N, G = 2, 2
STEPS = 20
BLOCK = 64


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 16, generator=g)
    return x, torch.sin(x[:, :8] * 2)


EXACT = 100  # the biases (48 and 8 elements) exact, the weights (768 and 384) compressed
START = 5
# scenario -> (exact_numel, start_iter, normalize)
RUNS = {"published": (0, 0, None), "exact": (EXACT, 0, "warmup"), "start": (EXACT, START, "warmup")}


def _train(rank, p, exact_numel=0, start_iter=0, normalize=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lbcomm import fsdp

    mesh = init_device_mesh("cpu", (N, G), mesh_dim_names=("node", "local"))
    model, replica = _model(), _model()
    fully_shard(model[0], mesh=mesh["local"])
    fully_shard(model[2], mesh=mesh["local"])
    fully_shard(model, mesh=mesh["local"])
    state = fsdp.onebit_hsdp(model, mesh, start_iter=start_iter, normalize=normalize,
                             comm=CommConfig(block_size=BLOCK, exact_numel=exact_numel))
    records = {}

    def recording(key):
        def hook(out):
            before = out.clone()
            fsdp._hook(state, key, out)  # what onebit_hsdp registered, with the inputs recorded
            st = state.states.get(key)  # none during the full-precision start
            errors = (None, None) if st is None else (st.worker_error.clone(), st.server_error.clone())
            records.setdefault(key, []).append((before, out.clone(), *errors))
        return hook

    for name in ("0", "2"):
        model.get_submodule(name).set_all_reduce_hook(recording(name))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ropt = torch.optim.SGD(replica.parameters(), lr=0.5)
    losses, local_grads = [], []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        # the replica: this rank's local gradient of the same parameters (pure torch)
        ropt.zero_grad()
        torch.nn.functional.mse_loss(replica(x), y).backward()
        local_grads.append({name: replica.get_submodule(name).weight.grad.clone() for name in ("0", "2")})
        opt.step()
        with torch.no_grad():  # keep the replica on the FSDP parameters
            for name in ("0", "2"):
                for pname in ("weight", "bias"):
                    full = getattr(model.get_submodule(name), pname).full_tensor()
                    getattr(replica.get_submodule(name), pname).copy_(full)
        losses.append(loss.item())
    shards = {n: t.to_local().clone() for n, t in model.state_dict().items()}
    full = {n: t.full_tensor().clone() for n, t in model.state_dict().items()}
    return {"records": records, "losses": losses, "shards": shards, "full": full, "local_grads": local_grads,
            "calls": dict(state.calls)}


def _all(rank, p):
    return {name: _train(rank, p, *cfg) for name, cfg in RUNS.items()}


@pytest.fixture(scope="module")
def trained():
    return run_ranks(_all, N * G, timeout=600)


def _exact_index(key):
    """The bias's coordinates in group `key`'s reduce-scatter output: FSDP2 concatenates each
    parameter's dim-0 shard, padded to ceil(rows / G) rows."""
    lin = _model().get_submodule(key)
    rows = -(-lin.out_features // G)
    return torch.arange(rows * lin.in_features, rows * lin.in_features + rows)


@pytest.mark.parametrize("run", list(RUNS))
def test_onebit_hsdp_equals_reference_and_keeps_replicas_identical(trained, run):
    p = N * G
    exact, start, normalize = RUNS[run]
    res = [r[run] for r in trained]
    for r in range(p):  # parameters identical everywhere (full) and across nodes (shards)
        for n in res[0]["full"]:
            assert torch.equal(res[r]["full"][n], res[0]["full"][n]), n
            assert torch.equal(res[r]["shards"][n], res[r % G]["shards"][n]), n
    for key in ("0", "2"):
        assert all(r["calls"][key] == STEPS for r in res)
        for l in range(G):  # cross group l: ranks l and G + l hold the same shard
            ranks = [a * G + l for a in range(N)]
            m = res[ranks[0]]["records"][key][-1][2].numel() // N
            we = [torch.zeros(N, m) for _ in ranks]
            se = [torch.zeros(m) for _ in ranks]
            ratios, sumsq = [], 0.0
            for t in range(STEPS):
                inputs = [res[r]["records"][key][t][0] for r in ranks]
                if t < start:  # full precision; the mean's squares make the weights
                    want = torch.stack(inputs).sum(0) / N
                    sumsq = sumsq + want * want
                    for r in ranks:
                        torch.testing.assert_close(res[r]["records"][key][t][1], want, rtol=1e-6, atol=1e-7)
                    continue
                w = None
                if start and normalize == "warmup":  # RMS over the start, floored at 0.1 x its RMS, bf16
                    rms = (sumsq / start).sqrt()
                    w = torch.maximum(rms, 0.1 * rms.square().mean().sqrt())
                    w = torch.where(w > 0, w, 1.0).to(torch.bfloat16)
                want, we, se = reference.compressed_allreduce(inputs, we, se, BLOCK, weights=w)
                if exact:  # the exact mean there, both errors held at zero
                    e = _exact_index(key)
                    want[e] = torch.stack(inputs).sum(0)[e] / N
                    for a in range(N):
                        we[a].view(-1)[e] = 0.0
                        served = e[(e >= a * m) & (e < (a + 1) * m)] - a * m
                        se[a][served] = 0.0
                for i, r in enumerate(ranks):
                    _, out, e, s = res[r]["records"][key][t]
                    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
                    torch.testing.assert_close(e, we[i].reshape(-1), rtol=1e-5, atol=1e-6)
                    torch.testing.assert_close(s, se[i], rtol=1e-5, atol=1e-6)
                # the hook's input is the node's mean of this shard of the local gradients
                # (FSDP's reduce-scatter; its scaling is one constant factor)
                for a, r in enumerate(ranks):
                    node = [res[a * G + j]["local_grads"][t][key] for j in range(G)]
                    mean = torch.stack(node).mean(0).reshape(-1)
                    shard = mean.numel() // G
                    sim = mean[l * shard:(l + 1) * shard]
                    got = inputs[a][:shard]
                    ratios.append((got.double().norm() / sim.double().norm()).item())
                    torch.testing.assert_close(got / ratios[-1], sim, rtol=1e-4, atol=1e-6)
            assert max(ratios) - min(ratios) < 1e-4 * max(ratios), ratios
    mean_loss = [sum(r["losses"][t] for r in res) / p for t in range(STEPS)]
    assert mean_loss[-1] < 0.75 * mean_loss[0], mean_loss  # 20 steps of SGD: the loss falls


def _refused(rank, p):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lbcomm import fsdp

    mesh = init_device_mesh("cpu", (N, G), mesh_dim_names=("node", "local"))
    model = fully_shard(_model(), mesh=mesh)  # native HSDP: full-precision all-reduce of its own
    with pytest.raises(ValueError, match="native HSDP"):
        fsdp.onebit_hsdp(model, mesh)
    with pytest.raises(ValueError, match="no FSDP module"):
        fsdp.onebit_hsdp(_model(), mesh)
    return True


def test_onebit_hsdp_refuses_native_hsdp():
    assert all(run_ranks(_refused, N * G, timeout=300))


def _resume(rank, p, ckpt):
    """onebit_hsdp with a start, weights and exact shards, AdamW: 12 steps straight, and 6 +
    a resume from per-rank files (model shards, optimizer, hook state) + 6; and a DCP resume
    that restores the model and the optimizer but forgets the hook state: warned, naming it."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lbcomm import fsdp
    from lbcomm.ddp import MissingHookStateWarning

    mesh = init_device_mesh("cpu", (N, G), mesh_dim_names=("node", "local"))

    def build():
        model = _model()
        fully_shard(model[0], mesh=mesh["local"])
        fully_shard(model[2], mesh=mesh["local"])
        fully_shard(model, mesh=mesh["local"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = fsdp.onebit_hsdp(model, mesh, start_iter=3, optimizer=opt,
                                 comm=CommConfig(block_size=BLOCK, exact_numel=EXACT))
        return model, opt, state

    def run(model, opt, steps):
        for step in steps:
            x, y = _batch(rank, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    model, opt, state = build()
    run(model, opt, range(6))
    path = f"{ckpt}/rank{rank}.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hsdp": state.state_dict()}, path)
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=f"{ckpt}/dcp")  # the hook state left out
    run(model, opt, range(6, 12))
    straight = [q.to_local().clone() for q in model.parameters()]
    saved_weights = sorted(state.state_dict()["weights"])
    stats = state.compression_stats()
    sd = torch.load(path, weights_only=False)
    warned = {}
    for restore_hook in (True, False):
        model, opt, state = build()
        if restore_hook:  # the per-rank files, the hook state included
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["opt"])
            state.load_state_dict(sd["hsdp"])
        else:  # a DCP resume of the model and the optimizer only
            model_sd, opt_sd = get_state_dict(model, opt)
            dcp.load({"model": model_sd, "optim": opt_sd}, checkpoint_id=f"{ckpt}/dcp")
            set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=opt_sd)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(model, opt, range(6, 12))
        warned[restore_hook] = [str(w.message) for w in caught if issubclass(w.category, MissingHookStateWarning)]
        if restore_hook:
            resumed = [q.to_local().clone() for q in model.parameters()]
    return all(torch.equal(a, b) for a, b in zip(straight, resumed)), saved_weights, warned, stats


def test_onebit_hsdp_resumes_bitwise(tmp_path):
    res = run_ranks(_resume, N * G, str(tmp_path), timeout=600)
    assert all(same for same, *_ in res), res
    assert all(weights == ["0", "2"] for _, weights, *_ in res), res  # the start's weights were saved and reloaded
    for _, _, warned, stats in res:
        assert warned[True] == [], warned  # restored with the model and optimizer: nothing to say
        (msg,) = warned[False]  # forgotten: named once, at the first hook call
        assert "OneBitHSDPState was not restored" in msg and "RankLocal" in msg, msg
        # plain numbers: 2 groups x 12 calls, 3 of each at full precision
        assert stats["calls"] == 24 and stats["compressed_calls"] == 18 and stats["skipped_calls"] == 0, stats
        assert all(type(v) in (int, float) for v in stats.values()) and stats["bytes_sent"] > 0, stats


def test_hsdp_state_takes_comm_and_redistributes_like_compression_state():
    """OneBitHSDPState: the communication settings in CommConfig (its process group is the
    mesh's), and the error feedback saved by 2 nodes x 2 ranks onto 3 nodes x 2 ranks: each
    rank's groups from the saved ranks of its shard, by CompressionState.redistribute."""
    from lbcomm import fsdp
    from lbcomm.compressed import CompressionState, chunk_size

    with pytest.raises(ValueError, match="replicate group"):
        fsdp.OneBitHSDPState(None, comm=CommConfig(process_group=object()))
    with pytest.raises(ValueError, match="start_iter"):
        fsdp.OneBitHSDPState(None, start_iter=-1)
    state = fsdp.OneBitHSDPState(None)
    assert state.comm == CommConfig() and state.compression_stats() == {
        "calls": 0, "compressed_calls": 0, "skipped_calls": 0, "bytes_sent": 0, "error_norm": 0.0, "error_ratio": 0.0}
    n, old = 10, 2
    m = chunk_size(n, old)
    saved = []
    for r in range(N * G):  # node-major: world rank = node * G + shard index
        node, shard = divmod(r, G)
        comp = {"numel": n, "world_size": old, "rank": node, "block_size": BLOCK,
                "worker_error": torch.full((old, m), 10.0 * shard + node), "server_error": torch.full((m,), r + 0.5)}
        saved.append({"states": {"0": comp}, "replicate": (old, node)})
    for world_rank in range(3 * G):
        node, shard = divmod(world_rank, G)
        got = fsdp._redistribute(saved, (3, node), (3 * G, world_rank))["0"]
        want = CompressionState.redistribute([saved[a * G + shard]["states"]["0"] for a in range(old)], 3, node)
        assert all(torch.equal(got[k], want[k]) if torch.is_tensor(want[k]) else got[k] == want[k] for k in want)
    with pytest.raises(ValueError, match="ranks per node"):
        fsdp._redistribute(saved, (2, 0), (6, 0))
