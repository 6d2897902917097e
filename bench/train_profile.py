"""Where a training step's time goes on emulated nodes, per method.

Runs `lbcomm-bench train`'s rank side on N nodes x G ranks (links shaped to --bandwidth;
needs root) with profiling: after the timed rounds each method runs --steps more steps
under torch.profiler, and rank 0's busiest operators per step (self CPU time, and the
wall time of a step) are printed beside the timed medians.

    sudo python -m bench.train_profile --methods hsdp,hsdp_onebit,onebit_hook --bandwidth 1gbit
"""
from __future__ import annotations

import argparse
import json
import sys

from lbcomm.cli import launch
from lbcomm.cli.train import MODEL_PRESETS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.train_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--bandwidth", default="1gbit", help="link rate between nodes, or 'none' for loopback")
    ap.add_argument("--methods", default="none,hsdp,hsdp_onebit,onebit_hook")
    ap.add_argument("--preset", default="small", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    G, world = args.ranks_per_node, args.nodes * args.ranks_per_node
    netem = args.bandwidth != "none"
    params = dict(model=dict(MODEL_PRESETS[args.preset]), methods=args.methods.split(","), steps=args.steps,
                  rounds=args.rounds, warmup_steps=6, lr=1e-4, threads=1, backend="gloo", progress=False,
                  netem=netem, allreduce_iters=1, ranks_per_node=G, profile=True)
    spec = {"task": "train", "params": params}
    if netem:
        with launch.cluster_for(world, args.bandwidth, "50ms", "256kb", ranks_per_node=G) as cluster:
            res = launch.spawn(spec, world, "gloo", cluster=cluster)
    else:
        res = launch.spawn(spec, world, "gloo")
    print(f"# {args.nodes} nodes x {G} ranks, {args.bandwidth}, preset {args.preset} ({res['params'] / 1e6:.2f}M "
          f"parameters); rank 0's profile per step (ms), {args.steps} profiled steps after the timed ones")
    for row in res["rows"]:
        print(f"\n{row['method']}: timed median {row['median_s'] * 1e3:.1f} ms/step, inter-node "
              f"{(row['inter_node_bytes_per_step'] or 0) / 1e6:.2f} MB/step")
        for e in res["profiles"][row["method"]]:
            print(f"  {e['kind']:5s} {e['ms']:8.2f}  {e['name']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(argv=sys.argv, result=res), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
