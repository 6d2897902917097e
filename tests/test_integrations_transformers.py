"""transformers.Trainer with lbcomm.integrations.transformers.LbcommCallback: 2 ranks
under torchrun (gloo), a tiny GPT-2 from a config, synthetic tokens.

One worker run per optimizer trains 9 steps (freeze after step 4, gradient accumulation 2,
clipping, a warmup/decay schedule, checkpoints every 3 steps with save_total_limit=2), then
resumes from checkpoint-6 in a fresh Trainer."""
import os

import pytest
import torch

pytest.importorskip("transformers")

from lbcomm.integrations.transformers import ClippingTakenOverWarning  # noqa: E402
from integrations_checks import check_resume, check_shared_clipping, check_wire  # noqa: E402
from integrations_util import WORKERS, results, torchrun  # noqa: E402

FREEZE = 4
CLIP = 0.05  # trainer_worker.py's CLIP
ARGS_CLIP = 1.2  # trainer_worker.py's ARGS_CLIP: the callback's max_grad_norm, or the Trainer's under the hook


def check_logged_norm(r, clip, key):
    """The logged norm `key` (the callback's lbcomm_grad_norm with a lbcomm optimizer, the
    Trainer's grad_norm under the hook) is the same on both ranks and is the shared norm
    sqrt(mean_r ||g_r||^2) of the gradients before clipping: where it is <= clip nothing
    was clipped and the recorded gradients give it directly; above, they were clipped by
    one coefficient, so their shared norm is clip."""
    clipped = []
    for step in range(1, 10):
        n0, n1 = r[0]["logged"][step][key], r[1]["logged"][step][key]
        clipped.append(n0 > clip)
        assert n0 == n1, (step, n0, n1)
        g0, g1 = r[0]["grads"][step].double(), r[1]["grads"][step].double()
        shared = float(((g0.norm() ** 2 + g1.norm() ** 2) / 2).sqrt())
        if n0 <= clip:
            assert abs(n0 - shared) <= 1e-5 * shared, (step, n0, shared)
        else:
            assert abs(shared - clip) <= 1e-4 * clip, (step, n0, shared)
    return clipped


@pytest.mark.parametrize("kind", ["onebit_adam", "adamw_hook"])
def test_trainer_compresses_and_resumes_bitwise(kind, tmp_path):
    torchrun(os.path.join(WORKERS, "trainer_worker.py"), tmp_path, kind)
    r = results(tmp_path)
    numel = r[0]["numel"]
    for rank in range(2):
        res = r[rank]
        # save_total_limit=2 removed checkpoint-3 together with its lbcomm shards.
        assert res["checkpoints"] == ["checkpoint-6", "checkpoint-9"]
        assert {"shard-00000-of-00002.pt", "shard-00001-of-00002.pt", "optimizer.pt"} <= set(res["shards"])
        if kind == "onebit_adam":
            assert [s for s, f in res["frozen"].items() if f] == list(range(FREEZE, 10))
            per_call = res["per_call"][9]
        else:  # the hook's own count of what it sent, per step
            sent = res["hook_sent"]
            per_step = {s: sent[s] - sent[s - 1] for s in range(FREEZE + 2, 10)}
            assert len(set(per_step.values())) == 1, per_step
            per_call = per_step[9]
        assert 0 < per_call * 20 < numel * 4
        # steps 8 and 9 are steady (step 5 holds the first call's layout check, step 7 the
        # saving barrier of checkpoint-6)
        check_wire(res["bytes"], per_call, warmup_steps=[2, 3], steady_steps=[8, 9], numel=numel, world=2)
        check_wire({**res["bytes"], **res["resumed_bytes"]}, per_call, warmup_steps=[2, 3], steady_steps=[8, 9],
                   numel=numel, world=2)
        check_resume(res["full"], res["resumed"], ["params", "optimizer"] + (["hook"] if kind == "adamw_hook" else []))
    # the callback's shared norm (lbcomm optimizer) or the Trainer's own of the hook's averaged gradients
    clipped = check_logged_norm(r, ARGS_CLIP, "lbcomm_grad_norm" if kind == "onebit_adam" else "grad_norm")
    if kind == "onebit_adam":  # both cases seen after the freeze (else adjust ARGS_CLIP to this run's norms)
        assert not all(clipped[FREEZE:]) and any(clipped[FREEZE:]), clipped
    g0, g1 = r[0]["grads"], r[1]["grads"]
    for step in range(1, FREEZE + 1):  # warmup: DDP averaged the gradients
        assert torch.equal(g0[step], g1[step]), step
    for step in range(FREEZE + 1, 10):
        if kind == "onebit_adam":  # compression stage: DDP's allreduce is off, the gradients stay local
            assert not torch.equal(g0[step], g1[step]), step
        else:  # onebit_hook: the 1-bit allreduce gives every rank the same (approximate) mean
            assert torch.equal(g0[step], g1[step]), step


