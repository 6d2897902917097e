"""DDP communication hooks on 4 real gloo ranks: training a small model lowers its loss,
replicas stay bitwise identical, the hook state resumes bitwise exactly.

One spawn of 4 ranks runs every scenario (spawning is the expensive part); the tests
below each check one property of the results.
"""
import logging
import pickle

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import lbcomm
from dist_util import run_ranks
from lbcomm import CommConfig
from lbcomm.ddp import OneBitHookState, WarmupAverage, onebit_hook, warmup_average_hook

P = 4
BUCKET_MB = 0.01  # ~2600 fp32 elements per bucket: the model below spans several buckets


# ---------------------------------------------------------------------- the task
def _teacher(x):
    g = torch.Generator().manual_seed(123)
    a, b = torch.randn(16, 32, generator=g) / 4, torch.randn(32, 4, generator=g)
    return torch.tanh(x @ a) @ b


def _batch(rank, step, n=32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 16, generator=g)
    return x, _teacher(x)


def _eval_loss(model):
    g = torch.Generator().manual_seed(99)
    x = torch.randn(512, 16, generator=g)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), _teacher(x)).item()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def _step(ddp, opt, rank, step, poison=False):
    x, y = _batch(rank, step)
    opt.zero_grad()
    out = ddp(x)
    if poison:  # every gradient of this rank becomes Inf or NaN
        out = out * float("inf")
    loss = torch.nn.functional.mse_loss(out, y)
    loss.backward()
    return loss


def _train(ddp, opt, rank, steps, first=0):
    for s in range(first, first + steps):
        _step(ddp, opt, rank, s)
        opt.step()


# ---------------------------------------------------------------------- scenarios (in each rank)
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _hook_training(rank, make_opt, steps, start_iter):
    records = _Records()
    logging.getLogger("lbcomm.ddp").addHandler(records)
    logging.getLogger("lbcomm.ddp").setLevel(logging.INFO)
    model = _model()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    opt = make_opt(ddp.parameters())
    state = OneBitHookState(start_iter, compression_stats_logging_frequency=5, comm=CommConfig(exact_numel=0))
    returned = []

    def probe(state, bucket):  # onebit_hook, noting whether its future was still pending on return
        compressed = state.iter >= start_iter
        fut = onebit_hook(state, bucket)
        returned.append((compressed, fut.done()))
        return fut

    ddp.register_comm_hook(state, probe)
    before = _eval_loss(model)
    _train(ddp, opt, rank, steps)
    logging.getLogger("lbcomm.ddp").removeHandler(records)
    pending = sum(1 for compressed, done in returned if compressed and not done)
    return {"before": before, "after": _eval_loss(model), "params": _flat(model), "stats": state.compression_stats(),
            "buckets": len(state.bucket_units), "log": records.messages, "pending_at_return": pending}


def _plain_training(rank, make_opt, steps):
    model = _model()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    opt = make_opt(ddp.parameters())
    _train(ddp, opt, rank, steps)
    return {"after": _eval_loss(model), "params": _flat(model)}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2)


def _resume(rank, ckpt_dir, total, cut, start_iter):
    import warnings

    from lbcomm.ddp import MissingHookStateWarning

    def build(load=None, hook=True):
        model = _model()
        opt_state = None
        if load is not None:
            info = lbcomm.load_sharded(load, None, model)
            opt_state, hook_sd = info["extra"]["opt"], info["extra"]["hook"]
        ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
        opt = _sgd(ddp.parameters())
        state = OneBitHookState(start_iter, comm=CommConfig(exact_numel=0))
        state.check_resume(opt)
        if load is not None:
            opt.load_state_dict(opt_state)
            if hook:
                state.load_state_dict(hook_sd)
        ddp.register_comm_hook(state, onebit_hook)
        return model, ddp, opt, state

    def missing_state_warnings(hook):  # a resume that restores the model and the optimizer, and the hook or not
        model, ddp, opt, state = build(load=ckpt_dir, hook=hook)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(ddp, opt, rank, 2, first=cut)
        return [str(w.message) for w in caught if issubclass(w.category, MissingHookStateWarning)]

    model, ddp, opt, _ = build()
    _train(ddp, opt, rank, total)
    straight = _flat(model)

    model, ddp, opt, state = build()
    _train(ddp, opt, rank, cut)
    lbcomm.save_sharded(ckpt_dir, None, model, extra={"opt": opt.state_dict(), "hook": state.state_dict()})
    hook_sd = pickle.loads(pickle.dumps(state))  # __getstate__/__setstate__ round trip
    del model, ddp, opt, state

    model, ddp, opt, state = build(load=ckpt_dir)
    _train(ddp, opt, rank, 1, first=cut)
    split = {i: len(keys) for i, keys in state.bucket_units.items()}  # the initial bucket, split into saved units
    _train(ddp, opt, rank, total - cut - 1, first=cut + 1)
    return {"straight": straight, "resumed": _flat(model), "split": split,
            "pickled": (hook_sd.iter, hook_sd.start_iter, hook_sd.planner.num_saved()),
            "warned": {hook: missing_state_warnings(hook) for hook in (True, False)}}


