"""transformers.Trainer with its default TrainingArguments (max_grad_norm=1.0) and
lbcomm.integrations.transformers.LbcommCallback, built with its Trainer
(``trainer.add_callback(LbcommCallback(trainer))``) or without
(``Trainer(..., callbacks=[LbcommCallback()])``).

With a lbcomm optimizer the callback takes the clipping over: it sets the Trainer's
max_grad_norm to 0 (the Trainer would clip every rank's local gradient by its own norm)
and clips at 1.0 by the norm shared by all ranks, saying so once with a
ClippingTakenOverWarning. Under a hook state the Trainer's clipping stays (the hook
averages the gradients). The multi-rank tests run the real Trainer under torchrun, 2 gloo
ranks on CPU (tests/integrations_workers/trainer_defaults_worker.py)."""
import os

import pytest
import torch

pytest.importorskip("transformers")

from integrations_util import WORKERS, assert_bitwise, results, torchrun  # noqa: E402

FREEZE, STEPS = 3, 8  # trainer_defaults_worker.py's
WARNING = ("ClippingTakenOverWarning: LbcommCallback: clipping at max_grad_norm=1.0 by one norm for all ranks "
           "(logged as lbcomm_grad_norm) instead of the Trainer, whose max_grad_norm is set to 0")


def _onebit(model):
    import lbcomm

    return lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2)


def _trainer(tmp_path, opt_of, callbacks=None, **args):
    from transformers import Trainer, TrainingArguments

    model = torch.nn.Linear(4, 4)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **args)
    opt = opt_of(model)
    return Trainer(model=model, args=args, optimizers=(opt, None), callbacks=callbacks), opt


def _begin(cb, trainer, opt, main=True):
    from transformers import TrainerControl, TrainerState

    state = TrainerState(is_world_process_zero=main)
    cb.on_train_begin(trainer.args, state, TrainerControl(), model=trainer.model, optimizer=opt)


