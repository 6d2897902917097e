"""transformers.Trainer + lbcomm's LbcommCallback on 2 gloo ranks (run by torchrun).

argv: out_dir optimizer(onebit_adam|onebit_lamb|adamw_hook|onebit_adam_clip|adamw_dct|adamw_local)
Run 1 trains 9 steps (freeze / compression start after step 4, checkpoints every 3 steps,
save_total_limit=2, gradient accumulation 2, clipping (the callback's shared norm for a
lbcomm optimizer, the Trainer's max_grad_norm under a hook or with local updates), linear
schedule with warmup), recording per step the gradients the optimizer sees, the weights
after the step and the TCP bytes this rank sent. adamw_dct: AdamW under a DCTHookState;
adamw_local: AdamW inside OneBitLocalUpdates(sync_every=SYNC), synchronized after steps 4
and 8 (checkpoint-6 is mid-round).
Run 2 resumes from checkpoint-6 (mid-compression) in a fresh Trainer and trains to 9.
Both runs' final parameters and lbcomm state are saved for the test to compare.
"""
import os
import sys

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import lbcomm
from lbcomm.integrations.transformers import LbcommCallback
from common import flat_grads, rank_world, save_result, tcp_bytes_sent, tensors_of

out, kind = sys.argv[1], sys.argv[2]
FREEZE, STEPS, SAVE = 4, 9, 3
SYNC = 4  # adamw_local: inner steps per synchronization
CLIP = 0.05  # onebit_adam_clip: LbcommCallback(max_grad_norm=CLIP), the Trainer's clipping off
ARGS_CLIP = 1.2  # onebit_adam / onebit_lamb: LbcommCallback(max_grad_norm=); adamw_hook: TrainingArguments(max_grad_norm=)


class Data(torch.utils.data.Dataset):
    def __init__(self, n=64, seq=16, vocab=128):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Probe(TrainerCallback):
    """What the optimizer sees (gradients after clipping) and the bytes sent per step."""

    def __init__(self, hook_state=None):
        self.hook_state = hook_state  # or the OneBitLocalUpdates: the bytes it sent
        self.grads, self.bytes, self.per_call, self.frozen, self.hook_sent = {}, {}, {}, {}, {}
        self.compressed = {}  # the compressed call alone
        self.params = {}  # step -> the weights after it
        self.logged = {}  # step -> the gradient norms the Trainer logged on this rank
        self._last = None

    def on_step_begin(self, args, state, control, **kw):
        if self._last is None:
            self._last = tcp_bytes_sent()

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        self.grads[state.global_step + 1] = flat_grads(model.parameters())

    def on_log(self, args, state, control, logs=None, **kw):
        if "grad_norm" in logs:  # not the summary at the end of training
            self.logged[state.global_step] = {k: logs[k] for k in ("grad_norm", "lbcomm_grad_norm") if k in logs}

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
        self.params[state.global_step] = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        now = tcp_bytes_sent()
        self.bytes[state.global_step] = now - self._last
        self._last = now
        opt = lbcomm.integrations.unwrap_optimizer(optimizer)
        comp = getattr(opt, "compression_state", None)  # what the optimizer says a step sends
        self.per_call[state.global_step] = None if comp is None else opt.bytes_per_step()["total"]
        self.compressed[state.global_step] = None if comp is None else comp.bytes_per_call()
        self.frozen[state.global_step] = getattr(opt, "frozen", None)
        if self.hook_state is not None:
            self.hook_sent[state.global_step] = self.hook_state.compression_stats()["bytes_sent"]


def build(output_dir, resume=None):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    hook_state = local = None
    if kind in ("onebit_adam", "onebit_adam_clip"):
        opt = lbcomm.OneBitAdam(model.parameters(), lr=3e-3, freeze_step=FREEZE, weight_decay=0.01,
                                comm=lbcomm.CommConfig(exact_numel=0))
    elif kind == "onebit_lamb":
        opt = lbcomm.OneBitLamb(model.parameters(), lr=3e-3, freeze_step=FREEZE, comm=lbcomm.CommConfig(exact_numel=0))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if kind == "adamw_hook":
            hook_state = lbcomm.OneBitHookState(FREEZE, comm=lbcomm.CommConfig(exact_numel=0))
        elif kind == "adamw_dct":  # the threshold refreshed every call: about 5 % of the entries pass
            hook_state = lbcomm.DCTHookState(FREEZE, density=0.05, refresh_every=1,
                                             comm=lbcomm.CommConfig(exact_numel=0))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * (1 - s / (2 * STEPS)))
    # A lbcomm optimizer clips by the shared norm in the callback (the Trainer's own clipping
    # off); the hook averages the gradients, so the Trainer clips them itself.
    clip = {"onebit_adam_clip": CLIP, "onebit_adam": ARGS_CLIP, "onebit_lamb": ARGS_CLIP}.get(kind)
    args = TrainingArguments(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_grad_norm=0 if clip else ARGS_CLIP,
                             save_steps=SAVE, save_total_limit=2,
                             logging_steps=1, report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
                             ddp_backend="gloo", dataloader_num_workers=0, ddp_find_unused_parameters=False)
    if kind == "adamw_local":  # after TrainingArguments, which initializes torch.distributed
        local = lbcomm.OneBitLocalUpdates(model.parameters(), opt, SYNC, comm=lbcomm.CommConfig(exact_numel=0))
    probe = Probe(hook_state if local is None else local)
    trainer = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, sched))
    trainer.add_callback(LbcommCallback(trainer, hook_state=hook_state, local_updates=local, max_grad_norm=clip))
    trainer.add_callback(probe)  # after LbcommCallback: sees the clipped gradients and the logged lbcomm_grad_norm
    trainer.train(resume_from_checkpoint=resume)
    rank_local = hook_state if local is None else local
    final = {"params": tensors_of(model.state_dict()), "optimizer": tensors_of(opt.state_dict()),
             "hook": None if rank_local is None else tensors_of(rank_local.state_dict())}
    return trainer, probe, final, rank_local


rank, world = rank_world()
run1 = os.path.join(out, "run")
trainer, probe, full, hook_state = build(run1)
ckpts = sorted(os.listdir(run1))
hook_stats = None if hook_state is None else hook_state.compression_stats()
dist.barrier()
# Resume from the mid-compression checkpoint (rotation kept checkpoint-6 and -9).
_, probe2, resumed, _ = build(run1, resume=os.path.join(run1, f"checkpoint-{2 * SAVE}"))
save_result(out, {"numel": sum(p.numel() for p in trainer.model.parameters()), "full": full, "resumed": resumed, "grads": probe.grads, "bytes": probe.bytes,
                  "per_call": probe.per_call, "compressed": probe.compressed, "frozen": probe.frozen, "checkpoints": ckpts,
                  "shards": sorted(os.listdir(os.path.join(run1, f"checkpoint-{2 * SAVE}"))),
                  "hook_stats": hook_stats, "hook_sent": probe.hook_sent, "resumed_bytes": probe2.bytes,
                  "logged": probe.logged, "params": probe.params, "resumed_params": probe2.params})
dist.barrier()
