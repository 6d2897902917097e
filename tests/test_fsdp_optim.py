"""1-bit optimizers with a topology and on FSDP2 (lbcomm.fsdp.onebit_optimizer), on 4 real
gloo ranks as 2 nodes x 2, one spawn for every check:

* FSDP2 sharded inside the node, OneBitAdam on the local shards: the warmup equals
  torch.optim.AdamW on the whole parameters with the global mean gradient; the compression
  stage equals the plain-torch simulation (lbcomm.testing.optim, shards=2: each shard's
  momentum compressed on its own across the 2 nodes), fed with the gradient shards FSDP
  produced; replicas across
  nodes are bitwise identical; a NaN in one shard of one rank skips the step on every
  rank with the state untouched (warmup and compression); resuming from per-rank DCP
  checkpoints (RankLocal) continues bitwise exactly.
* OneBitLamb on FSDP2: the warmup equals lbcomm.Lamb on the whole parameters (norms of
  whole parameters through the shard group); the whole run equals the simulation with
  per-shard compression and whole-parameter norms; replicas identical.
* Data parallel with a topology (no FSDP): OneBitAdam and OneBitLamb with
  Topology.node_by_node(2) equal the simulation with the hierarchical reference call.
* exact_numel=EXACT (the biases and the second layer averaged exactly, the first layer
  compressed) on FSDP2 and hierarchically: equal to the simulation with the same option,
  the exact coordinates' errors zero, the compressed ones' not; on FSDP2 a resume from the
  per-rank DCP checkpoint continues bitwise.
"""

import pytest
import torch

import lbcomm
from lbcomm.config import COMM_FIELDS
from dist_util import run_ranks
from test_fsdp import _batch  # the same synthetic regression batches as the HSDP hook's tests

N, G = 2, 2
STEPS, FREEZE, BLOCK = 8, 4, 64
NAN_WARMUP, NAN_COMP, SAVE_AFTER = 2, 6, 6  # NaN injected before these steps; checkpoint after
LR = 0.01
EXACT = 300  # of 16x32 + 32 + 32x8 + 8: all but the first weight
ALL = {"exact_numel": 0}  # every parameter compressed (the default, 4096, would average this model exactly)


def _kw(opts, **comm):
    """`opts` (hyperparameters and communication settings in one dict) as optimizer keyword
    arguments, the CommConfig fields (on top of `comm`) in ``comm``."""
    comm.update({k: v for k, v in opts.items() if k in COMM_FIELDS})
    return {**{k: v for k, v in opts.items() if k not in COMM_FIELDS}, "comm": lbcomm.CommConfig(**comm)}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _sharded(mesh):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model[0], mesh=mesh["local"])
    fully_shard(model[2], mesh=mesh["local"])
    fully_shard(model, mesh=mesh["local"])
    return model


def _snapshot(opt, model):
    st = opt.compression_state
    return {"flat": {k: v.clone() for k, v in opt._flat.items()},
            "params": [p.to_local().clone() for p in model.parameters()],
            "errors": None if st is None else (st.worker_error.clone(), st.server_error.clone()),
            "step": opt.global_step}


def _same(a, b):
    if a["step"] != b["step"] or (a["errors"] is None) != (b["errors"] is None):
        return False
    pairs = list(zip(a["flat"].values(), b["flat"].values())) + list(zip(a["params"], b["params"]))
    if a["errors"] is not None:
        pairs += list(zip(a["errors"], b["errors"]))
    return all(torch.equal(x, y) for x, y in pairs)


def _exact_errors(opt):
    """(largest |error| at the exact coordinates, largest elsewhere) of this rank's worker
    error (its slice when hierarchical); None without exact_numel."""
    part = opt._onebit.exact.part(opt._layout)
    if part is None:
        return None
    st = opt.compression_state
    lo, hi = getattr(st, "span", (0, opt._layout.total))
    err = st.worker_error.reshape(-1)[:hi - lo]
    exact = torch.zeros(hi - lo, dtype=torch.bool)
    idx = part[0]
    exact[idx[(idx >= lo) & (idx < hi)] - lo] = True
    return float(err[exact].abs().max()) if bool(exact.any()) else 0.0, float(err[~exact].abs().max())


