"""Lightning (strategy "ddp", CPU, gloo) + lbcomm's LbcommCallback on 2 ranks (run by torchrun).

argv: out_dir optimizer(onebit_lamb|sgd_hook|onebit_lamb_clip|sgd_dct|sgd_local)
Run 1 trains 3 epochs of 3 optimizer steps (freeze / compression start after step 4,
accumulate_grad_batches=2, clipping (the callback's shared norm for a lbcomm optimizer,
gradient_clip_val under a hook or with local updates), a LambdaLR schedule), checkpointing every
epoch; it records per step the gradients the optimizer sees, the weights after the step
and the TCP bytes this rank sent. Run 2 resumes from the epoch-2 checkpoint (step 6,
mid-compression) in a fresh Trainer. Both runs' final parameters and lbcomm state are
saved for the test. sgd_dct: SGD under a DCTHookState; sgd_local: SGD inside
OneBitLocalUpdates(sync_every=SYNC), built by the callback at fit start (synchronized
after steps 4 and 8; the step-6 checkpoint is mid-round).
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
SYNC = 4  # sgd_local: inner steps per synchronization


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
    def __init__(self, hook_state, lbcomm_callback):
        self.hook_state = hook_state
        self.lbcomm_callback = lbcomm_callback  # its local_updates, built at fit start
        self.grads, self.bytes, self.per_call, self.frozen, self.hook_sent = {}, {}, {}, {}, {}
        self.compressed = {}  # the compressed call alone
        self.params, self.local_sent = {}, {}  # step -> the weights after it, the local updates' bytes
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
        opt = lbcomm.integrations.unwrap_optimizer(optimizer)
        comp = getattr(opt, "compression_state", None)  # what the optimizer says a step sends
        self.per_call[step] = None if comp is None else opt.bytes_per_step()["total"]
        self.compressed[step] = None if comp is None else comp.bytes_per_call()
        self.frozen[step] = getattr(optimizer, "frozen", None)
        if self.hook_state is not None:
            self.hook_sent[step] = self.hook_state.compression_stats()["bytes_sent"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step  # after LbcommCallback's local.step() of this step
        self.params[step] = torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()])
        local = self.lbcomm_callback.local_updates
        if local is not None:
            self.local_sent[step] = local.compression_stats()["bytes_sent"]
        if "lbcomm_grad_norm" in trainer.callback_metrics:  # logged by LbcommCallback, which runs before
            self.logged[trainer.global_step] = float(trainer.callback_metrics["lbcomm_grad_norm"])


def make_local(module, opt):
    """sgd_local: the local updates, built by LbcommCallback at fit start around the
    optimizer configure_optimizers returned."""
    return lbcomm.OneBitLocalUpdates(module.parameters(), opt, SYNC, comm=lbcomm.CommConfig(exact_numel=0))


def run(ckpt_path=None):
    hook_state = None
    if kind == "sgd_hook":
        hook_state = lbcomm.OneBitHookState(FREEZE, comm=lbcomm.CommConfig(exact_numel=0))
    elif kind == "sgd_dct":  # the threshold refreshed every call: about 5 % of the entries pass
        hook_state = lbcomm.DCTHookState(FREEZE, density=0.05, refresh_every=1, comm=lbcomm.CommConfig(exact_numel=0))
    local = make_local if kind == "sgd_local" else None
    # A lbcomm optimizer clips by the shared norm in the callback (Lightning's clipping off);
    # a hook averages the gradients, so Lightning clips them itself; with local updates
    # Lightning clips every rank's own gradient.
    clip = {"onebit_lamb_clip": CLIP, "onebit_lamb": SOME_CLIP}.get(kind)
    module = Net(hook_state)
    callback = LbcommCallback(hook_state=hook_state, local_updates=local, max_grad_norm=clip)
    probe = Probe(hook_state, callback)
    ckpt = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), filename="{epoch}-{step}", save_top_k=-1,
                           every_n_train_steps=3)
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_steps=STEPS, accumulate_grad_batches=2,
                         gradient_clip_val=None if clip else SOME_CLIP,
                         callbacks=[callback, probe, ckpt],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(module, ckpt_path=ckpt_path)
    opt = trainer.optimizers[0]
    rank_local = hook_state if callback.local_updates is None else callback.local_updates
    final = {"params": tensors_of(module.state_dict()), "optimizer": tensors_of(opt.state_dict()),
             "hook": None if rank_local is None else tensors_of(rank_local.state_dict())}
    probe.stats = None if rank_local is None else rank_local.compression_stats()
    return module, probe, final


rank, world = rank_world()
module, probe, full = run()
ckpts = sorted(os.listdir(os.path.join(out, "ckpt")))
dist.barrier()
_, probe2, resumed = run(os.path.join(out, "ckpt", "epoch=1-step=6.ckpt"))
saved = torch.load(os.path.join(out, "ckpt", "epoch=1-step=6.ckpt"), weights_only=False)["lbcomm"]
save_result(out, {"numel": sum(p.numel() for p in module.parameters()), "full": full, "resumed": resumed,
                  "grads": probe.grads, "bytes": probe.bytes, "per_call": probe.per_call, "compressed": probe.compressed, "frozen": probe.frozen,
                  "hook_sent": probe.hook_sent, "checkpoints": ckpts, "resumed_bytes": probe2.bytes, "resumed_grads": probe2.grads, "batches": probe.batches, "resumed_batches": probe2.batches, "resumed_frozen": probe2.frozen,
                  "saved_world": saved["world_size"], "saved_ranks": len(saved["ranks"]), "logged": probe.logged,
                  "params": probe.params, "resumed_params": probe2.params, "local_sent": probe.local_sent,
                  "stats": probe.stats})
dist.barrier()
