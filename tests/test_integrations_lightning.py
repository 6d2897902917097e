"""Lightning (strategy "ddp" on CPU, gloo) with lbcomm.integrations.lightning.LbcommCallback:
2 ranks under torchrun, a small MLP, synthetic data.

One worker run per optimizer trains 3 epochs of 3 steps (freeze after step 4,
accumulate_grad_batches=2, clipping, a per-step LambdaLR), checkpointing every 3
steps, then resumes from the step-6 checkpoint (mid-compression) in a fresh Trainer."""
import os

import pytest
import torch

pytest.importorskip("lightning")

from integrations_checks import check_resume, check_shared_clipping, check_wire  # noqa: E402
from integrations_util import WORKERS, results, torchrun  # noqa: E402

FREEZE = 4
SOME_CLIP = 0.5  # lightning_worker.py's SOME_CLIP


@pytest.mark.parametrize("kind", ["onebit_lamb", "sgd_hook"])
def test_lightning_compresses_and_resumes_bitwise(kind, tmp_path):
    torchrun(os.path.join(WORKERS, "lightning_worker.py"), tmp_path, kind)
    r = results(tmp_path)
    numel = r[0]["numel"]
    for rank in range(2):
        res = r[rank]
        assert res["checkpoints"] == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "epoch=2-step=9.ckpt"]
        assert (res["saved_world"], res["saved_ranks"]) == (2, 2)  # every rank's entry in rank 0's file
        assert res["resumed_batches"] == res["batches"][12:]  # the resumed run saw the same data
        if kind == "onebit_lamb":
            assert [s for s, f in res["frozen"].items() if f] == list(range(FREEZE + 1, 10))
            # the compressed call, 20x below fp32; the step also sends the norm estimate's
            # fp64 samples, which on this 17k-parameter model outweigh it
            assert 0 < res["compressed"][9] * 20 < numel * 4
            per_call = res["per_call"][9]
            assert per_call * 5 < numel * 4
        else:
            sent = res["hook_sent"]
            per_step = {s: sent[s] - sent[s - 1] for s in range(FREEZE + 2, 10)}
            assert len(set(per_step.values())) == 1, per_step
            per_call = per_step[9]
            assert 0 < per_call * 20 < numel * 4
        # The probe reads the counters before each optimizer step: steps 8 and 9 are steady
        # (step 7 holds the checkpoint of step 6).
        check_wire(res["bytes"], per_call, warmup_steps=[2, 3], steady_steps=[8, 9], numel=numel, world=2)
        check_wire({**res["bytes"], **res["resumed_bytes"]}, per_call, warmup_steps=[2, 3], steady_steps=[9],
                   numel=numel, world=2)
        check_resume(res["full"], res["resumed"], ["params", "optimizer"] + (["hook"] if kind == "sgd_hook" else []))
    g0, g1 = r[0]["grads"], r[1]["grads"]
    if kind == "onebit_lamb":  # the callback clipped by the shared norm, logged on every rank alike
        assert sorted(r[0]["logged"]) == list(range(1, 10)) and r[0]["logged"] == r[1]["logged"]
        for step in range(1, 10):  # the probe saw the gradients after the clipping
            logged = r[0]["logged"][step]
            shared = float(((g0[step].double().norm() ** 2 + g1[step].double().norm() ** 2) / 2).sqrt())
            if logged <= SOME_CLIP:  # nothing clipped: the gradients give the logged norm
                assert abs(logged - shared) <= 1e-5 * shared, (step, logged, shared)
            else:  # clipped by one coefficient on both ranks
                assert abs(shared - SOME_CLIP) <= 1e-4 * SOME_CLIP, (step, logged, shared)
    else:  # the hook averages: Lightning's own clipping is the same on every rank, the callback logs nothing
        assert r[0]["logged"] == r[1]["logged"] == {}
    for step in range(1, FREEZE + 1):
        assert torch.equal(g0[step], g1[step]), step
    for step in range(FREEZE + 1, 10):
        if kind == "onebit_lamb":  # DDP's allreduce is off: local gradients
            assert not torch.equal(g0[step], g1[step]), step
        else:
            assert torch.equal(g0[step], g1[step]), step


CLIP = 0.02  # lightning_worker.py's CLIP


