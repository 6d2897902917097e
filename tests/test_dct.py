"""DCT (lbcomm.dct, lbcomm.ddp.dct): dct_hook under DDP on real gloo ranks against the
pure-torch reference (tests/dct_reference.py), bitwise; the transport's all_gather_v;
resume, elastic resume and errors."""
import copy
import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lbcomm
from lbcomm.comm import LoopTransport, get_transport
from lbcomm.comm.counting import CountingTransport
from lbcomm.common import STATS_KEYS
from lbcomm.dct import DCTReducer, Sparsifier, pack, unpack
from lbcomm.integrations.dcp import LoadPlanner, RankLocal

from dct_reference import DCTReference
from dist_util import run_ranks, same

START, STEPS, DENSITY, REFRESH, EXACT = 3, 10, 0.05, 3, 64


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(300, 8)
        self.l1, self.l2 = nn.Linear(8, 128), nn.Linear(128, 5)

    def forward(self, tok):
        return self.l2(torch.relu(self.l1(self.emb(tok).mean(1))))


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tok = (torch.rand(16, 6, generator=g) ** 3 * 300).long()
    return tok, torch.randint(0, 5, (16,), generator=g)


def _recording(rec):
    def hook(state, bucket):
        it, inp = state.iter, bucket.buffer().clone()
        return lbcomm.dct_hook(state, bucket).then(
            lambda f: (rec.append((it, bucket.index(), inp, f.value().clone())), f.value())[1])
    return hook


def _build(nonfinite="skip", rec=None, **kw):
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = lbcomm.DCTHookState(START, density=DENSITY, refresh_every=REFRESH,
                                comm=lbcomm.CommConfig(exact_numel=EXACT, nonfinite=nonfinite), **kw)
    ddp.register_comm_hook(state, _recording(rec) if rec is not None else lbcomm.dct_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state.check_resume(opt)
    return model, ddp, state, opt


def _steps(ddp, opt, rank, lo, hi):
    for step in range(lo, hi):
        tok, y = _batch(step, rank)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(tok), y).backward()
        opt.step()


def _units(state):
    """bucket index -> (exact index, residual) of its unit."""
    units = {u.key: u for u in state.planner.units()}
    out = {}
    for index, keys in state.planner.bucket_units.items():
        (key,) = keys
        u = units[key]
        out[index] = (u.exact[1], u.compression.worker_error.clone())
    return out


# ---------------------------------------------------------------------- three ranks, against the reference
def _reference_run(rank, p):
    rec = []
    model, ddp, state, opt = _build(rec=rec)
    _steps(ddp, opt, rank, 0, STEPS)
    # all_gather_v: lengths that differ (one empty), counted as sent
    tr = CountingTransport(get_transport(backend="torch"))
    parts = tr.all_gather_v(torch.arange(5 * rank, dtype=torch.uint8))
    return {"params": [q.detach().clone() for q in model.parameters()], "rec": rec, "units": _units(state),
            "stats": state.compression_stats(), "sd": state.state_dict(), "parts": parts, "counted": tr.bytes_sent,
            "sent_norms": [u.compression.last_sent_norm for u in state.planner.units()]}


@pytest.fixture(scope="module")
def three():
    return run_ranks(_reference_run, 3, timeout=300)


