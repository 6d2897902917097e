# torchrun --nproc_per_node 2 train.py OUT [--resume]
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel as DDP

import lbcomm
from lbcomm.integrations import LoadPlanner, RankLocal, attach

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 32)))
opt = lbcomm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=4)
attach(model, opt)  # DDP averages during the warmup and sends nothing after the freeze

out, start = sys.argv[1], 0
if "--resume" in sys.argv:
    state = {"model": model.module.state_dict(), "optim": RankLocal(opt), "step": 0}
    # each rank reads back its own optimizer item; the planner checks that nothing rank-local is left out
    dcp.load(state, checkpoint_id=f"{out}/step-6", planner=LoadPlanner())
    model.module.load_state_dict(state["model"])
    start = state["step"]
for step in range(start, 9):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 32, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x))
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step + 1 == 6 and start == 0:
        dcp.save({"model": model.module.state_dict(), "optim": RankLocal(opt), "step": 6},
                 checkpoint_id=f"{out}/step-6")
sent = opt.bytes_per_step()  # None with one process: nothing to compress
print(f"rank {rank}: loss {loss.item():.6f}, compression stage sends {sent['total'] if sent else 0} bytes per step")
lbcomm.save_sharded(f"{out}/final-{start}", opt, model.module)
del model  # DDP's reducer goes before its process group (torch 2.13 + gloo may abort at exit otherwise)
dist.destroy_process_group()
