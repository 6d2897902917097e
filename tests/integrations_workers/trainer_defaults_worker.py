"""transformers.Trainer with default TrainingArguments (max_grad_norm=1.0) and lbcomm's
LbcommCallback on 2 gloo ranks (run by torchrun).

argv: out_dir kind
  onebit_adam            OneBitAdam via optimizers=(opt, None), trainer.add_callback(LbcommCallback(trainer))
  onebit_adam_callbacks  the same with Trainer(..., callbacks=[LbcommCallback()]); then resumes from
                         checkpoint-4 in a fresh Trainer (same form) and trains to the end again
  adamw_hook             AdamW with Trainer(..., callbacks=[LbcommCallback(hook_state=OneBitHookState(FREEZE))])
Trains STEPS steps (freeze / compression start after step FREEZE, a checkpoint every 4
steps). Records per step the gradients before and after the clipping (callbacks around
LbcommCallback), the norms the Trainer and the callback logged, and the final weights and
optimizer state.
"""
import os
import sys

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import lbcomm
from lbcomm.integrations.transformers import LbcommCallback
from common import flat_grads, rank_world, save_result, tensors_of

out, kind = sys.argv[1], sys.argv[2]
FREEZE, STEPS, SAVE = 3, 8, 4


class Data(torch.utils.data.Dataset):
    def __init__(self, n=64, seq=16, vocab=128):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Grads(TrainerCallback):
    """The gradients the optimizer is about to see, by step (before LbcommCallback's clip
    when placed before it, after it when placed after)."""

    def __init__(self):
        self.grads = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.grads[state.global_step + 1] = flat_grads(model.parameters())


class Logged(Grads):
    def __init__(self):
        super().__init__()
        self.logged = {}  # step -> the norms logged on this rank

    def on_log(self, args, state, control, logs=None, **kw):
        if "grad_norm" in logs:  # not the summary at the end of training
            self.logged[state.global_step] = {k: logs[k] for k in ("grad_norm", "lbcomm_grad_norm") if k in logs}


def build(output_dir, resume=None):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    hook_state = None
    if kind.startswith("onebit_adam"):
        opt = lbcomm.OneBitAdam(model.parameters(), lr=3e-3, freeze_step=FREEZE, comm=lbcomm.CommConfig(exact_numel=0))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        hook_state = lbcomm.OneBitHookState(FREEZE, comm=lbcomm.CommConfig(exact_numel=0))
    # TrainingArguments' defaults, max_grad_norm=1.0 among them; CPU, gloo and a short run
    args = TrainingArguments(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2, save_steps=SAVE,
                             logging_steps=1, report_to="none", disable_tqdm=True, use_cpu=True, ddp_backend="gloo",
                             ddp_find_unused_parameters=False)
    before, after = Grads(), Logged()
    if kind == "onebit_adam":
        trainer = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None), callbacks=[before])
        trainer.add_callback(LbcommCallback(trainer))
        trainer.add_callback(after)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None),
                          callbacks=[before, LbcommCallback(hook_state=hook_state), after])
    max_grad_norm = args.max_grad_norm
    trainer.train(resume_from_checkpoint=resume)
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, LbcommCallback))
    final = {"params": tensors_of(model.state_dict()), "optimizer": tensors_of(opt.state_dict())}
    return {"before": before.grads, "after": after.grads, "logged": after.logged, "final": final,
            "max_grad_norm": (max_grad_norm, trainer.args.max_grad_norm), "clip": cb.max_grad_norm,
            "trainer_found": cb.trainer is trainer, "frozen": getattr(opt, "frozen", None),
            "shards": sorted(os.listdir(os.path.join(output_dir, f"checkpoint-{SAVE}")))}


rank, world = rank_world()
run = os.path.join(out, "run")
result = build(run)
dist.barrier()
if kind == "onebit_adam_callbacks":
    result["resumed"] = build(run, resume=os.path.join(run, f"checkpoint-{SAVE}"))
save_result(out, result)
dist.barrier()
