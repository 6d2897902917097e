"""Never silent: duplicated communication (a DDP's allreduce, or onebit_hook's compression,
under a 1-bit optimizer) raises an error that names the fix,
the freeze logs what the compression stage sends, and a shard saved for another rank is
reported with its cause and fix. Real gloo processes, real DDP."""
import logging

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import lbcomm
from dist_util import run_ranks
from lbcomm.common import ring_allreduce_bytes
from lbcomm.ddp import OneBitHookState, WarmupAverage, onebit_hook, warmup_average_hook
from lbcomm.errors import AveragedGradientsError
from optim_util import OPTS, _batch, _loss, _mlp

FREEZE = 3


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append((record.levelname, record.getMessage()))


def _capture():
    h = _Records()
    logger = logging.getLogger("lbcomm")
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    return h.records


def _steps(model, opt, rank, steps, same_batch=False):
    """Train; returns (step at which AveragedGradientsError was raised, its message) or (None, None)."""
    for t in range(steps):
        opt.zero_grad()
        x, y = _batch(0 if same_batch else rank, t)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        try:
            opt.step()
        except AveragedGradientsError as exc:
            return t + 1, str(exc), opt.global_step
    return None, None, opt.global_step


def _averaged_grads(rank, p):
    out = {}
    for name, cls in OPTS.items():
        # a DDP without lbcomm's hook: caught at the first warmup step, state untouched
        model = _mlp(seed=1)
        ddp = DDP(model)
        out[(name, "plain_ddp")] = _steps(ddp, cls(ddp.parameters(), lr=1e-2, freeze_step=FREEZE), rank, 6)
        # a custom hook that averages and claims grads_averaged: caught at the first compression step
        model = _mlp(seed=1)
        ddp = DDP(model)
        opt = cls(ddp.parameters(), lr=1e-2, freeze_step=FREEZE)
        opt.grads_averaged = True
        out[(name, "averaging_hook")] = _steps(ddp, opt, rank, 6)
        # onebit_hook compresses the gradients already: a second compression, caught at the first step
        model = _mlp(seed=1)
        ddp = DDP(model)
        ddp.register_comm_hook(OneBitHookState(start_iter=2), onebit_hook)
        out[(name, "onebit_hook")] = _steps(ddp, cls(ddp.parameters(), lr=1e-2, freeze_step=FREEZE), rank, 6)
        # lbcomm's warmup hook: nothing to report
        model = _mlp(seed=1)
        ddp = DDP(model)
        opt = cls(ddp.parameters(), lr=1e-2, freeze_step=FREEZE)
        ddp.register_comm_hook(WarmupAverage(opt), warmup_average_hook)
        out[(name, "lbcomm_hook")] = _steps(ddp, opt, rank, 6)
        # onebit_hook (compressing the gradients) under the 1-bit optimizer (compressing its momentum): the
        # gradients arrive averaged (in full precision during the hook's start, compressed after it) ...
        model = _mlp(seed=1)
        ddp = DDP(model)
        ddp.register_comm_hook(OneBitHookState(2), onebit_hook)
        out[(name, "onebit_hook")] = _steps(ddp, cls(ddp.parameters(), lr=1e-2, freeze_step=FREEZE), rank, 6)
        # ... also when told they arrive averaged: caught past the freeze, when the hook compresses
        model = _mlp(seed=1)
        ddp = DDP(model)
        ddp.register_comm_hook(OneBitHookState(2), onebit_hook)
        opt = cls(ddp.parameters(), lr=1e-2, freeze_step=FREEZE)
        opt.grads_averaged = True
        out[(name, "onebit_hook_told")] = _steps(ddp, opt, rank, 6)
        # no DDP but every rank the same batch: the false positive the error message names ...
        model = _mlp(seed=1)
        out[(name, "same_batch")] = _steps(model, cls(model.parameters(), lr=1e-2, freeze_step=FREEZE), rank, 6,
                                           same_batch=True)
        # ... and its opt-out
        model = _mlp(seed=1)
        opt = cls(model.parameters(), lr=1e-2, freeze_step=FREEZE,
                  comm=lbcomm.CommConfig(detect_averaged_grads=False))
        out[(name, "same_batch_opt_out")] = _steps(model, opt, rank, 6, same_batch=True)
    return out