def _fsdp_run(rank, cls, opts, ckpt=None, resume=None, nan=True):
    """Train STEPS steps; returns the gradient shards and the parameter shards after every step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from lbcomm import fsdp
    from lbcomm.integrations.dcp import RankLocal

    mesh = init_device_mesh("cpu", (N, G), mesh_dim_names=("node", "local"))
    model = _sharded(mesh)
    opt = fsdp.onebit_optimizer(model, mesh, cls, lr=LR, freeze_step=FREEZE,
                                **_kw(opts, block_size=BLOCK, nonfinite="skip"))
    start = 0
    if resume is not None:
        state = {"model": model.state_dict(), "optim": RankLocal(opt)}
        dcp.load(state, checkpoint_id=resume)
        model.load_state_dict(state["model"])
        start = SAVE_AFTER
    grads, params, nan_ok = [], [], []
    for step in range(start + 1, STEPS + 1):
        x, y = _batch(rank, step)
        if nan and step in (NAN_WARMUP, NAN_COMP):  # one element of one shard on rank 0 only
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if rank == 0:
                model[2].weight.grad.to_local()[0, 0] = float("nan")
            before = _snapshot(opt, model)
            opt.step()
            nan_ok.append(opt.last_step_skipped and _same(before, _snapshot(opt, model)))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
        opt.step()
        assert not opt.last_step_skipped
        params.append([p.to_local().clone() for p in model.parameters()])
        if ckpt is not None and step == SAVE_AFTER:
            dcp.save({"model": model.state_dict(), "optim": RankLocal(opt)}, checkpoint_id=ckpt)
    return {"grads": grads, "params": params, "nan_ok": nan_ok, "frozen": opt.frozen, "errors": _exact_errors(opt)}


def _dp_run(rank, p, cls, opts, reload=True):
    """Plain data parallel (every rank the whole model), the hierarchical momentum reduction."""
    from lbcomm import Topology

    model = _model()
    topo = Topology.node_by_node(G)
    opt = cls(model.parameters(), lr=LR, freeze_step=FREEZE, **_kw(opts, block_size=BLOCK, topology=topo))
    grads, params = [], []
    for step in range(1, STEPS + 1):
        x, y = _batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([q.grad.clone() for q in model.parameters()])
        opt.step()
        params.append([q.detach().clone() for q in model.parameters()])
    out = {"grads": grads, "params": params, "hier": type(opt.compression_state).__name__,
           "errors": _exact_errors(opt)}
    if not reload:
        return out
    # a checkpoint of the hierarchical errors loaded on a flat reduction: reset, with a warning
    import logging

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("lbcomm.optim.onebit").addHandler(handler)
    flat = cls(model.parameters(), lr=LR, freeze_step=FREEZE, **_kw(opts, block_size=BLOCK, topology="flat"))
    flat.load_state_dict(opt.state_dict())
    st = flat.compression_state
    reload = (type(st).__name__, float(st.worker_error.abs().sum() + st.server_error.abs().sum()),
              any("topology (nodes, ranks per node)=(2, 2)" in w for w in warnings))
    return dict(out, reload=reload)


def _refusals():
    """Never silent: what onebit_optimizer refuses, each error naming the fix."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lbcomm import OneBitAdam, fsdp
    from lbcomm.errors import AveragedGradientsError

    def step(model, opt):
        g = torch.Generator().manual_seed(torch.distributed.get_rank())
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), torch.sin(x[:, :8])).backward()
        opt.step()

    mesh = init_device_mesh("cpu", (N, G), mesh_dim_names=("node", "local"))
    with pytest.raises(ValueError, match="native HSDP"):
        fsdp.onebit_optimizer(fully_shard(_model(), mesh=mesh), mesh)
    # onebit_hsdp's hook and the optimizer both across the nodes: the optimizer's probe sees
    # gradient shards identical on every node (averaged, or compressed, by the hook)
    for start_iter in (0, 2):
        hooked = _sharded(mesh)
        fsdp.onebit_hsdp(hooked, mesh, start_iter=start_iter)
        with pytest.raises(AveragedGradientsError, match="identical on all 2 ranks"):
            step(hooked, fsdp.onebit_optimizer(hooked, mesh))
    partial = _model()
    fully_shard(partial[0], mesh=mesh["local"])  # model[2] is left unsharded
    with pytest.raises(ValueError, match="not sharded by FSDP"):
        fsdp.onebit_optimizer(partial, mesh)
    with pytest.raises(ValueError, match="lbcomm.fsdp.onebit_optimizer"):
        OneBitAdam(_sharded(mesh).parameters()).step()
    with pytest.raises(ValueError, match="comm.process_group is set from the mesh"):
        fsdp.onebit_optimizer(_sharded(mesh), mesh, comm=lbcomm.CommConfig(process_group=mesh.get_group("node")))
    # onebit_hsdp on the optimizer's model reduces across nodes a second time: the optimizer's
    # averaged-gradients probe names it at the first step
    owned = _sharded(mesh)
    opt = fsdp.onebit_optimizer(owned, mesh, lr=LR, freeze_step=FREEZE)
    fsdp.onebit_hsdp(owned, mesh)
    x, y = _batch(torch.distributed.get_rank(), 1)
    torch.nn.functional.mse_loss(owned(x), y).backward()
    with pytest.raises(AveragedGradientsError, match="onebit_hook"):
        opt.step()
    return True


