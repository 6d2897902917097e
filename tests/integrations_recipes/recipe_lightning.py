# torchrun --nproc_per_node 2 train.py OUT [--resume]
import sys

import lightning.pytorch as pl
import torch

import lbcomm
from lbcomm.integrations.lightning import LbcommCallback


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 32))

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return lbcomm.OneBitLamb(self.parameters(), lr=1e-2, freeze_step=2)

    def train_dataloader(self):
        x = torch.randn(24, 32, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.tanh(x)), batch_size=2)


torch.manual_seed(0)
module = Net()
ckpt = pl.callbacks.ModelCheckpoint(dirpath=sys.argv[1], filename="{step}", every_n_train_steps=3, save_top_k=-1)
trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_steps=9, accumulate_grad_batches=2,
                     callbacks=[LbcommCallback(), ckpt],  # attaches lbcomm; every rank's state in the .ckpt
                     logger=False, enable_progress_bar=False)
trainer.fit(module, ckpt_path=f"{sys.argv[1]}/step=6.ckpt" if "--resume" in sys.argv else None)
sent = trainer.optimizers[0].bytes_per_step()  # None with one process: nothing to compress
print(f"rank {trainer.global_rank}: compression stage sends {sent['total'] if sent else 0} bytes per step, "
      f"{sum(p.numel() for p in module.parameters()) * 4} bytes of fp32 gradients")
