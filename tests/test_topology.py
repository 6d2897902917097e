"""The hierarchical compressed allreduce (lbcomm.topology) on 4 real gloo ranks as 2 nodes
x 2: step by step equal to the plain-torch reference (lbcomm.testing.kernels.hierarchical_allreduce),
the error-feedback invariant of the module docs over 20+ calls, bitwise identical results
on every rank, the degenerate topologies equal to the flat call, non-finite inputs."""
import os

import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks
from lbcomm.testing import kernels as reference
from lbcomm.compressed import CompressionState, NonFiniteError, compressed_allreduce_
from lbcomm.topology import HierarchicalState, Topology, hierarchical_allreduce_, slice_spans
from lbcomm.wire import chunk_size

N, G = 2, 2
STEPS = 21


def _input(t, r, n, dtype):
    g = torch.Generator().manual_seed(1000 * t + r)
    scale = 1.0 + (t % 5)  # magnitudes change between calls
    x = torch.randn(n, generator=g) * scale
    x[: n // 7] *= 0.01  # a small-magnitude region (block scales matter)
    return x.to(dtype)


def _mesh_topology(nodes, local):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (nodes, local), mesh_dim_names=("node", "local"))
    return Topology.from_mesh(mesh)


def _explicit_topology(rank, p):
    local_group = cross_group = None
    for a in range(p // G):
        g = dist.new_group(list(range(a * G, (a + 1) * G)))
        if a == rank // G:
            local_group = g
    for l in range(G):
        g = dist.new_group(list(range(l, p, G)))
        if l == rank % G:
            cross_group = g
    return Topology(local_group, cross_group, intra_node="group")  # slices through gloo's sockets


def _run_steps(rank, p, n, block, dtype, how):
    if how == "mesh":
        topo = _mesh_topology(N, G)
    elif how == "env":
        os.environ.update(LOCAL_WORLD_SIZE=str(G), WORLD_SIZE=str(p), LOCAL_RANK=str(rank % G))
        topo = Topology.auto()
    else:
        topo = _explicit_topology(rank, p)
    assert (topo.nodes, topo.local_size, topo.node, topo.local_rank) == (N, G, rank // G, rank % G)
    assert topo.intra_node == ("group" if how == "explicit" else "shm")
    st = HierarchicalState(n, topo, block_size=block)
    steps = []
    for t in range(STEPS):
        x = _input(t, rank, n, dtype)
        y = x.clone()
        if t % 3 == 0:
            assert hierarchical_allreduce_(y, st) is y and not st.last_skipped
        elif t % 3 == 1:  # the same schedule, chained through future callbacks
            assert hierarchical_allreduce_(y, st, async_op=True).wait() is y and not st.last_skipped
        else:  # the Reducer call, asynchronous, into another tensor
            y = torch.empty_like(x)
            assert st.reduce_(x, y, async_op=True).wait() is True and not st.last_skipped
        steps.append({"out": y.clone(), "worker": st.worker_error.clone(), "server": st.server_error.clone()})
    flat = CompressionState(n, block_size=block)  # layout only: what the flat call would send
    # rows only (checked=True): the finiteness agreement is one small allreduce per call either way
    return {"steps": steps, "span": st.span, "bytes": st.bytes_per_call(checked=True),
            "intra": st.intra_node_bytes_per_call(), "flat_bytes": flat.bytes_per_call(checked=True)}


@pytest.mark.parametrize("n,block,dtype,how", [
    (5003, 2048, torch.float32, "mesh"),  # odd size, default block size
    (1000, None, torch.float32, "explicit"),  # the published single-scale algorithm
    (777, 64, torch.float16, "env"),  # torchrun's LOCAL_WORLD_SIZE; half input
    (4099, 256, torch.bfloat16, "mesh"),
    (40, 32, torch.float32, "mesh"),  # slice 1 holds 8 elements, padded for the cross group
])
def test_hierarchical_equals_reference_and_invariant(n, block, dtype, how):
    p = N * G
    res = run_ranks(_run_steps, p, n, block, dtype, how, timeout=300)
    L = chunk_size(n, G)
    spans = slice_spans(n, G)
    assert [r["span"] for r in res] == [spans[r % G] for r in range(p)]
    # errors of the reference, indexed [l][a] (cross group l, node a), all zero at first
    worker, server = [], []
    for lo, hi in spans:
        m = chunk_size(hi - lo, N)
        worker.append([torch.zeros(N, m) for _ in range(N)])
        server.append([torch.zeros(m) for _ in range(N)])
    total_out = torch.zeros(n, dtype=torch.float64)
    total_mean = torch.zeros(n, dtype=torch.float64)
    for t in range(STEPS):
        xs = [[_input(t, a * G + l, n, dtype) for l in range(G)] for a in range(N)]
        want, worker, server = reference.hierarchical_allreduce(xs, worker, server, block)
        outs = [r["steps"][t]["out"] for r in res]
        for r in range(1, p):  # bitwise identical on every rank
            assert torch.equal(outs[r], outs[0]), (t, r)
        torch.testing.assert_close(outs[0].float(), want.to(dtype).float(), rtol=1e-5, atol=1e-6)
        for r in range(p):  # this rank's errors, step by step
            a, l = divmod(r, G)
            torch.testing.assert_close(res[r]["steps"][t]["worker"], worker[l][a].reshape(-1), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(res[r]["steps"][t]["server"], server[l][a], rtol=1e-5, atol=1e-5)
        if dtype == torch.float32:  # the invariant is stated in the fp32 domain of the result
            total_out += outs[0].double()
        total_mean += torch.stack([x.double() for row in xs for x in row]).mean(0)
    if dtype != torch.float32:
        return
    # sum_t out_t = sum_t mean_r(x) - concat_l[mean_a(e_{a,l})] - concat_l[concat_a(s_{a,l})]
    fed_back = torch.zeros(n, dtype=torch.float64)
    for l, (lo, hi) in enumerate(spans):
        if hi == lo:
            continue
        ranks = [a * G + l for a in range(N)]
        e = torch.stack([res[r]["steps"][-1]["worker"].double() for r in ranks]).mean(0)
        s = torch.cat([res[r]["steps"][-1]["server"].double() for r in ranks])
        fed_back[lo:hi] = e[:hi - lo] + s[:hi - lo]
        assert e[hi - lo:].abs().sum() == 0 and s[hi - lo:].abs().sum() == 0  # pad slots carry no error
    err = (total_out - (total_mean - fed_back)).abs().max().item()
    assert err < 1e-4 * STEPS, err
    assert fed_back.abs().max() > 0.01  # the errors are really there (the test can fail)
    # Inter-node bytes of node 0: its G ranks' 1-bit stages, against the rows its ranks send
    # to the other node's ranks in the flat call ((N-1) G of every rank's p-1 rows).
    node_bytes = sum(res[r]["bytes"] for r in range(G))
    flat_node = sum(res[r]["flat_bytes"] * (N - 1) * G / (p - 1) for r in range(G))
    assert 0 < node_bytes <= flat_node / (0.9 * G) * (1.2 if n < 2048 * 4 else 1.0), (node_bytes, flat_node)
    assert res[0]["intra"] == 2 * (G - 1) * (4 * L + 4)


def _capped(rank, p, n, cap):
    st = HierarchicalState(n, _mesh_topology(N, G), block_size=64)
    outs = []
    for t in range(6):
        y = torch.empty(n)
        assert st.reduce_(_input(t, rank, n, torch.float32), y, cap=cap) is True
        outs.append(y)
    with pytest.raises(ValueError, match="cap must be a float32 tensor"):
        st.reduce_(torch.zeros(n), torch.empty(n), cap=cap[:-1])
    return outs


def test_hierarchical_capped_decode_equals_reference():
    """The capped decode between the nodes: each slice with its part of the caps, as the
    reference does it; no result above its cap."""
    n = 1001
    g = torch.Generator().manual_seed(3)
    cap = torch.exp(torch.randn(n, generator=g))
    cap[torch.rand(n, generator=g) < 0.25] = float("inf")
    res = run_ranks(_capped, N * G, n, cap, timeout=300)
    worker, server = [], []
    for lo, hi in slice_spans(n, G):
        m = chunk_size(hi - lo, N)
        worker.append([torch.zeros(N, m) for _ in range(N)])
        server.append([torch.zeros(m) for _ in range(N)])
    plain = None
    for t in range(6):
        xs = [[_input(t, a * G + l, n, torch.float32) for l in range(G)] for a in range(N)]
        want, worker, server = reference.hierarchical_allreduce(xs, worker, server, 64, cap=cap)
        if t == 0:
            plain = reference.hierarchical_allreduce(xs, [[torch.zeros_like(e) for e in row] for row in worker],
                                                     [[torch.zeros_like(e) for e in row] for row in server], 64)[0]
            assert not torch.equal(plain, want)  # the cap binds
        for r in range(N * G):
            assert torch.equal(res[r][t], want), (t, r)
        assert torch.all(want.abs() <= cap)


def _degenerate(rank, p, nodes, local, n, block, dtype):
    topo = _mesh_topology(nodes, local)
    assert topo.flat
    hier = HierarchicalState(n, topo, block_size=block)
    flat = CompressionState(n, block_size=block)
    for t in range(STEPS):
        x = _input(t, rank, n, dtype)
        a, b = x.clone(), x.clone()
        hierarchical_allreduce_(a, hier)
        compressed_allreduce_(b, flat)
        assert torch.equal(a, b), t
        assert torch.equal(hier.worker_error, flat.worker_error) and torch.equal(hier.server_error, flat.server_error)
    return a


@pytest.mark.parametrize("nodes,local", [(4, 1), (1, 4)])
def test_degenerate_topology_is_the_flat_call(nodes, local):
    res = run_ranks(_degenerate, 4, nodes, local, 3001, 256, torch.float32, timeout=300)
    assert all(torch.equal(r, res[0]) for r in res)


def _exact_means(rank, p):
    """hierarchical_mean_ over shm and over the groups' sockets, odd sizes (fewer elements
    than local ranks too), on inputs whose sums are exact in any order (a 2^-10 grid), and
    its refusals."""
    from lbcomm.comm import LoopTransport
    from lbcomm.exact import ExactMean
    from lbcomm.topology import hierarchical_mean_

    out = {}
    for how, topo in (("shm", _mesh_topology(N, G)), ("group", _explicit_topology(rank, p))):
        for n in (1, 7, 1001):
            x = (torch.randn(n, generator=torch.Generator().manual_seed(10 * n + rank)) * 1024).round_() / 1024
            out[(how, n)] = (x.clone(), hierarchical_mean_(x, topo).clone())
    with pytest.raises(TypeError, match="float32"):
        hierarchical_mean_(torch.zeros(4, dtype=torch.float16), topo)
    flat = _mesh_topology(1, p)
    with pytest.raises(ValueError, match="flat"):
        hierarchical_mean_(torch.zeros(4), flat)
    nodes, flat_p = ExactMean(topology=topo), ExactMean(transport=LoopTransport(p))
    out["bytes"] = (nodes.bytes(1001), flat_p.bytes(1001), nodes.bytes(0))
    return out


def test_hierarchical_mean_is_exact_and_identical_on_every_rank():
    from lbcomm.common import ring_allreduce_bytes
    from lbcomm.wire import chunk_size

    res = run_ranks(_exact_means, 4, timeout=300)
    for key in res[0]:
        if key == "bytes":
            continue
        want = torch.stack([r[key][0] for r in res]).sum(0) / 4
        for r in res:
            assert torch.equal(r[key][1], want), key
    # between nodes: one slice per rank (1/G of the flat ring allreduce's elements)
    assert res[0]["bytes"] == (int(ring_allreduce_bytes(4 * chunk_size(1001, G), N)),
                               int(ring_allreduce_bytes(4 * 1001, 4)), 0)


def _nonfinite(rank, p, policy):
    topo = _mesh_topology(N, G)
    n = 300
    st = HierarchicalState(n, topo, block_size=64, nonfinite=policy)
    x = _input(0, rank, n, torch.float32)
    hierarchical_allreduce_(x.clone(), st)
    before = (st.worker_error.clone(), st.server_error.clone())
    y = _input(1, rank, n, torch.float32)
    if rank == 3:
        y[5] = float("nan")  # node 1, slice 0: every slice of every node must skip
    z = y.clone()
    raised = False
    try:
        hierarchical_allreduce_(z, st)
    except NonFiniteError:
        raised = True
    same = torch.equal(st.worker_error, before[0]) and torch.equal(st.server_error, before[1])
    untouched = torch.equal(z, y) if rank != 3 else bool(torch.isnan(z[5])) and torch.equal(z[:5], y[:5])
    # the next finite call works again
    w = _input(2, rank, n, torch.float32)
    hierarchical_allreduce_(w, st)
    return {"raised": raised, "skipped": st.skipped, "same": same, "untouched": untouched, "after": w}


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_skips_everywhere_with_errors_untouched(policy):
    res = run_ranks(_nonfinite, 4, policy, timeout=300)
    for r in res:
        assert r["raised"] == (policy == "raise")
        assert r["skipped"] == 1 and r["same"] and r["untouched"]
        assert torch.equal(r["after"], res[0]["after"])


def _bad_topology(rank, p):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match="2-D DeviceMesh"):
        Topology.from_mesh(mesh)
    os.environ.update(LOCAL_WORLD_SIZE="3", WORLD_SIZE=str(p))
    with pytest.raises(ValueError, match="does not divide"):
        Topology.from_env()
    os.environ.update(LOCAL_WORLD_SIZE="4")
    assert Topology.auto() is None  # one node: flat
    topo = _mesh_topology(N, G)
    st = HierarchicalState(10 + (rank == 1), topo)  # ranks of node 0 disagree on the size
    if rank < 2:
        with pytest.raises(ValueError, match="different tensors"):
            hierarchical_allreduce_(torch.zeros(st.numel), st)
    with pytest.raises(ValueError, match="elements"):
        hierarchical_allreduce_(torch.zeros(5), st)
    return True


def _factory(rank, p):
    """make_reducer with a resolved topology is the HierarchicalState of that topology
    (bitwise the same calls); resolve_topology maps comm.topology."""
    from lbcomm.config import CommConfig
    from lbcomm.reducer import make_reducer, resolve_topology

    topo = _mesh_topology(N, G)
    comm = CommConfig(block_size=64, topology=topo)
    assert resolve_topology(comm) is topo and resolve_topology(comm.replace(topology="flat")) is None
    os.environ.update(LOCAL_WORLD_SIZE=str(G), WORLD_SIZE=str(p), LOCAL_RANK=str(rank % G))
    auto = resolve_topology(CommConfig())  # "auto" under torchrun's variables: several nodes
    assert (auto.nodes, auto.local_size) == (N, G)
    made = make_reducer(500, comm, topology=resolve_topology(comm))
    twin = HierarchicalState(500, topo, block_size=64, nonfinite="skip")
    assert isinstance(made, HierarchicalState) and made.nonfinite == "skip"
    same = True
    for t in range(3):
        a, b = _input(t, rank, 500, torch.float32), _input(t, rank, 500, torch.float32)
        made.reduce_(a, a)
        hierarchical_allreduce_(b, twin)
        same = same and torch.equal(a, b)
    return same


def test_make_reducer_with_a_topology():
    assert all(run_ranks(_factory, 4, timeout=300))


def test_clear_errors():
    assert all(run_ranks(_bad_topology, 4, timeout=300))


def _hook_training(rank, p, how):
    """DDP + onebit_hook on a topology; beside it the same local gradients reduced by
    hand with hierarchical_allreduce_ on a state of their own: bitwise the same."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lbcomm

    if how == "auto":
        os.environ.update(LOCAL_WORLD_SIZE=str(G), WORLD_SIZE=str(p), LOCAL_RANK=str(rank % G))
        topo = "auto"
    else:
        topo = _mesh_topology(N, G)
    torch.manual_seed(0)
    lin = torch.nn.Linear(37, 29, bias=False)  # one parameter: one bucket
    shadow = torch.nn.Linear(37, 29, bias=False)
    shadow.load_state_dict(lin.state_dict())
    model = DDP(lin)
    # normalize=None: the published compression, which the reference below runs
    state = lbcomm.OneBitHookState(2, normalize=None, comm=lbcomm.CommConfig(block_size=64, topology=topo, exact_numel=0))
    model.register_comm_hook(state, lbcomm.onebit_hook)
    ref_topo = _mesh_topology(N, G)
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


# ------------------------------------------------------------------ emulated nodes (CLI)

def _bench_env():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return env, root


def test_bench_nodes_arguments(capsys):
    from lbcomm.cli.commands import main

    assert main(["allreduce", "--nodes", "2", "--ranks-per-node", "2", "--world-size", "3", "--sizes", "4K"]) == 1
    assert "--nodes 2 x --ranks-per-node 2 = 4" in capsys.readouterr().err
    assert main(["allreduce", "--world-size", "3", "--ranks-per-node", "2", "--sizes", "4K"]) == 1
    assert "does not divide" in capsys.readouterr().err


def test_bench_emulated_nodes_count_inter_node_bytes(tmp_path):
    import json
    import subprocess
    import sys

    from lbcomm.cli import netem
    from lbcomm.cli.schema import check_allreduce_doc

    ok, why = netem.available()
    if not ok:
        pytest.skip(f"emulated cluster unavailable: {why}")
    env, root = _bench_env()
    out = tmp_path / "n.json"
    proc = subprocess.run([sys.executable, "-m", "lbcomm.cli", "allreduce", "--nodes", "2", "--ranks-per-node", "2",
                           "--bandwidth", "1gbit", "--sizes", "1M", "--iters", "3", "--warmup", "1",
                           "--methods", "onebit,hier", "--no-progress", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert "across the links between the 2 emulated nodes of 2 ranks" in proc.stdout
    doc = json.loads(out.read_text())
    check_allreduce_doc(doc)
    assert doc["config"]["ranks_per_node"] == 2
    rows = {r["method"]: r for r in doc["rows"]}
    hier, flat = rows["hier"], rows["onebit"]
    # what crossed the links: the 1-bit stage of all 4 ranks plus TCP/IP framing (< 10 %)
    assert 4 * hier["wire_bytes_per_rank"] <= hier["inter_node_bytes"] < 1.1 * 4 * hier["wire_bytes_per_rank"]
    assert flat["inter_node_bytes"] > 1.5 * hier["inter_node_bytes"], (flat, hier)


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
        state = lbcomm.OneBitHookState(2, comm=lbcomm.CommConfig(block_size=32, topology=_mesh_topology(N, G),
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


def test_bench_train_nodes_loopback(tmp_path):
    """train --nodes 2 --ranks-per-node 2 (unshaped): plain HSDP, HSDP + 1 bit and OneBitAdam
    on FSDP2 train on a 2-D mesh (OneBitAdam timed frozen); ratios against plain HSDP from the same run."""
    import json
    import subprocess
    import sys

    from lbcomm.cli.schema import check_train_doc

    env, root = _bench_env()
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, "-m", "lbcomm.cli", "train", "--nodes", "2", "--ranks-per-node", "2",
                           "--bandwidth", "none", "--preset", "tiny", "--steps", "1", "--rounds", "1",
                           "--warmup-steps", "4", "--allreduce-iters", "1", "--methods",
                           "hsdp,hsdp_onebit,fsdp_onebit_adam", "--no-progress", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert "2 nodes x 2 ranks" in proc.stdout and "against plain HSDP" in proc.stdout
    doc = json.loads(out.read_text())
    check_train_doc(doc)
    assert doc["config"]["ranks_per_node"] == 2 and doc["config"]["nodes"] == 2
    rows = {r["method"]: r for r in doc["runs"][0]["rows"]}
    assert list(rows) == ["hsdp", "hsdp_onebit", "fsdp_onebit_adam"]
    base = rows["hsdp"]["median_s"]
    for r in rows.values():
        assert r["speedup_vs_hsdp"] == pytest.approx(base / r["median_s"])
        assert r["speedup_vs_ddp"] is None and r["inter_node_bytes_per_step"] is None  # no ddp row; loopback
        assert r["final_loss"] == r["final_loss"] and 5.0 < r["final_loss"] < 7.5  # ln(512) = 6.2 at the start


def test_bench_train_nodes_arguments(capsys):
    from lbcomm.cli.commands import main

    assert main(["train", "--world-size", "2", "--methods", "ddp,hsdp", "--bandwidth", "none"]) == 1
    assert "hsdp need emulated nodes: give --nodes N --ranks-per-node G" in capsys.readouterr().err
    assert main(["train", "--nodes", "2", "--ranks-per-node", "2", "--world-size", "2", "--bandwidth", "none"]) == 1
    assert "--nodes 2 x --ranks-per-node 2 = 4" in capsys.readouterr().err
    assert main(["train", "--world-size", "3", "--ranks-per-node", "2", "--bandwidth", "none"]) == 1
    assert "does not divide" in capsys.readouterr().err
    assert main(["model-nodes", "--sizes", "1M,8M"]) == 1
    assert "at least 3 sizes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["model-nodes", "--mem-bandwidth", "fast"])
    assert "use bytes per second like 3TB" in capsys.readouterr().err


def test_node_cost_model_hand_computed():
    """lbcomm.cli.nodemodel against values computed by hand from its formulas and the wire
    format (n/8 sign bytes, one fp32 scale per 2048 elements, a 24-byte header per row;
    the 104-byte finiteness agreement in a ring)."""
    from lbcomm.cli.nodemodel import Links, gpu_kernel_s, node_cost, onebit_bytes
    from lbcomm.comm import LoopTransport
    from lbcomm.compressed import CompressionState

    # the byte formula is the state's own count, without allocating the state
    for m, q in ((5000, 3), (1 << 16, 4), (131072, 2)):
        st = CompressionState(m, transport=LoopTransport(q), block_size=2048, pieces=1)
        assert onebit_bytes(m, q) == st.bytes_per_call()
    n, N, G = 1 << 20, 4, 8
    links = Links(1e9, 1e11, 1e-5, 1e-6)
    # 1-bit bytes of a rank's slice (2^17 elements) over 4 nodes: chunks of 32768 elements,
    # rows of 4096 sign bytes + 16 scales x 4 bytes + 24 = 4184 bytes, 2 x 3 rows, plus the
    # agreement ring 2 x 3/4 x 104 = 156 bytes
    slice_bytes = 2 * 3 * 4184 + 156
    assert onebit_bytes(n // G, N) == slice_bytes
    hier = node_cost("hier", n, N, G, links, kernel_s=0.5e-3)
    assert hier["node_bytes"] == 8 * slice_bytes
    assert hier["inter_s"] == pytest.approx(8 * slice_bytes / 1e9)
    assert hier["intra_s"] == pytest.approx(2 * 7 / 8 * 4 * n / 1e11)
    assert hier["latency_s"] == pytest.approx(2 * 7 * 1e-6 + 2 * 3 * 1e-5)
    assert hier["total_s"] == pytest.approx(hier["latency_s"] + hier["inter_s"] + hier["intra_s"] + 0.5e-3)
    hsdp = node_cost("hsdp_fp32", n, N, G, links)
    assert hsdp["node_bytes"] == pytest.approx(2 * 3 / 4 * 4 * n)  # 8 ranks x ring of a 1/8 shard
    assert hsdp["total_s"] == pytest.approx(7 * 1e-6 + 2 * 3 * 1e-5 + 2 * 3 / 4 * 4 * n / 1e9 + 7 / 8 * 4 * n / 1e11)
    bf16 = node_cost("hsdp_bf16", n, N, G, links)
    assert bf16["node_bytes"] == pytest.approx(hsdp["node_bytes"] / 2)
    assert node_cost("hsdp_onebit", n, N, G, links)["node_bytes"] == hier["node_bytes"]
    # flat 1-bit over 32 ranks, rows of 32768 elements (4184 bytes): the all-to-all sends 8 x 24
    # rows off the node (24 of a rank's 31 peers are elsewhere), the ring all-gather 31 rows
    flat = node_cost("onebit", n, N, G, links)
    assert flat["node_bytes"] == pytest.approx((8 * 24 + 31) * 4184 + 2 * 31 / 32 * 104)
    assert flat["latency_s"] == pytest.approx(2 * 31 * 1e-5)
    fp32 = node_cost("fp32", n, N, G, links)
    assert fp32["node_bytes"] == pytest.approx(2 * 31 / 32 * 4 * n)
    # 2 x 2 as emulated: flat 4 + 3 rows, hierarchical 2 x (1 + 1) rows of the same size
    two = Links(1.2e8, float("inf"), 0, 0)
    row = 32768 + 4 * 128 + 24  # 2^20 over 4 ranks: 262144-element chunks, 128 scales
    assert node_cost("onebit", n, 2, 2, two)["node_bytes"] == pytest.approx(7 * row + 2 * 3 / 4 * 104)
    assert node_cost("hier", n, 2, 2, two)["node_bytes"] == 2 * (2 * row + 104)
    # GPU kernel estimates: memory traffic over memory bandwidth
    assert gpu_kernel_s("hier", n, N, G, 3e12) == pytest.approx((16.375 + 8.125 / 4) * (n / 8) / 3e12)
    assert gpu_kernel_s("onebit", n, N, G, 3e12) == pytest.approx((16.375 + 8.125 / 32) * n / 3e12)
    assert gpu_kernel_s("hsdp_bf16", n, N, G, 3e12) == 0.0
    with pytest.raises(ValueError, match="unknown method"):
        node_cost("ring", n, N, G, links)
    with pytest.raises(ValueError, match="intra_Bps must be > 0"):
        Links(1e9, 0, 0, 0)