def test_trainer_clips_by_one_norm_with_the_callback(tmp_path):
    """LbcommCallback(max_grad_norm=CLIP), Trainer's own clipping off: warmup gradients
    (averaged by the hook) are clipped as torch would; compression-stage gradients (local)
    by one coefficient on both ranks, so sqrt(mean_r ||g_r||^2) == CLIP; resume stays bitwise."""
    torchrun(os.path.join(WORKERS, "trainer_worker.py"), tmp_path, "onebit_adam_clip")
    r = results(tmp_path)
    for rank in range(2):
        check_resume(r[rank]["full"], r[rank]["resumed"], ["params", "optimizer"])
    check_shared_clipping(r[0]["grads"], r[1]["grads"], FREEZE, CLIP)
    check_logged_norm(r, CLIP, "lbcomm_grad_norm")
    for rank in range(2):  # the Trainer's own grad_norm is this rank's: the shared one in the warmup only
        logged = r[rank]["logged"]
        for step in range(1, FREEZE + 1):
            n, shared = logged[step]["grad_norm"], logged[step]["lbcomm_grad_norm"]
            assert abs(n - shared) <= 1e-5 * shared, (rank, step, n, shared)
    assert any(r[0]["logged"][s]["grad_norm"] != r[1]["logged"][s]["grad_norm"] for s in range(FREEZE + 1, 10))


def _trainer(tmp_path, opt_of, max_grad_norm):
    from transformers import Trainer, TrainingArguments

    model = torch.nn.Linear(4, 4)
    args = TrainingArguments(output_dir=str(tmp_path), max_grad_norm=max_grad_norm, use_cpu=True, report_to="none")
    opt = opt_of(model)
    return Trainer(model=model, args=args, optimizers=(opt, None)), opt


def _begin(cb, trainer, opt):
    from transformers import TrainerControl, TrainerState

    cb.on_train_begin(trainer.args, TrainerState(), TrainerControl(), model=trainer.model, optimizer=opt)