def test_lightning_clips_by_one_norm_with_the_callback(tmp_path):
    """LbcommCallback(max_grad_norm=CLIP), gradient_clip_val unset: warmup gradients (averaged
    by the hook) clipped as torch would, compression-stage gradients (local) by one
    coefficient on both ranks, so sqrt(mean_r ||g_r||^2) == CLIP; resume stays bitwise."""
    torchrun(os.path.join(WORKERS, "lightning_worker.py"), tmp_path, "onebit_lamb_clip")
    r = results(tmp_path)
    for rank in range(2):
        check_resume(r[rank]["full"], r[rank]["resumed"], ["params", "optimizer"])
    check_shared_clipping(r[0]["grads"], r[1]["grads"], FREEZE, CLIP)
    assert sorted(r[0]["logged"]) == list(range(1, 10)) and r[0]["logged"] == r[1]["logged"]


def test_callback_refuses_rank_local_clipping_and_double_compression():
    """Checked at fit start, before anything is attached: Lightning's own clipping by norm
    of a lbcomm optimizer's (local) gradients, a hook state with a 1-bit optimizer."""
    from types import SimpleNamespace

    import lbcomm
    from lbcomm.errors import DoubleCompressionError
    from lbcomm.integrations.lightning import LbcommCallback

    model = torch.nn.Linear(4, 4)
    opt = lbcomm.OneBitLamb(model.parameters(), lr=1e-3, freeze_step=2)

    def trainer(clip=None, algorithm=None, optimizer=opt):
        return SimpleNamespace(optimizers=[optimizer], gradient_clip_val=clip, gradient_clip_algorithm=algorithm)

    assert LbcommCallback()._lbcomm_optimizer(trainer()) is opt
    assert LbcommCallback()._lbcomm_optimizer(trainer(0.5, "value")) is opt  # by value: elementwise, no norm
    with pytest.raises(ValueError, match=r"leave gradient_clip_val unset and pass LbcommCallback\(max_grad_norm=0.5\)"):
        LbcommCallback()._lbcomm_optimizer(trainer(0.5))
    with pytest.raises(ValueError, match="leave gradient_clip_val unset"):
        LbcommCallback(max_grad_norm=0.5)._lbcomm_optimizer(trainer(0.5, "norm"))
    with pytest.raises(DoubleCompressionError, match="Drop the hook state"):
        LbcommCallback(hook_state=lbcomm.OneBitHookState())._lbcomm_optimizer(trainer())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert LbcommCallback(hook_state=lbcomm.OneBitHookState())._lbcomm_optimizer(trainer(0.5, optimizer=sgd)) is None
    with pytest.raises(ValueError, match="nothing would be compressed"):
        LbcommCallback()._lbcomm_optimizer(trainer(optimizer=sgd))


def test_lightning_local_updates_sync_and_resume_bitwise(tmp_path):
    """LbcommCallback(local_updates=lambda module, opt: OneBitLocalUpdates(..., sync_every=4))
    with SGD, accumulate_grad_batches=2 and Lightning's own (local) clipping: DDP sends
    nothing, local.step() follows each of the 9 optimizer steps (not the 18 batches), the
    replicas are bitwise identical after the synchronizations of steps 4 and 8 only, and
    the run resumed from the mid-round step-6 checkpoint ends bitwise where the
    uninterrupted one ends (every rank's weights, SGD state and local-updates state)."""
    from integrations_checks import ring_bytes

    torchrun(os.path.join(WORKERS, "lightning_worker.py"), tmp_path, "sgd_local")
    r = results(tmp_path)
    ring = ring_bytes(r[0]["numel"], 2)
    for rank in range(2):
        res = r[rank]
        assert res["checkpoints"] == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "epoch=2-step=9.ckpt"]
        assert (res["saved_world"], res["saved_ranks"]) == (2, 2)
        assert res["resumed_batches"] == res["batches"][12:]
        stats = res["stats"]
        assert (stats["inner_steps"], stats["syncs"], stats["compressed_calls"]) == (9, 2, 2)
        sent = res["local_sent"]
        assert [s for s in range(2, 10) if sent[s] != sent[s - 1]] == [4, 8]
        assert stats["bytes_per_sync"] * 10 < ring
        # The probe reads the counters before each optimizer step: these steps' windows hold no
        # synchronization (after steps 4 and 8) and no checkpoint (after steps 3 and 6).
        for step in (2, 3, 6, 8):
            assert res["bytes"][step] * 10 < ring, (step, res["bytes"][step], ring)
        assert res["logged"] == {}
        check_resume(res["full"], res["resumed"], ["params", "optimizer", "hook"])
        assert torch.equal(res["resumed_params"][8], res["params"][8])
    for step in range(1, 10):
        assert not torch.equal(r[0]["grads"][step], r[1]["grads"][step]), step  # local gradients
        assert torch.equal(r[0]["params"][step], r[1]["params"][step]) == (step in (4, 8)), step