def test_dct_hook_matches_the_reference_bitwise(three):
    p = 3
    buckets = sorted(three[0]["units"])
    assert len(buckets) >= 2, "the model must span several buckets"
    for b in buckets:
        exact, _ = three[0]["units"][b]
        steps = [[(it, x, y) for it, i, x, y in three[r]["rec"] if i == b and it >= START] for r in range(p)]
        assert len(steps[0]) == STEPS - START
        ref = DCTReference(steps[0][0][1].numel(), p, DENSITY, REFRESH, exact)
        total_in = [torch.zeros(ref.numel, dtype=torch.float64) for _ in range(p)]
        total_sent = [torch.zeros(ref.numel, dtype=torch.float64) for _ in range(p)]
        for t in range(len(steps[0])):
            inputs = [steps[r][t][1] for r in range(p)]
            mean = ref.step(inputs)
            keep = torch.ones(ref.numel, dtype=torch.bool)
            if exact is not None:
                keep[exact] = False
            for r in range(p):
                out = steps[r][t][2]
                assert torch.equal(out[keep], mean[keep]), f"bucket {b} step {t} rank {r}: differs from the reference"
                torch.testing.assert_close(out[~keep], mean[~keep])
                assert torch.equal(out, steps[0][t][2]), "every rank must receive the same mean"
                total_in[r] += inputs[r].double()
                total_sent[r] += ref.sent[r].double()
        for r in range(p):
            residual = three[r]["units"][b][1]
            assert torch.equal(residual, ref.residual[r]), f"bucket {b} rank {r}: residual differs"
            # residual invariant: everything not sent is still held (exact coordinates: averaged, never held)
            torch.testing.assert_close((total_sent[r] + residual.double())[keep], total_in[r][keep], rtol=1e-6,
                                       atol=1e-6)


def test_dct_hook_keeps_replicas_identical_and_reports(three):
    for r in range(1, 3):
        assert same(three[0]["params"], three[r]["params"])
    stats = three[0]["stats"]
    assert set(STATS_KEYS) <= set(stats)
    assert stats["compressed_calls"] > 0 and stats["skipped_calls"] == 0 and stats["error_norm"] > 0
    assert 0 < stats["sent_fraction"] < 0.5 and stats["compression_ratio"] > 1
    assert stats["iter"] == STEPS
    # the residuals over the values the units sent in their last exchange
    sent = sum(x * x for x in three[0]["sent_norms"]) ** 0.5
    assert sent > 0 and stats["error_ratio"] == pytest.approx(stats["error_norm"] / sent, rel=1e-9)


def test_all_gather_v_of_lengths_that_differ(three):
    for r in range(3):
        parts = three[r]["parts"]
        assert [x.tolist() for x in parts] == [list(range(5 * j)) for j in range(3)]
        assert three[r]["counted"] == 2 * (8 + 10)  # (p-1) x (length + the longest, padded)
    loop = LoopTransport(3).all_gather_v(torch.arange(4, dtype=torch.uint8))
    assert [x.tolist() for x in loop] == [[0, 1, 2, 3]] * 3
    with pytest.raises(TypeError, match="1-D uint8"):
        LoopTransport(2).all_gather_v(torch.zeros(3))


# ---------------------------------------------------------------------- two ranks: resume, non-finite
def _resume_run(rank, p):
    model, ddp, state, opt = _build()
    _steps(ddp, opt, rank, 0, STEPS)
    straight = [q.detach().clone() for q in model.parameters()]

    model, ddp, state, opt = _build()
    _steps(ddp, opt, rank, 0, 6)
    saved = (model.state_dict(), opt.state_dict(), state.state_dict())
    model, ddp, state, opt = _build()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    state.load_state_dict(saved[2])
    _steps(ddp, opt, rank, 6, STEPS)
    resumed = [q.detach().clone() for q in model.parameters()]

    # non-finite on rank 1: NaN on every rank, residuals untouched
    def held():
        return [{k: u["compression"][k] for k in ("residual", "threshold", "steps")} for u in state.state_dict()["units"]]

    before = held()
    tok, y = _batch(99, rank)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(ddp(tok), y) * (float("nan") if rank == 1 else 1.0)
    loss.backward()
    nan = all(bool(torch.isnan(q.grad).all()) for q in model.parameters())
    kept = same(before, held())
    return {"straight": straight, "resumed": resumed, "nan": nan, "kept": kept,
            "skipped": state.compression_stats()["skipped_calls"]}