def test_callback_logs_its_norm_and_refuses_bad_settings(tmp_path):
    import lbcomm
    from lbcomm.errors import DoubleCompressionError
    from lbcomm.integrations.transformers import LbcommCallback

    def onebit(m):
        return lbcomm.OneBitAdam(m.parameters(), lr=1e-3, freeze_step=2)

    trainer, opt = _trainer(tmp_path, onebit, 0)
    cb = LbcommCallback(trainer, max_grad_norm=1.0)
    logs = {"loss": 1.0}
    cb.on_log(None, None, None, logs=logs)
    assert logs == {"loss": 1.0}  # nothing clipped yet
    cb.grad_norm = 0.25
    cb.on_log(None, None, None, logs=logs)
    assert logs["lbcomm_grad_norm"] == 0.25
    with pytest.raises(ValueError, match="invalid max_grad_norm"):
        LbcommCallback(trainer, max_grad_norm=0)
    with pytest.raises(TypeError, match="first argument is the transformers Trainer"):
        LbcommCallback(lbcomm.OneBitHookState())  # a hook state is a keyword argument
    _begin(cb, trainer, opt)  # one process, no DDP: nothing attached, nothing refused
    other, _ = _trainer(tmp_path, onebit, 0)
    with pytest.raises(ValueError, match="built for another Trainer"):
        _begin(cb, other, opt)
    # The Trainer's own clipping with a lbcomm optimizer would clip every rank by its own
    # norm: the callback takes it over, clipping by the norm of all ranks, and says so.
    trainer, opt = _trainer(tmp_path, onebit, 1.0)
    with pytest.warns(ClippingTakenOverWarning, match=r"clipping at max_grad_norm=1.0 by one norm for all ranks"):
        _begin(LbcommCallback(trainer), trainer, opt)
    assert trainer.args.max_grad_norm == 0
    # A hook state with a 1-bit optimizer: two compressors on the same gradients.
    trainer, opt = _trainer(tmp_path, onebit, 0)
    with pytest.raises(DoubleCompressionError, match="Drop the hook state"):
        _begin(LbcommCallback(trainer, hook_state=lbcomm.OneBitHookState()), trainer, opt)
    trainer, opt = _trainer(tmp_path, lambda m: torch.optim.AdamW(m.parameters()), 1.0)
    with pytest.raises(ValueError, match="nothing would be compressed"):
        _begin(LbcommCallback(trainer), trainer, opt)
    _begin(LbcommCallback(trainer, hook_state=lbcomm.OneBitHookState()), trainer, opt)  # the hook: Trainer clips


def test_callback_takes_local_updates_and_a_dct_hook_state(tmp_path):
    """One process, no DDP: local updates given as the object or as a function of the
    Trainer's model and optimizer, local.step() after every optimizer step; the refusals
    (another optimizer than the inner one, max_grad_norm or hook_state beside them, a
    DCTHookState with a 1-bit optimizer)."""
    import lbcomm
    from lbcomm.errors import DoubleCompressionError
    from lbcomm.integrations.transformers import LbcommCallback

    trainer, opt = _trainer(tmp_path, lambda m: torch.optim.AdamW(m.parameters()), 1.0)
    local = lbcomm.OneBitLocalUpdates(trainer.model.parameters(), opt, 2)
    cb = LbcommCallback(trainer, local_updates=local)
    _begin(cb, trainer, opt)  # the Trainer's own clipping stays: it clips each rank's gradient
    cb.on_optimizer_step(trainer.args, None, None)
    assert local.inner_steps == 1
    built = []
    cb = LbcommCallback(trainer, local_updates=lambda model, inner: built.append(
        lbcomm.OneBitLocalUpdates(model.parameters(), inner, 2)) or built[-1])
    _begin(cb, trainer, opt)
    assert cb.local_updates is built[0] and built[0].inner is opt and built[0].params[0] is trainer.model.weight
    other = lbcomm.OneBitLocalUpdates(trainer.model.parameters(), torch.optim.SGD(trainer.model.parameters()), 2)
    with pytest.raises(ValueError, match="not the OneBitLocalUpdates' inner optimizer"):
        _begin(LbcommCallback(trainer, local_updates=other), trainer, opt)
    with pytest.raises(ValueError, match="clips it by its own norm"):
        LbcommCallback(trainer, local_updates=local, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="pass one of them"):
        LbcommCallback(trainer, hook_state=lbcomm.DCTHookState(2), local_updates=local)
    with pytest.raises(TypeError, match="must be a lbcomm.OneBitLocalUpdates"):
        LbcommCallback(trainer, local_updates=3)
    _begin(LbcommCallback(trainer, hook_state=lbcomm.DCTHookState(2)), trainer, opt)

    def onebit(m):
        return lbcomm.OneBitAdam(m.parameters(), lr=1e-3, freeze_step=2)

    trainer, opt = _trainer(tmp_path, onebit, 0)
    with pytest.raises(DoubleCompressionError, match="DCTHookState's dct_hook"):
        _begin(LbcommCallback(trainer, hook_state=lbcomm.DCTHookState(2)), trainer, opt)


