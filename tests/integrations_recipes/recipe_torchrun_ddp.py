# torchrun --nproc_per_node 2 train.py OUT [--resume]
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import lbcomm
from lbcomm.integrations import attach

dist.init_process_group("gloo")  # "nccl" for CUDA
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 32)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # any optimizer ...
state = lbcomm.OneBitHookState(start_iter=4)          # ... 1-bit gradients from iteration 4 on
attach(model, state, optimizer=opt)                   # = model.register_comm_hook(state, lbcomm.onebit_hook)

out, start = sys.argv[1], 0
if "--resume" in sys.argv:  # every rank reads its shard(s), before the first backward; any number of ranks
    info = lbcomm.load_sharded(f"{out}/step-6", opt, model.module, hook_state=state)
    start = info["extra"]["step"]
for step in range(start, 9):
    g = torch.Generator().manual_seed(1000 * rank + step)  # this rank's batch of this step
    x = torch.randn(8, 32, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x))
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step + 1 == 6 and start == 0:  # every rank saves its shard (its error feedback differs)
        lbcomm.save_sharded(f"{out}/step-6", opt, model.module, hook_state=state, extra={"step": 6})
stats = state.compression_stats()
print(f"rank {rank}: loss {loss.item():.6f}, sent {stats['bytes_sent']} bytes, ratio {stats['compression_ratio']:.1f}x")
lbcomm.save_sharded(f"{out}/final-{start}", opt, model.module, hook_state=state)
del model  # DDP's reducer goes before its process group (torch 2.13 + gloo may abort at exit otherwise)
dist.destroy_process_group()
