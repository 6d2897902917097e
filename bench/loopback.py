"""Compressed allreduce vs gloo fp32/fp16 allreduce on local ranks over loopback (no shaping).

    python bench/loopback.py --world-size 4 --sizes 8M
Prints the slowest rank's median time per method and the speedup over fp32 from one run.
Target (issue 2): onebit not slower than fp32 at 8M fp32 elements, 4 ranks.
"""
import argparse
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lbcomm.bench.allreduce import METHODS, format_table, measure


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper()
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def rank_main(rank, args, init_file):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=300))
    block = None if args.block_size.lower() == "none" else int(args.block_size)
    rows = measure([parse_size(s) for s in args.sizes.split(",")], args.methods.split(","), args.iters,
                   args.warmup, block)
    if rank == 0:
        print(f"loopback gloo, {args.world_size} ranks, {args.threads} thread(s)/rank, block_size={block}")
        print(format_table(rows))
        sys.stdout.flush()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--sizes", default="8M")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--block-size", default="2048")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(args, os.path.join(d, "init")), nprocs=args.world_size)


if __name__ == "__main__":
    main()