def _onebit_optimizer(rank, opt_cls, lr, dtype, steps, freeze_step):
    model = _model()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    opt = opt_cls(ddp.parameters(), lr=lr, freeze_step=freeze_step, comm=lbcomm.CommConfig(block_size=256))
    ddp.register_comm_hook(WarmupAverage(opt, dtype), warmup_average_hook)
    before = _eval_loss(model)
    grads, warm = {}, None
    for s in range(steps):
        _step(ddp, opt, rank, s)
        if s in (0, freeze_step + 2):
            grads[s] = _grads(model)
        opt.step()
        if s == freeze_step - 1:
            warm = _flat(model)
    return {"before": before, "after": _eval_loss(model), "params": _flat(model), "grads": grads, "warm": warm,
            "averaged_flag": opt.grads_averaged, "frozen": opt.frozen}


def _onebit_adam_without_ddp(rank, freeze_step):
    model = _model()
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=freeze_step,
                            comm=lbcomm.CommConfig(block_size=256))
    _train(model, opt, rank, freeze_step)
    return _flat(model)


def _nonfinite(rank, start_iter):
    model = _model()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    opt = _sgd(ddp.parameters())
    state = OneBitHookState(start_iter, comm=CommConfig(exact_numel=0))
    ddp.register_comm_hook(state, onebit_hook)
    _train(ddp, opt, rank, start_iter + 1)
    before = state.state_dict()
    _step(ddp, opt, rank, 100, poison=(rank == 1))  # rank 1 alone sees Inf/NaN
    grads = _grads(model)
    after = state.state_dict()
    opt.zero_grad()  # the step is skipped, as GradScaler would
    _step(ddp, opt, rank, 101)
    opt.step()
    same = all(torch.equal(a["compression"][k], b["compression"][k]) for a, b in zip(before["units"], after["units"])
               for k in ("worker_error", "server_error"))
    return {"nan_grads": grads, "errors_kept": same and len(before["units"]) == len(after["units"]) > 0,
            "finite_after": bool(torch.isfinite(_flat(model)).all()), "skipped": state.skipped_calls,
            "buckets": len(state.bucket_units)}


def _all_scenarios(rank, p, ckpt_dir):
    logging.basicConfig(level=logging.WARNING)
    return {
        "sgd": _hook_training(rank, _sgd, 30, 3),
        "sgd_plain": _plain_training(rank, _sgd, 30),
        "adamw": _hook_training(rank, _adamw, 30, 2),
        "adamw_plain": _plain_training(rank, _adamw, 30),
        "resume": _resume(rank, ckpt_dir, 12, 7, 3),
        "onebit_adam": _onebit_optimizer(rank, lbcomm.OneBitAdam, 1e-2, torch.float32, 30, 5),
        "onebit_adam_alone": _onebit_adam_without_ddp(rank, 5),
        "onebit_lamb": _onebit_optimizer(rank, lbcomm.OneBitLamb, 0.1, torch.float16, 30, 5),
        "onebit_adam_bf16": _onebit_optimizer(rank, lbcomm.OneBitAdam, 1e-2, torch.bfloat16, 30, 5),
        "nonfinite": _nonfinite(rank, 2),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_all_scenarios, P, str(tmp_path_factory.mktemp("ckpt")), timeout=240)


def _assert_replicas_identical(ranks, name, key="params"):
    for r in range(1, P):
        assert torch.equal(ranks[0][name][key], ranks[r][name][key]), f"{name}: rank {r} diverged from rank 0"


# ---------------------------------------------------------------------- onebit_hook
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_onebit_hook_trains_and_keeps_replicas_identical(ranks, name):
    res = ranks[0][name]
    assert res["after"] < 0.5 * res["before"], (res["before"], res["after"])
    # close to full-precision DDP, but not the same run: the buckets really were compressed
    plain = ranks[0][f"{name}_plain"]
    assert res["after"] < 4 * plain["after"], (res["after"], plain["after"])
    assert not torch.equal(res["params"], plain["params"])
    _assert_replicas_identical(ranks, name)
    # asynchronous: the hook returns before the bucket is reduced (the backward pass goes on)
    assert all(ranks[r][name]["pending_at_return"] > 0 for r in range(P))