@pytest.fixture(scope="module")
def averaged():
    return run_ranks(_averaged_grads, 2, timeout=240)


@pytest.mark.parametrize("name", list(OPTS))
def test_gradients_averaged_by_ddp_raise_at_the_first_step(averaged, name):
    for r in range(2):
        step, msg, taken = averaged[r][(name, "plain_ddp")]
        assert step == 1 and taken == 0, (step, taken)
        for fix in ("(warmup)", "identical on all 2 ranks", "lbcomm.attach(ddp_model, optimizer)",
                    "DistributedDataParallel's own", "onebit_hook", "warmup_average_hook", "LbcommCallback",
                    "detect_averaged_grads=False"):
            assert fix in msg, (fix, msg)


@pytest.mark.parametrize("name", list(OPTS))
def test_a_compressing_hook_and_a_onebit_optimizer_raise_at_the_first_step(averaged, name):
    """onebit_hook's DDP and a 1-bit optimizer would compress twice: the averaged-gradients
    probe catches it, and the error names the hook."""
    for r in range(2):
        step, msg, taken = averaged[r][(name, "onebit_hook")]
        assert step == 1 and taken == 0, (step, taken)
        assert "compressing hook such as lbcomm.onebit_hook" in msg, msg


@pytest.mark.parametrize("name", list(OPTS))
def test_gradients_averaged_after_the_freeze_raise_at_the_first_compression_step(averaged, name):
    for r in range(2):
        step, msg, taken = averaged[r][(name, "averaging_hook")]
        assert step == FREEZE + 1 and taken == FREEZE, (step, taken)
        assert "(compression)" in msg and "nothing is saved" in msg, msg


@pytest.mark.parametrize("name", list(OPTS))
def test_lbcomm_hook_and_opt_out_train_through(averaged, name):
    for r in range(2):
        assert averaged[r][(name, "lbcomm_hook")] == (None, None, 6)
        assert averaged[r][(name, "same_batch_opt_out")] == (None, None, 6)
        step, msg, _ = averaged[r][(name, "same_batch")]
        assert step == 1 and "same batch on every rank" in msg, msg


@pytest.mark.parametrize("name", list(OPTS))
def test_onebit_hook_under_a_onebit_optimizer_raises(averaged, name):
    """Double compression: the optimizer's averaged-gradients probe catches onebit_hook's
    gradients, in the warmup (averaged by the hook's full-precision start) and, when the
    optimizer is told they arrive averaged, at the first step past the freeze (compressed
    by the hook, bitwise identical on every rank)."""
    for r in range(2):
        step, msg, taken = averaged[r][(name, "onebit_hook")]
        assert step == 1 and taken == 0 and "identical on all 2 ranks" in msg, (step, taken, msg)
        step, msg, taken = averaged[r][(name, "onebit_hook_told")]
        assert step == FREEZE + 1 and taken == FREEZE and "(compression)" in msg, (step, taken, msg)


@pytest.mark.parametrize("name", list(OPTS))
def test_double_compression_error_names_onebit_hook(averaged, name):
    for r in range(2):
        for case in ("onebit_hook", "onebit_hook_told"):
            msg = averaged[r][(name, case)][1]
            assert "onebit_hook" in msg, msg


