# torchrun --nproc_per_node 2 train.py OUT [--resume]
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import lbcomm
from lbcomm.integrations.transformers import LbcommCallback

torch.manual_seed(0)
config = GPT2Config(vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
tokens = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": t, "labels": t} for t in tokens]
opt = lbcomm.OneBitAdam(model.parameters(), lr=3e-3, freeze_step=2)
args = TrainingArguments(output_dir=sys.argv[1], max_steps=9, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, save_steps=3, save_total_limit=2,
                         report_to="none", use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False)
# attaches lbcomm to the Trainer's DDP, one shard per rank in checkpoint-N/; clips at max_grad_norm (1.0 by
# default) by one norm for all ranks in place of the Trainer, which would clip each rank by its own norm
trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None), callbacks=[LbcommCallback()])
trainer.train(resume_from_checkpoint=f"{sys.argv[1]}/checkpoint-6" if "--resume" in sys.argv else None)
sent = opt.bytes_per_step()  # None with one process: nothing to compress
print(f"rank {trainer.args.process_index}: compression stage sends {sent['total'] if sent else 0} bytes per step, "
      f"{sum(p.numel() for p in model.parameters()) * 4} bytes of fp32 gradients")