def test_onebit_hook_stats(ranks):
    stats = ranks[0]["sgd"]["stats"]
    assert ranks[0]["sgd"]["buckets"] >= 2, "the model should span several DDP buckets"
    assert stats["iter"] == 30 and stats["compressed_calls"] == (30 - 3) * ranks[0]["sgd"]["buckets"]
    # 3 full-precision iterations and 27 compressed ones: well above 5x less traffic overall
    assert stats["compression_ratio"] > 5, stats
    assert stats["error_norm"] > 0 and stats["skipped_calls"] == 0
    # logged at INFO: the config once, then every 5 iterations from start_iter on
    log = ranks[0]["sgd"]["log"]
    assert sum("OneBitHookState config" in m for m in log) == 1
    reports = [m for m in log if m.startswith("onebit_hook stats")]
    assert len(reports) == 6 and all("bytes sent" in m and "ratio" in m and "error norm" in m for m in reports), log


def test_onebit_hook_resume_is_bitwise_exact(ranks):
    for r in range(P):
        res = ranks[r]["resume"]
        assert torch.equal(res["straight"], res["resumed"]), f"rank {r}: resumed run differs from the straight one"
        # the resumed DDP's first (initial-bucket) iteration was reduced as the saved units
        assert max(res["split"].values()) >= 2, res["split"]
        assert res["pickled"] == (7, 3, ranks[0]["sgd"]["buckets"])
        # restored with the model and the optimizer: nothing to say; forgotten: named once
        assert res["warned"][True] == [], res["warned"]
        (msg,) = res["warned"][False]
        assert "OneBitHookState was not restored" in msg and "hook_state=state" in msg, msg


def test_onebit_hook_nonfinite_skips_on_every_rank(ranks):
    for r in range(P):
        res = ranks[r]["nonfinite"]
        assert torch.isnan(res["nan_grads"]).all(), f"rank {r}: every bucket must be NaN, as a plain allreduce gives"
        assert res["errors_kept"], f"rank {r}: a skipped bucket changed the error feedback"
        assert res["finite_after"] and res["skipped"] == res["buckets"] >= 2


# ---------------------------------------------------------------------- warmup_average_hook
@pytest.mark.parametrize("name", ["onebit_adam", "onebit_lamb", "onebit_adam_bf16"])
def test_warmup_average_hook_trains_and_keeps_replicas_identical(ranks, name):
    res = ranks[0][name]
    assert res["frozen"] and res["averaged_flag"]
    assert res["after"] < 0.5 * res["before"], (res["before"], res["after"])
    _assert_replicas_identical(ranks, name)


@pytest.mark.parametrize("name", ["onebit_adam", "onebit_lamb", "onebit_adam_bf16"])
def test_warmup_average_hook_averages_in_warmup_only(ranks, name):
    warm = [ranks[r][name]["grads"][0] for r in range(P)]
    local = [ranks[r][name]["grads"][7] for r in range(P)]
    for r in range(1, P):
        assert torch.equal(warm[0], warm[r]), "warmup gradients must arrive averaged"
        assert not torch.equal(local[0], local[r]), "compression stage: the hook must not communicate"
    if name == "onebit_adam":  # fp32 warmup: the same AdamW as the optimizer averaging by itself
        torch.testing.assert_close(ranks[0][name]["warm"], ranks[0]["onebit_adam_alone"], rtol=1e-5, atol=1e-6)
    wire = {"onebit_adam": torch.float32, "onebit_lamb": torch.float16, "onebit_adam_bf16": torch.bfloat16}[name]
    # the warmup mean travelled in `wire`: every averaged gradient is a value of that dtype
    assert torch.equal(warm[0].to(wire).float(), warm[0])
    if wire != torch.float32:
        assert not torch.equal(local[0].to(wire).float(), local[0]), "local fp32 gradients are not rounded"


