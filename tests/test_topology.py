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
from topology_util import G, N, mesh_topology

STEPS = 21


def _input(t, r, n, dtype):
    g = torch.Generator().manual_seed(1000 * t + r)
    scale = 1.0 + (t % 5)  # magnitudes change between calls
    x = torch.randn(n, generator=g) * scale
    x[: n // 7] *= 0.01  # a small-magnitude region (block scales matter)
    return x.to(dtype)


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
        topo = mesh_topology(N, G)
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
    st = HierarchicalState(n, mesh_topology(N, G), block_size=64)
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
    topo = mesh_topology(nodes, local)
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
    for how, topo in (("shm", mesh_topology(N, G)), ("group", _explicit_topology(rank, p))):
        for n in (1, 7, 1001):
            x = (torch.randn(n, generator=torch.Generator().manual_seed(10 * n + rank)) * 1024).round_() / 1024
            out[(how, n)] = (x.clone(), hierarchical_mean_(x, topo).clone())
    with pytest.raises(TypeError, match="float32"):
        hierarchical_mean_(torch.zeros(4, dtype=torch.float16), topo)
    flat = mesh_topology(1, p)
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
    topo = mesh_topology(N, G)
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
    topo = mesh_topology(N, G)
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

    topo = mesh_topology(N, G)
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