def test_dct_hook_resumes_bitwise_and_skips_nonfinite():
    res = run_ranks(_resume_run, 2, timeout=300)
    for r in range(2):
        assert same(res[r]["straight"], res[r]["resumed"]), f"rank {r}: the resumed run differs"
        assert res[r]["nan"] and res[r]["kept"] and res[r]["skipped"] >= 1


# ---------------------------------------------------------------------- elastic 4 -> 2
def _save_run(rank, p, ckpt):
    model, ddp, state, opt = _build()
    _steps(ddp, opt, rank, 0, 6)
    dcp.save({"hook": RankLocal(state)}, checkpoint_id=ckpt)
    return {"model": model.state_dict(), "opt": opt.state_dict(), "sd": state.state_dict()}


def _elastic_run(rank, p, saved, ckpt):
    model, ddp, state, opt = _build()
    model.load_state_dict(saved[0]["model"])
    opt.load_state_dict(copy.deepcopy(saved[0]["opt"]))  # the spawned ranks share the arguments' memory
    sds = [s["sd"] for s in saved]
    state.load_state_dict(sds[rank], all_ranks=sds)
    loaded = state.state_dict()["units"]
    # the same redistribution through torch.distributed.checkpoint
    by_dcp = lbcomm.DCTHookState(START, density=DENSITY, refresh_every=REFRESH,
                                 comm=lbcomm.CommConfig(exact_numel=EXACT))
    dcp.load({"hook": RankLocal(by_dcp)}, checkpoint_id=ckpt, planner=LoadPlanner())
    assert same(by_dcp.state_dict(), state.state_dict())
    _steps(ddp, opt, rank, 6, 9)
    return {"loaded": loaded, "params": [q.detach().clone() for q in model.parameters()],
            "stats": state.compression_stats()}


def test_dct_hook_elastic_resume_4_to_2(tmp_path):
    ckpt = str(tmp_path / "dcp")
    saved = run_ranks(_save_run, 4, ckpt, timeout=400)
    res = run_ranks(_elastic_run, 2, saved, ckpt, timeout=300)
    assert same(res[0]["params"], res[1]["params"])
    old = {tuple(u["params"]): [s["sd"]["units"][i]["compression"]["residual"] for s in saved]
           for i, u in enumerate(saved[0]["sd"]["units"])}
    for u in res[0]["loaded"]:
        new = [{tuple(v["params"]): v for v in res[r]["loaded"]}[tuple(u["params"])]["compression"]["residual"]
               for r in range(2)]
        # what the residuals add to the mean is preserved: sum / p
        torch.testing.assert_close(sum(new) / 2, sum(old[tuple(u["params"])]) / 4)
        assert u["compression"]["threshold"] is None  # refreshed at the next call
    assert res[0]["stats"]["compressed_calls"] > 0


def test_elastic_without_all_ranks_resets_with_a_warning(caplog):
    state = lbcomm.DCTHookState(2)
    sd = {"version": 1, "kind": "dct", "iter": 5, "start_iter": 2, "exact_numel": 4096, "world_size": 4,
          "units": [{"params": [0]}], "stats": {"bytes_sent": 0, "bytes_uncompressed": 0, "compressed_calls": 0,
                                                "skipped_calls": 0}}
    with caplog.at_level(logging.WARNING):
        state.load_state_dict(sd)
    assert "reset to zero" in caplog.text and state.planner.num_saved() == 0 and state.iter == 5