def _all(rank, p, ckpt):
    from lbcomm import OneBitAdam, OneBitLamb

    out = {"refusals": _refusals()}
    out["adam"] = _fsdp_run(rank, OneBitAdam, ALL, ckpt=ckpt)
    out["resumed"] = _fsdp_run(rank, OneBitAdam, ALL, resume=ckpt)
    out["lamb"] = _fsdp_run(rank, OneBitLamb, {"weight_decay": 0.01, **ALL}, nan=False)
    for mode in ("frozen", "live", "max"):
        out["lamb_" + mode] = _fsdp_run(rank, OneBitLamb, {"weight_decay": 0.01, "trust_ratio": mode, **ALL}, nan=False)
    out["dp_adam"] = _dp_run(rank, p, OneBitAdam, ALL)
    out["dp_lamb"] = _dp_run(rank, p, OneBitLamb, {"weight_decay": 0.01, **ALL})
    out["adam_exact"] = _fsdp_run(rank, OneBitAdam, {"exact_numel": EXACT}, ckpt=ckpt + "_exact", nan=False)
    out["resumed_exact"] = _fsdp_run(rank, OneBitAdam, {"exact_numel": EXACT}, resume=ckpt + "_exact", nan=False)
    out["lamb_exact"] = _fsdp_run(rank, OneBitLamb, {"weight_decay": 0.01, "exact_numel": EXACT}, nan=False)
    out["dp_adam_exact"] = _dp_run(rank, p, OneBitAdam, {"exact_numel": EXACT}, reload=False)
    out["dp_lamb_exact"] = _dp_run(rank, p, OneBitLamb, {"weight_decay": 0.01, "exact_numel": EXACT}, reload=False)
    return out


def _full(res, run, t, i):
    """Parameter (or gradient) i of the whole model at step index t, from node 0's shards."""
    return torch.cat([res[l][run]["params"][t][i] for l in range(G)])


def _node_grads(res, run):
    """grads[t][a]: node a's mean gradient of every whole parameter (FSDP's shards joined)."""
    return [[[torch.cat([res[a * G + l][run]["grads"][t][i] for l in range(G)]) for i in range(len(res[0][run]
            ["grads"][t]))] for a in range(N)] for t in range(STEPS)]


def _mean_grad(res, run, t, i):
    """The global mean gradient of parameter i: per shard the mean over nodes of FSDP's shards."""
    return torch.cat([torch.stack([res[a * G + l][run]["grads"][t][i] for a in range(N)]).sum(0) / N
                      for l in range(G)])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    return run_ranks(_all, N * G, ckpt, timeout=600)


def test_fsdp_onebit_adam(results):
    from lbcomm.testing.optim import simulate_onebit_adam

    res = results
    p0 = list(_model().parameters())
    assert all(r["adam"]["frozen"] for r in res)
    assert all(r["refusals"] for r in res)
    # NaN in one shard on one rank: every rank skipped, state untouched (warmup and compression)
    assert all(r["adam"]["nan_ok"] == [True, True] for r in res)
    # replicas across nodes: bitwise identical shards
    for t in range(STEPS):
        for l in range(G):
            for i in range(len(p0)):
                assert torch.equal(res[l]["adam"]["params"][t][i], res[G + l]["adam"]["params"][t][i])
    # warmup == torch.optim.AdamW on the whole parameters with the global mean gradient
    ref = [q.detach().clone().requires_grad_() for q in p0]
    adamw = torch.optim.AdamW(ref, lr=LR, weight_decay=1e-2)
    for t in range(FREEZE):
        for i, q in enumerate(ref):
            q.grad = _mean_grad(res, "adam", t, i)
        adamw.step()
        for i, q in enumerate(ref):
            torch.testing.assert_close(_full(res, "adam", t, i), q.detach(), rtol=1e-6, atol=1e-7)
    # the whole run == 1-bit Adam simulated with each shard compressed across the nodes
    hist = simulate_onebit_adam(p0, _node_grads(res, "adam"), lr=LR, weight_decay=1e-2, freeze_step=FREEZE,
                                block_size=BLOCK, shards=G, **ALL)
    for t in range(STEPS):
        for i in range(len(p0)):
            torch.testing.assert_close(_full(res, "adam", t, i), hist[t][i], rtol=1e-5, atol=1e-6)
    # resumed from the per-rank DCP checkpoint after step SAVE_AFTER: bitwise the same run
    for r in res:
        for t in range(SAVE_AFTER, STEPS):
            for a, b in zip(r["resumed"]["params"][t - SAVE_AFTER], r["adam"]["params"][t]):
                assert torch.equal(a, b)