def _freeze_log_and_foreign_shard(rank, p):
    records = _capture()
    out = {}
    for name, cls in OPTS.items():
        model = _mlp(seed=2)
        opt = cls(model.parameters(), lr=1e-2, freeze_step=FREEZE, comm=lbcomm.CommConfig(block_size=64))
        for t in range(FREEZE + 2):
            opt.zero_grad()
            _loss(model, rank, t).backward()
            opt.step()
        out[name] = {}
        # rank 0's state on every rank (what the frameworks do), then this rank's own
        sd = opt.state_dict()
        shards = [None] * p
        torch.distributed.all_gather_object(shards, sd)
        del records[:]
        opt.load_state_dict(shards[0])
        opt.load_state_dict(shards[rank])
        opt.zero_grad()
        _loss(model, rank, 50).backward()
        opt.step()
        out[name]["own_shard_follows"] = list(records)
        del records[:]
        opt.load_state_dict(shards[0])
        opt.zero_grad()
        _loss(model, rank, 51).backward()
        opt.step()
        out[name]["foreign_only"] = list(records)
    out["log"] = records
    return out


@pytest.fixture(scope="module")
def freeze_log():
    return run_ranks(_freeze_log_and_foreign_shard, 2, timeout=180)


def test_freeze_logs_what_the_compression_stage_sends():
    res = run_ranks(_freeze_log_only, 2, timeout=120)
    for r in range(2):
        sent, fp32, log = res[r]
        line = [m for lvl, m in log if "the compression stage sends" in m]
        assert len(line) == 1 and f"sends {sent} bytes per step" in line[0] and f"against {fp32} " in line[0], log
        assert f"{fp32 / sent:.1f}x less" in line[0], line


def test_exact_numel_covering_most_of_the_model_is_a_warning():
    """The default exact_numel (4096) averages this small model exactly: said at the freeze,
    as a warning naming the fix, with the exact bytes in the sends line."""
    for fp32, log in run_ranks(_freeze_log_defaults, 2, timeout=120):
        warned = [m for lvl, m in log if lvl == "WARNING" and "exact_numel=4096" in m]
        assert len(warned) == 1 and "that is most of this model" in warned[0] and "exact_numel=0" in warned[0], log
        line = [m for lvl, m in log if "the compression stage sends" in m]
        assert len(line) == 1 and f"exact parameters {fp32} " in line[0], line


def _train_past_freeze(rank, **kw):
    records = _capture()
    model = _mlp(seed=2)
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE,
                            comm=lbcomm.CommConfig(block_size=64, **kw))
    for t in range(FREEZE + 3):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
    return opt, records


def _freeze_log_defaults(rank, p):
    opt, records = _train_past_freeze(rank)
    return int(ring_allreduce_bytes(4 * opt.compression_state.numel, p)), list(records)


def _freeze_log_only(rank, p):
    opt, records = _train_past_freeze(rank, exact_numel=0)
    comp = opt.compression_state
    agreement = 4 * (1 + len(opt.param_groups[0]["params"]))  # one fp32 scalar + one per parameter (rescale_variance)
    return (comp.bytes_per_call(checked=True) + int(ring_allreduce_bytes(agreement, p)),
            int(ring_allreduce_bytes(4 * comp.numel, p)), list(records))


@pytest.mark.parametrize("name", list(OPTS))
def test_a_shard_of_another_rank_is_reported_with_cause_and_fix(freeze_log, name):
    # followed by the rank's own shard (as the integrations do): INFO only on rank 1, no warning
    for r in range(2):
        own = freeze_log[r][name]["own_shard_follows"]
        assert not [m for lvl, m in own if lvl == "WARNING"], own
        info = [m for lvl, m in own if "was given the compression error buffers that rank 0 saved" in m]
        assert len(info) == (1 if r == 1 else 0), own
    # the foreign shard alone: a warning at the next step on rank 1, with cause and fix
    warned = [m for lvl, m in freeze_log[1][name]["foreign_only"] if lvl == "WARNING"]
    assert len(warned) == 1, freeze_log[1][name]["foreign_only"]
    for part in ("rank 1 of 2", "rank 0 saved", "save the optimizer of rank 0 only", "LbcommCallback",
                 "save_sharded", "RankLocal"):
        assert part in warned[0], (part, warned[0])
    assert not [m for lvl, m in freeze_log[0][name]["foreign_only"] if lvl == "WARNING"]