def _two_ranks_with_checkpoints(tmp_path, case):
    """Run the worker's `case` on 2 ranks; every rank saved checkpoint-6 and -9. Returns
    the ranks' results and the bytes of one fp32 ring allreduce of the model."""
    from integrations_checks import ring_bytes

    torchrun(os.path.join(WORKERS, "trainer_worker.py"), tmp_path, case)
    r = results(tmp_path)
    assert all(res["checkpoints"] == ["checkpoint-6", "checkpoint-9"] for res in r)
    return r, ring_bytes(r[0]["numel"], 2)


def test_trainer_local_updates_sync_and_resume_bitwise(tmp_path):
    """LbcommCallback(trainer, local_updates=OneBitLocalUpdates(..., sync_every=4)) with
    AdamW inside, gradient accumulation 2 and the Trainer's own (local) clipping: DDP sends
    nothing (every rank's gradient stays its own), local.step() follows each of the 9
    optimizer steps, the replicas are bitwise identical after the synchronizations of steps
    4 and 8 only, and the run resumed from the mid-round checkpoint-6 ends bitwise where
    the uninterrupted one ends (every rank's weights, AdamW state and local-updates state)."""
    r, ring = _two_ranks_with_checkpoints(tmp_path, "adamw_local")
    for rank in range(2):
        res = r[rank]
        assert {"shard-00000-of-00002.pt", "shard-00001-of-00002.pt"} <= set(res["shards"])
        stats = res["hook_stats"]
        assert (stats["inner_steps"], stats["syncs"], stats["compressed_calls"]) == (9, 2, 2)
        sent = res["hook_sent"]
        assert [s for s in range(2, 10) if sent[s] != sent[s - 1]] == [4, 8]
        assert sent[4] - sent[3] == stats["bytes_per_sync"] and stats["bytes_per_sync"] * 10 < ring
        for step in (2, 5, 6):  # no synchronization, no checkpoint: DDP's allreduce is off
            assert res["bytes"][step] * 10 < ring, (step, res["bytes"][step], ring)
        check_resume(res["full"], res["resumed"], ["params", "optimizer", "hook"])
        assert torch.equal(res["resumed_params"][8], res["params"][8])
    for step in range(1, 10):
        assert not torch.equal(r[0]["grads"][step], r[1]["grads"][step]), step  # local gradients
        assert torch.equal(r[0]["params"][step], r[1]["params"][step]) == (step in (4, 8)), step


def test_trainer_with_dct_hook_state_resumes_bitwise(tmp_path):
    """LbcommCallback(trainer, hook_state=DCTHookState(4, density=0.05)) with AdamW: dct_hook
    averages the first 4 steps in fp32, then sends a few percent of the entries (the TCP
    bytes and the state's own count say so); the gradients are the same on both ranks; the
    resume from checkpoint-6 restores the residuals and ends bitwise."""
    r, ring = _two_ranks_with_checkpoints(tmp_path, "adamw_dct")
    for rank in range(2):
        res = r[rank]
        stats = res["hook_stats"]
        assert stats["iter"] == STEPS and stats["compressed_calls"] >= STEPS - FREEZE and stats["skipped_calls"] == 0
        sent = res["hook_sent"]
        for step in range(2, FREEZE + 1):
            assert sent[step] - sent[step - 1] == ring, step
        for step in range(FREEZE + 1, 10):
            assert 0 < (sent[step] - sent[step - 1]) * 4 < ring, step
        for step in (8, 9):  # on the wire too: DDP's allreduce is replaced
            assert res["bytes"][step] * 4 < ring, (step, res["bytes"][step], ring)
        check_resume(res["full"], res["resumed"], ["params", "optimizer", "hook"])
    for step in range(1, 10):
        assert torch.equal(r[0]["grads"][step], r[1]["grads"][step]), step


STEPS = 9  # trainer_worker.py's STEPS