# ---------------------------------------------------------------------- no ranks needed
def test_sparsifier_refreshes_on_schedule_and_keeps_the_residual():
    sp = Sparsifier(100, 0.1, 2)
    x = torch.linspace(-1, 1, 100)
    acc, idx, thr = sp.select(x)
    assert idx.numel() == 10 and thr == float(acc.abs().sort(descending=True).values[9])
    sp.commit(acc, idx, thr)
    assert torch.equal(sp.residual[idx], torch.zeros(10)) and float(sp.residual.abs().max()) < thr
    acc2, idx2, thr2 = sp.select(torch.zeros(100))  # not due: the same threshold, nothing passes
    assert thr2 == thr and idx2.numel() == 0
    sp.commit(acc2, idx2, thr2)
    assert sp.due()
    zero = Sparsifier(4, 1.0, 1, threshold=0.0)  # threshold 0: every nonzero entry, never the zeros
    assert zero.select(torch.tensor([0.0, 1.0, -2.0, 0.0]))[1].tolist() == [1, 2]
    buf = pack(torch.tensor([3, 7]), torch.tensor([1.5, -2.0]), 10)
    idx, vals = unpack(buf, 10)
    assert idx.tolist() == [3, 7] and vals.tolist() == [1.5, -2.0] and buf.numel() == 8 + 2 * 8
    assert unpack(pack(torch.tensor([1]), None, 10, ok=False), 10) is None


def test_reducer_on_one_process_is_the_mean_of_identical_ranks():
    red = DCTReducer(50, LoopTransport(2), density=0.2, refresh_every=5)
    x = torch.randn(50)
    out = torch.empty(50)
    assert red.reduce_(x, out)
    sent = (x.abs() >= x.abs().sort(descending=True).values[9])
    assert torch.equal(out, torch.where(sent, x, torch.zeros(())) * 2 / 2)
    assert torch.equal(red.worker_error, torch.where(sent, torch.zeros(()), x))
    assert red.bytes_per_call() == 8 + 8 + 10 * 8
    stats = red.compression_stats()
    assert set(STATS_KEYS) <= set(stats)
    # what was sent, and what stayed: their norms split the input's
    assert red.last_sent_norm == pytest.approx(float(x[sent].double().norm()), rel=1e-6)
    assert stats["error_norm"] == pytest.approx(float(x[~sent].double().norm()), rel=1e-6)
    assert stats["error_ratio"] == pytest.approx(stats["error_norm"] / red.last_sent_norm, rel=1e-12)
    red.reset()
    assert red.last_sent_norm == 0.0 and red.compression_stats()["error_ratio"] == 0.0


def test_clear_errors():
    for bad in (0, 1.5, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match="density"):
            lbcomm.DCTHookState(10, density=bad)
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="refresh_every"):
            lbcomm.DCTHookState(10, refresh_every=bad)
    with pytest.raises(ValueError, match="start_iter"):
        lbcomm.DCTHookState(1)
    with pytest.raises(ValueError, match="backend"):
        lbcomm.DCTHookState(10, comm=lbcomm.CommConfig(backend="mpi"))
    with pytest.raises(TypeError, match="DCTHookState"):
        lbcomm.dct_hook(lbcomm.OneBitHookState(10), None)
    with pytest.raises(ValueError, match="not a DCTHookState"):
        lbcomm.DCTHookState(10).load_state_dict({"version": 1})
    with pytest.raises(ValueError, match="threshold"):
        Sparsifier(4, 0.5, 1, threshold=-1.0)
    with pytest.raises(ValueError, match="nonfinite"):
        DCTReducer(4, LoopTransport(2), density=0.5, refresh_every=1, nonfinite="ignore")


def test_high_density_is_warned(caplog):
    with caplog.at_level(logging.WARNING):
        lbcomm.DCTHookState(10, density=0.8)
    assert "more bytes than a full-precision allreduce" in caplog.text