@pytest.mark.parametrize("run", ["lamb", "lamb_frozen", "lamb_live", "lamb_max"])
def test_fsdp_onebit_lamb(results, run):
    from lbcomm import Lamb
    from lbcomm.testing.optim import simulate_onebit_lamb

    res = results
    p0 = list(_model().parameters())
    ref = [q.detach().clone().requires_grad_() for q in p0]
    lamb = Lamb(ref, lr=LR, weight_decay=0.01)  # one process: no communication
    for t in range(FREEZE):
        for i, q in enumerate(ref):
            q.grad = _mean_grad(res, run, t, i)
        lamb.step()
        for i, q in enumerate(ref):
            torch.testing.assert_close(_full(res, run, t, i), q.detach(), rtol=1e-6, atol=1e-7)
    for t in range(STEPS):
        for l in range(G):
            for i in range(len(p0)):
                assert torch.equal(res[l][run]["params"][t][i], res[G + l][run]["params"][t][i])
    assert all(r[run]["frozen"] for r in res)
    # the whole run == 1-bit LAMB simulated with each shard compressed across the nodes and
    # the norms, bounds and momentum scales of whole parameters
    hist = simulate_onebit_lamb(p0, _node_grads(res, run), lr=LR, weight_decay=0.01, freeze_step=FREEZE,
                                block_size=BLOCK, shards=G, trust_ratio=run[5:] or "aligned", **ALL)
    for t in range(STEPS):
        for i in range(len(p0)):
            torch.testing.assert_close(_full(res, run, t, i), hist[t][i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_topology_data_parallel_equals_hierarchical_simulation(results, kind):
    from lbcomm.testing.optim import simulate_onebit_adam, simulate_onebit_lamb

    res = results
    run = "dp_" + kind
    assert all(r[run]["hier"] == "HierarchicalState" for r in res)
    p0 = list(_model().parameters())
    grads = [[r[run]["grads"][t] for r in res] for t in range(STEPS)]
    if kind == "adam":
        hist = simulate_onebit_adam(p0, grads, lr=LR, weight_decay=1e-2, freeze_step=FREEZE, block_size=BLOCK,
                                    nodes=N, **ALL)
    else:
        hist = simulate_onebit_lamb(p0, grads, lr=LR, weight_decay=0.01, freeze_step=FREEZE, block_size=BLOCK,
                                    nodes=N, **ALL)
    for r in res:
        assert r[run]["reload"] == ("CompressionState", 0.0, True)
        for t in range(STEPS):
            for got, want in zip(r[run]["params"][t], hist[t]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("where", ["fsdp", "dp"])
def test_exact_numel_sharded_and_hierarchical_equal_simulation(results, kind, where):
    """exact_numel on FSDP2 shards (each shard's exact coordinates averaged over the
    replicate group) and with the hierarchical reduction (over all ranks): the runs equal
    the simulation with the same option and end away from the all-compressed one; the
    exact coordinates' errors stay zero on every rank, the compressed ones' do not."""
    from lbcomm.testing.optim import simulate_onebit_adam, simulate_onebit_lamb

    res = results
    run = ("dp_" if where == "dp" else "") + kind + "_exact"
    p0 = list(_model().parameters())
    sim = simulate_onebit_adam if kind == "adam" else simulate_onebit_lamb
    kw = dict(lr=LR, weight_decay=0.01, freeze_step=FREEZE, block_size=BLOCK)
    if where == "dp":
        grads = [[r[run]["grads"][t] for r in res] for t in range(STEPS)]
        kw["nodes"] = N
        got = [[r[run]["params"][t] for t in range(STEPS)] for r in res]
        assert all(r[run]["hier"] == "HierarchicalState" for r in res)
    else:
        grads = _node_grads(res, run)
        kw["shards"] = G
        got = [[[_full(res, run, t, i) for i in range(len(p0))] for t in range(STEPS)]]
    hist = sim(p0, grads, exact_numel=EXACT, **kw)
    for per_step in got:
        for t in range(STEPS):
            for a, b in zip(per_step[t], hist[t]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    compressed = sim(p0, grads, exact_numel=0, **kw)
    assert max((a - b).abs().max().item() for a, b in zip(compressed[-1], hist[-1])) > 1e-5
    for r in res:
        at_exact, elsewhere = r[run]["errors"]
        assert at_exact == 0.0 and elsewhere > 0.0
    if run == "adam_exact":  # resumed from the per-rank DCP checkpoint: bitwise the same run
        for r in res:
            for t in range(SAVE_AFTER, STEPS):
                for a, b in zip(r["resumed_exact"]["params"][t - SAVE_AFTER], r[run]["params"][t]):
                    assert torch.equal(a, b)