def test_warmup_average_checks_its_arguments():
    opt = lbcomm.OneBitAdam([torch.zeros(3, requires_grad=True)])
    assert WarmupAverage(opt).dtype is torch.float32 and WarmupAverage(opt, torch.bfloat16).optimizer is opt
    assert lbcomm.WarmupAverage is WarmupAverage and lbcomm.warmup_average_hook is warmup_average_hook
    with pytest.raises(ValueError, match="torch.bfloat16"):
        WarmupAverage(opt, torch.float64)
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    with pytest.raises(TypeError, match="lbcomm 1-bit optimizer.*onebit_hook"):
        WarmupAverage(sgd)
    with pytest.raises(TypeError, match="WarmupAverage"):
        warmup_average_hook(opt, None)


# ---------------------------------------------------------------------- no ranks needed
def test_exact_index_and_mean_bytes():
    from lbcomm.comm import LoopTransport
    from lbcomm.exact import ExactMean, exact_index

    assert exact_index([5, 3, 0, 2], 0) is None and exact_index([5, 6], 4) is None
    assert exact_index([5, 3, 0, 2], 3).tolist() == [5, 6, 7, 8, 9]
    assert exact_index([5, 3], 3, offsets=[0, 8]).tolist() == [8, 9, 10]  # a padded layout
    assert exact_index([2, 2], 3, whole=[4, 3]).tolist() == [2, 3]  # shards of whole parameters
    mean = ExactMean(transport=LoopTransport(4))
    assert mean.bytes(0) == 0 and mean.bytes(10) == int(2 * 3 / 4 * 40)
    values = torch.arange(3.0)
    assert mean.start(values)() is values and values.tolist() == [0.0, 1.0, 2.0]  # identical ranks: their mean
    with pytest.raises(ValueError, match="not both"):
        ExactMean()


def test_hook_state_validation():
    with pytest.raises(ValueError, match="DDP rebuilds buckets after iteration 1"):
        OneBitHookState(start_iter=1)
    with pytest.raises(ValueError, match="block_size"):
        OneBitHookState(comm=CommConfig(block_size=100))
    with pytest.raises(ValueError, match="nonfinite"):
        OneBitHookState(comm=CommConfig(nonfinite="ignore"))
    with pytest.raises(ValueError, match="logging_frequency"):
        OneBitHookState(compression_stats_logging_frequency=0)
    with pytest.raises(TypeError, match="comm must be a lbcomm.CommConfig"):
        OneBitHookState(comm={"block_size": 256})
    with pytest.raises(ValueError, match="torch.distributed"):
        OneBitHookState(comm=CommConfig(backend="mpi"))
    with pytest.raises(TypeError, match="OneBitHookState"):
        onebit_hook(object(), None)
    with pytest.raises(ValueError, match="not a OneBitHookState"):
        OneBitHookState().load_state_dict({"version": 0})


def test_hook_state_takes_comm_with_its_defaults():
    state = OneBitHookState(normalize="adaptive")  # "auto": flat unless torchrun reports several nodes
    assert state.comm == CommConfig() and state.comm.topology == "auto" and state.comm.nonfinite == "skip"
    assert state.process_group is None and state.comm.exact_numel == 4096 and state.start_iter == 100
    flat = OneBitHookState(3, comm=CommConfig(topology="flat", block_size=256))
    assert (flat.comm.topology, flat.comm.block_size, flat.start_iter) == ("flat", 256, 3)


def test_hook_state_from_another_world_size_resets_with_warning(caplog):
    saved = {"version": 1, "iter": 12, "start_iter": 2, "block_size": 2048, "exact_numel": 4096, "world_size": 4,
             "units": [{"params": [0, 1], "shapes": [[3], [2]], "compression": {}}], "grad_stats": [],
             "stats": {"bytes_sent": 10, "bytes_uncompressed": 40, "compressed_calls": 1, "skipped_calls": 0}}
    state = OneBitHookState(start_iter=2)
    with caplog.at_level(logging.WARNING, logger="lbcomm.ddp"):
        state.load_state_dict(saved)
    assert any("world size 4" in r.getMessage() and "reset" in r.getMessage() for r in caplog.records)
    assert state.iter == 12 and state.total_bytes_sent == 10
    assert state.state_dict()["units"] == []


def test_hook_state_logs_config_and_pickles(caplog):
    with caplog.at_level(logging.INFO, logger="lbcomm.ddp"):
        state = OneBitHookState(start_iter=5, comm=CommConfig(block_size=None, nonfinite="raise"))
    assert any("start_iter = 5" in r.getMessage() for r in caplog.records)
    state.iter = 9
    copy = pickle.loads(pickle.dumps(state))
    assert (copy.start_iter, copy.comm.block_size, copy.comm.nonfinite, copy.iter, copy.process_group) == \
        (5, None, "raise", 9, None)