def test_callback_takes_over_the_trainers_clipping(tmp_path, recwarn):
    """One process: default TrainingArguments with a lbcomm optimizer are no longer refused;
    the callback clips at their max_grad_norm (or its own) and sets theirs to 0, warning on
    the main process only; hook states and local updates leave the Trainer's clipping."""
    import warnings

    import lbcomm
    from lbcomm.integrations.transformers import ClippingTakenOverWarning, LbcommCallback

    trainer, opt = _trainer(tmp_path, _onebit)
    assert trainer.args.max_grad_norm == 1.0  # the default
    cb = LbcommCallback(trainer)
    with pytest.warns(ClippingTakenOverWarning) as caught:
        _begin(cb, trainer, opt)
    assert [str(w.message) for w in caught] == [
        "LbcommCallback: clipping at max_grad_norm=1.0 by one norm for all ranks (logged as lbcomm_grad_norm) "
        "instead of the Trainer, whose max_grad_norm is set to 0: TrainingArguments(max_grad_norm=1.0) would clip "
        "every rank's gradient by its own norm, and with lbcomm.OneBitAdam the gradients are local to each rank "
        "(after the freeze; always with Lamb). Pass TrainingArguments(max_grad_norm=0) and "
        "LbcommCallback(max_grad_norm=1.0) to silence this"]
    assert (trainer.args.max_grad_norm, cb.max_grad_norm) == (0, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _begin(cb, trainer, opt)  # a second train(): already taken over, said once
    assert cb.max_grad_norm == 1.0

    trainer, opt = _trainer(tmp_path, _onebit, max_grad_norm=2.0)
    cb = LbcommCallback(trainer, max_grad_norm=0.5)  # the callback's own clip wins
    with pytest.warns(ClippingTakenOverWarning) as caught:
        _begin(cb, trainer, opt)
    assert [str(w.message) for w in caught] == [
        "LbcommCallback: clipping at LbcommCallback(max_grad_norm=0.5) by one norm for all ranks (logged as "
        "lbcomm_grad_norm) and setting the Trainer's max_grad_norm to 0: TrainingArguments(max_grad_norm=2.0) would "
        "clip every rank's gradient by its own norm, and with lbcomm.OneBitAdam the gradients are local to each rank "
        "(after the freeze; always with Lamb). Pass TrainingArguments(max_grad_norm=0) to silence this"]
    assert (trainer.args.max_grad_norm, cb.max_grad_norm) == (0, 0.5)

    recwarn.clear()
    trainer, opt = _trainer(tmp_path, _onebit)
    cb = LbcommCallback(trainer)
    _begin(cb, trainer, opt, main=False)  # another rank: takes over without a word
    assert (trainer.args.max_grad_norm, cb.max_grad_norm) == (0, 1.0)
    trainer, opt = _trainer(tmp_path, _onebit, max_grad_norm=0)
    cb = LbcommCallback(trainer, max_grad_norm=0.5)
    _begin(cb, trainer, opt)  # the explicit form: quiet
    assert (trainer.args.max_grad_norm, cb.max_grad_norm) == (0, 0.5)
    trainer, opt = _trainer(tmp_path, lambda m: torch.optim.AdamW(m.parameters()))
    cb = LbcommCallback(trainer, hook_state=lbcomm.OneBitHookState())
    _begin(cb, trainer, opt)  # the hook averages the gradients: the Trainer clips them
    assert (trainer.args.max_grad_norm, cb.max_grad_norm) == (1.0, None)
    local = lbcomm.OneBitLocalUpdates(trainer.model.parameters(), opt, 2)
    _begin(LbcommCallback(trainer, local_updates=local), trainer, opt)  # each rank clips its own, as DiLoCo
    assert trainer.args.max_grad_norm == 1.0
    assert not [w for w in recwarn if issubclass(w.category, ClippingTakenOverWarning)]


def test_callbacks_form_in_one_process(tmp_path):
    """Trainer(..., callbacks=[LbcommCallback()]) trains with default arguments: the
    callback serves the Trainer that raises on_train_begin and clips at 1.0; a hook state
    given positionally, without the Trainer, is named."""
    import lbcomm
    from lbcomm.integrations.transformers import ClippingTakenOverWarning, LbcommCallback

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"x": torch.full((4,), float(i))}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return {"loss": (self.lin(x) ** 2).mean() * 100}  # gradients far above the default clip

    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Logs(TrainerCallback):
        logged = []

        def on_log(self, args, state, control, logs=None, **kw):
            if "grad_norm" in logs:  # not the summary at the end
                self.logged.append(dict(logs))

    model = Model()
    opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2)
    cb = LbcommCallback()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, logging_steps=1,
                             save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
                             remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None), callbacks=[cb, Logs()])
    with pytest.warns(ClippingTakenOverWarning, match="clipping at max_grad_norm=1.0 by one norm for all ranks"):
        trainer.train()
    assert cb.trainer is trainer and trainer.args.max_grad_norm == 0 and cb.max_grad_norm == 1.0
    assert len(Logs.logged) == 3
    for log in Logs.logged:  # one process: the shared norm is this one, and it was clipped
        assert log["lbcomm_grad_norm"] > 1.0 and log["lbcomm_grad_norm"] == pytest.approx(log["grad_norm"], rel=1e-5)
    with pytest.raises(TypeError, match=r"or Trainer\(\.\.\., callbacks=\[LbcommCallback\(hook_state=\.\.\.\)\]\)"):
        LbcommCallback(lbcomm.OneBitHookState())


def _run(tmp_path, kind):
    out = torchrun(os.path.join(WORKERS, "trainer_defaults_worker.py"), tmp_path, kind)
    return out, results(tmp_path)


