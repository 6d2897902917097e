# torchrun --nproc_per_node 2 train.py OUT [--resume]
import sys

import torch
from accelerate import Accelerator

import lbcomm
from lbcomm.integrations import attach

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 32))
opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=4)
x = torch.randn(96, 32, generator=torch.Generator().manual_seed(1))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.tanh(x)), batch_size=8)
model, opt, loader = accelerator.prepare(model, opt, loader)
attach(model, opt)  # DDP averages during the warmup and sends nothing after the freeze
# save_state() then also writes every rank's lbcomm shard (its error feedback) into its directory
accelerator.register_save_state_pre_hook(lambda models, weights, out_dir: lbcomm.save_sharded(out_dir, opt))

out, start_epoch = sys.argv[1], 0
if "--resume" in sys.argv:
    accelerator.load_state(f"{out}/epoch-2")
    lbcomm.load_sharded(f"{out}/epoch-2", opt)  # after load_state: this rank's own optimizer state
    start_epoch = 2
for epoch in range(start_epoch, 3):  # 6 batches per rank and epoch
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    if epoch + 1 == 2 and start_epoch == 0:
        accelerator.save_state(f"{out}/epoch-2")
inner = accelerator.unwrap_model(model)
sent = opt.optimizer.bytes_per_step()  # None with one process: nothing to compress
print(f"rank {accelerator.process_index}: loss {loss.item():.6f}, compression stage sends "
      f"{sent['total'] if sent else 0} bytes per step")
lbcomm.save_sharded(f"{out}/final-{start_epoch}", opt, inner)