# ---------------------------------------------------------------------- model parallelism: two ranks
def _mp_steps(rank, tr, link, steps=4):
    """Embedding on rank 0, MLP on rank 1, SGD on each side; rank 1's losses."""
    torch.manual_seed(0)
    emb, mlp = nn.Embedding(300, 8), nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    part = emb if rank == 0 else mlp
    opt = torch.optim.SGD(part.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        tok, y = _batch(step, 0)
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            x = emb(tok).mean(1)
            link.send(x)
            x.backward(link.recv_grad())
        else:
            x = link.recv((tok.shape[0], 8))
            loss = F.cross_entropy(mlp(x), y)
            loss.backward()
            link.send_grad(x.grad)
            losses.append(loss.detach())
        opt.step()
    return losses, [q.detach().clone() for q in part.parameters()]


def _mp_run(rank, p):
    from lbcomm.dct_mp import DCTBoundary

    out = {}
    for name, kw in (("dense", {"density": None}), ("zero", {"threshold": 0.0}),
                     ("sparse", {"density": 0.25, "refresh_every": 2, "residual": True})):
        tr = CountingTransport(get_transport(backend="torch"))
        link = DCTBoundary(tr, **kw)
        losses, params = _mp_steps(rank, tr, link)
        out[name] = {"losses": losses, "params": params, "bytes": link.bytes_sent, "counted": tr.bytes_sent,
                     "act": link.activation_bytes, "grad": link.gradient_bytes, "sent": link.sent_entries,
                     "offered": link.offered_entries, "sd": link.state_dict(), "stats": link.compression_stats(),
                     "last_sent": None if link.sparsifier is None else link.sparsifier.last_sent_norm}
    return out


def test_dct_mp_sparse_exchange_equals_dense_at_threshold_0():
    res = run_ranks(_mp_run, 2, timeout=300)
    for r in range(2):
        dense, zero, sparse = (res[r][k] for k in ("dense", "zero", "sparse"))
        assert same(dense["params"], zero["params"]) and same(dense["losses"], zero["losses"])
        for run in (dense, zero, sparse):
            assert run["bytes"] == run["counted"] > 0  # the boundary counts what the transport sent
    n = 4 * 16 * 8  # steps x batch x dim
    d, z, s = (res[0][k] for k in ("dense", "zero", "sparse"))
    assert d["act"] == 4 * 8 + 4 * n and res[1]["dense"]["grad"] == 4 * 8 + 4 * n
    # sparse: length + header + (int32 index, fp32 value) per pair forward, a value per pair back
    assert z["act"] == 4 * 16 + 8 * z["sent"] and res[1]["zero"]["grad"] == 4 * 8 + 4 * z["sent"]
    assert s["act"] == 4 * 16 + 8 * s["sent"] and 0.2 * n < s["sent"] < 0.5 * n
    assert s["sd"]["sparsifier"]["residual"].abs().sum() > 0
    # statistics: the thresholded messages of each side, the sender's residual over what it last sent
    for r in range(2):
        for name, run in res[r].items():
            st = run["stats"]
            assert set(STATS_KEYS) <= set(st) and st["skipped_calls"] == 0 and st["bytes_sent"] == run["bytes"]
            assert st["compressed_calls"] == (0 if name == "dense" else 4), (r, name, st)
            if r == 1 or name != "sparse":  # no residual: the receiver, the dense exchange, threshold 0
                assert st["error_norm"] == 0.0 == st["error_ratio"], (r, name, st)
    st, residual = s["stats"], s["sd"]["sparsifier"]["residual"]
    assert st["error_norm"] == pytest.approx(float(residual.double().norm()), rel=1e-12) and s["last_sent"] > 0
    assert st["error_ratio"] == pytest.approx(st["error_norm"] / s["last_sent"], rel=1e-12)
    # a quarter of the activations: the losses move away from the dense run's but stay close
    torch.testing.assert_close(torch.stack(res[1]["sparse"]["losses"]), torch.stack(res[1]["dense"]["losses"]),
                               rtol=0.2, atol=0.2)


def test_dct_mp_errors():
    from lbcomm.dct_mp import DCTBoundary

    with pytest.raises(ValueError, match="two ranks"):
        DCTBoundary(LoopTransport(3))
    with pytest.raises(TypeError, match="send_v"):
        DCTBoundary(LoopTransport(2))