def _check_shared_clip(r, clip=1.0):
    """The gradients after the callback's clip are those before it times min(1, clip / (N +
    1e-6)), N = sqrt(mean_r ||g_r||^2) computed here from both ranks' gradients, which is
    also the lbcomm_grad_norm both ranks logged; the Trainer clipped nothing itself (its
    logged grad_norm is the rank's own norm of the gradients the callback got)."""
    clipped = []
    for step in range(1, STEPS + 1):
        g = [r[rank]["before"][step].double() for rank in range(2)]
        shared = float(((g[0].norm() ** 2 + g[1].norm() ** 2) / 2).sqrt())
        coef = min(1.0, clip / (shared + 1e-6))
        clipped.append(coef < 1)
        for rank in range(2):
            logged = r[rank]["logged"][step]
            assert logged["lbcomm_grad_norm"] == pytest.approx(shared, rel=1e-5), (rank, step)
            assert logged["grad_norm"] == pytest.approx(float(g[rank].norm()), rel=1e-5), (rank, step)
            torch.testing.assert_close(r[rank]["after"][step].double(), g[rank] * coef, rtol=1e-5, atol=1e-9)
        if step <= FREEZE:  # warmup: DDP averaged the gradients
            assert torch.equal(g[0], g[1]), step
        else:  # compression stage: local gradients, one clip coefficient for both
            assert not torch.equal(g[0], g[1]), step
    assert all(clipped), clipped  # the default clip bites on this model: the takeover is seen
    assert any(r[0]["logged"][s]["grad_norm"] > 1.0 for s in range(1, STEPS + 1))  # the Trainer did not clip


@pytest.mark.parametrize("kind", ["onebit_adam", "onebit_adam_callbacks"])
def test_default_arguments_with_a_onebit_optimizer_clip_by_the_shared_norm(kind, tmp_path):
    """OneBitAdam via optimizers=(opt, None), TrainingArguments' default max_grad_norm=1.0,
    the callback built with the Trainer or given in callbacks=[...]: trains, the callback
    clips at 1.0 by the shared norm, the replicas end identical, every rank's shard is in
    the checkpoint; the callbacks form resumes from it bitwise."""
    out, r = _run(tmp_path, kind)
    assert out.count(WARNING) == 1 + (kind == "onebit_adam_callbacks")  # the main process, once per training
    for rank in range(2):
        res = r[rank]
        assert res["max_grad_norm"] == (1.0, 0.0) and res["clip"] == 1.0  # (before, after training)
        assert res["trainer_found"] and res["frozen"]
        assert {"shard-00000-of-00002.pt", "shard-00001-of-00002.pt"} <= set(res["shards"])
    _check_shared_clip(r)
    assert_bitwise(r[0]["final"]["params"], r[1]["final"]["params"], "rank 0 vs rank 1 weights ")
    if kind == "onebit_adam_callbacks":  # a fresh Trainer and callback resumed from checkpoint-4
        for rank in range(2):
            resumed = r[rank]["resumed"]
            assert resumed["max_grad_norm"] == (1.0, 0.0) and resumed["trainer_found"]
            assert sorted(resumed["logged"]) == list(range(5, STEPS + 1))
            assert_bitwise(r[rank]["final"]["params"], resumed["final"]["params"], f"rank {rank} resumed weights ")
            assert_bitwise(r[rank]["final"]["optimizer"], resumed["final"]["optimizer"],
                           f"rank {rank} resumed optimizer ")


def test_default_arguments_with_the_hook_keep_the_trainers_clipping(tmp_path):
    """AdamW with callbacks=[LbcommCallback(hook_state=OneBitHookState(FREEZE))] and the
    default max_grad_norm=1.0: the hook averages the gradients, so the Trainer's own clip is
    the same on both ranks and stays (no warning); the replicas end identical."""
    out, r = _run(tmp_path, "adamw_hook")
    assert "ClippingTakenOverWarning" not in out
    for rank in range(2):
        res = r[rank]
        assert res["max_grad_norm"] == (1.0, 1.0) and res["clip"] is None and res["trainer_found"]
        assert {"shard-00000-of-00002.pt", "shard-00001-of-00002.pt"} <= set(res["shards"])
    for step in range(1, STEPS + 1):
        assert torch.equal(r[0]["after"][step], r[1]["after"][step]), step
        assert torch.equal(r[0]["before"][step], r[0]["after"][step]), step  # the callback clipped nothing
        norm = r[0]["logged"][step]["grad_norm"]  # the Trainer's, before its clip
        assert norm == r[1]["logged"][step]["grad_norm"] and norm > 1.0, step
        assert float(r[0]["after"][step].double().norm()) == pytest.approx(1.0, rel=1e-4), step
    assert_bitwise(r[0]["final"]["params"], r[1]["final"]["params"], "rank 0 vs rank 1 weights ")
