"""Lightning (strategy "ddp", CPU, gloo) + lbcomm's LbcommCallback on 2 ranks (run by torchrun).

argv: out_dir optimizer(onebit_lamb|sgd_hook|onebit_lamb_clip)
Run 1 trains 3 epochs of 3 optimizer steps (freeze / compression start after step 4,
accumulate_grad_batches=2, clipping (the callback's shared norm for a lbcomm optimizer,
gradient_clip_val under the hook), a LambdaLR schedule), checkpointing every
epoch; it records per step the gradients the optimizer sees and the TCP bytes this rank
sent. Run 2 resumes from the epoch-2 checkpoint (step 6, mid-compression) in a fresh
Trainer. Both runs' final parameters and lbcomm state are saved for the test.
"""
import os
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lbcomm
from lbcomm.integrations.lightning import LbcommCallback
from common import flat_grads, rank_world, save_result, tcp_bytes_sent, tensors_of

out, kind = sys.argv[1], sys.argv[2]
FREEZE, STEPS = 4, 9
CLIP = 0.02  # onebit_lamb_clip: LbcommCallback(max_grad_norm=CLIP), Lightning's clipping off
SOME_CLIP = 0.5  # onebit_lamb: LbcommCallback(max_grad_norm=); sgd_hook: Trainer(gradient_clip_val=)


class Net(pl.LightningModule):
    def __init__(self, hook_state=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 32))
        self.hook_state = hook_state

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if kind in ("onebit_lamb", "onebit_lamb_clip"):
            opt = lbcomm.OneBitLamb(self.parameters(), lr=1e-2, freeze_step=FREEZE, weight_decay=0.01)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(24, 32, generator=g)
        ds = torch.utils.data.TensorDataset(x, torch.tanh(x @ torch.randn(32, 32, generator=g)))
        return torch.utils.data.DataLoader(ds, batch_size=2, shuffle=True)  # Lightning adds a DistributedSampler


class Probe(Callback):
    def __init__(self, hook_state):
        self.hook_state = hook_state
        self.grads, self.bytes, self.per_call, self.frozen, self.hook_sent = {}, {}, {}, {}, {}
        self.logged = {}  # step -> the lbcomm_grad_norm logged on this rank
        self._last = None
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append((trainer.current_epoch, batch_idx, trainer.global_step, float(batch[0].sum())))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step = trainer.global_step + 1
        self.grads[step] = flat_grads(pl_module.parameters())
        now = tcp_bytes_sent()
        if self._last is not None:
            self.bytes[step] = now - self._last
        self._last = now
        comp = getattr(optimizer, "compression_state", None)
        self.per_call[step] = None if comp is None else comp.bytes_per_call()
        self.frozen[step] = getattr(optimizer, "frozen", None)
        if self.hook_state is not None:
            self.hook_sent[step] = self.hook_state.compression_stats()["bytes_sent"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if "lbcomm_grad_norm" in trainer.callback_metrics:  # logged by LbcommCallback, which runs before
            self.logged[trainer.global_step] = float(trainer.callback_metrics["lbcomm_grad_norm"])


def run(ckpt_path=None):
    hook_state = None if kind in ("onebit_lamb", "onebit_lamb_clip") else lbcomm.OneBitHookState(FREEZE, comm=lbcomm.CommConfig(exact_numel=0))
    # A lbcomm optimizer clips by the shared norm in the callback (Lightning's clipping off);
    # the hook averages the gradients, so Lightning clips them itself.
    clip = {"onebit_lamb_clip": CLIP, "onebit_lamb": SOME_CLIP}.get(kind)
    module = Net(hook_state)
    probe = Probe(hook_state)
    ckpt = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), filename="{epoch}-{step}", save_top_k=-1,
                           every_n_train_steps=3)
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_steps=STEPS, accumulate_grad_batches=2,
                         gradient_clip_val=None if clip else SOME_CLIP,
                         callbacks=[LbcommCallback(hook_state=hook_state, max_grad_norm=clip), probe, ckpt],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(module, ckpt_path=ckpt_path)
    opt = trainer.optimizers[0]
    final = {"params": tensors_of(module.state_dict()), "optimizer": tensors_of(opt.state_dict()),
             "hook": None if hook_state is None else tensors_of(hook_state.state_dict())}
    return module, probe, final


rank, world = rank_world()
module, probe, full = run()
ckpts = sorted(os.listdir(os.path.join(out, "ckpt")))
dist.barrier()
_, probe2, resumed = run(os.path.join(out, "ckpt", "epoch=1-step=6.ckpt"))
saved = torch.load(os.path.join(out, "ckpt", "epoch=1-step=6.ckpt"), weights_only=False)["lbcomm"]
save_result(out, {"numel": sum(p.numel() for p in module.parameters()), "full": full, "resumed": resumed,
                  "grads": probe.grads, "bytes": probe.bytes, "per_call": probe.per_call, "frozen": probe.frozen,
                  "hook_sent": probe.hook_sent, "checkpoints": ckpts, "resumed_bytes": probe2.bytes, "resumed_grads": probe2.grads, "batches": probe.batches, "resumed_batches": probe2.batches, "resumed_frozen": probe2.frozen,
                  "saved_world": saved["world_size"], "saved_ranks": len(saved["ranks"]), "logged": probe.logged})
dist.barrier()