def test_lightning_with_dct_hook_state_resumes_bitwise(tmp_path):
    """LbcommCallback(hook_state=DCTHookState(4, density=0.05)) with SGD: dct_hook averages the
    first 4 steps in fp32, then sends a few percent of the entries; the gradients are the
    same on both ranks; the resume from the step-6 checkpoint restores every rank's
    residuals from rank 0's file and ends bitwise."""
    from integrations_checks import ring_bytes

    torchrun(os.path.join(WORKERS, "lightning_worker.py"), tmp_path, "sgd_dct")
    r = results(tmp_path)
    ring = ring_bytes(r[0]["numel"], 2)
    for rank in range(2):
        res = r[rank]
        assert (res["saved_world"], res["saved_ranks"]) == (2, 2)
        stats = res["stats"]
        assert stats["iter"] == 9 and stats["compressed_calls"] >= 9 - FREEZE and stats["skipped_calls"] == 0
        sent = res["hook_sent"]
        for step in range(2, FREEZE + 1):
            assert sent[step] - sent[step - 1] == ring, step
        for step in range(FREEZE + 1, 10):
            assert 0 < (sent[step] - sent[step - 1]) * 4 < ring, step
        check_resume(res["full"], res["resumed"], ["params", "optimizer", "hook"])
    for step in range(1, 10):
        assert torch.equal(r[0]["grads"][step], r[1]["grads"][step]), step


def test_callback_checks_local_updates_and_dct_hook_state():
    """Checked at fit start: local updates whose inner optimizer is not what
    configure_optimizers returned, a factory that returns something else, a DCTHookState
    with a 1-bit optimizer; at construction: local updates with max_grad_norm or hook_state."""
    from types import SimpleNamespace

    import lbcomm
    from lbcomm.errors import DoubleCompressionError
    from lbcomm.integrations.lightning import LbcommCallback

    model = torch.nn.Linear(4, 4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    local = lbcomm.OneBitLocalUpdates(model.parameters(), sgd, 2)

    def trainer(optimizer, clip=None):
        return SimpleNamespace(optimizers=[optimizer], gradient_clip_val=clip, gradient_clip_algorithm=None)

    assert LbcommCallback(local_updates=local)._lbcomm_optimizer(trainer(sgd, clip=0.5)) is None  # local clipping
    with pytest.raises(ValueError, match="not the OneBitLocalUpdates' inner optimizer"):
        LbcommCallback(local_updates=local)._lbcomm_optimizer(trainer(torch.optim.SGD(model.parameters(), lr=0.1)))
    with pytest.raises(ValueError, match="clips it by its own norm"):
        LbcommCallback(local_updates=local, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="pass one of them"):
        LbcommCallback(hook_state=lbcomm.DCTHookState(2), local_updates=local)
    with pytest.raises(TypeError, match="must return a lbcomm.OneBitLocalUpdates"):
        LbcommCallback(local_updates=lambda module, opt: opt).on_fit_start(trainer(sgd), model)
    onebit = lbcomm.OneBitLamb(model.parameters(), lr=1e-3, freeze_step=2)
    with pytest.raises(DoubleCompressionError, match="DCTHookState's dct_hook"):
        LbcommCallback(hook_state=lbcomm.DCTHookState(2))._lbcomm_optimizer(trainer(onebit))
    assert LbcommCallback(hook_state=lbcomm.DCTHookState(2))._lbcomm_optimizer(trainer(sgd, clip=0.5)) is None
