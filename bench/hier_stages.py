"""Where the hierarchical call's time goes, beside the flat 1-bit call.

Runs the allreduce benchmark on emulated nodes (N namespaces of G ranks, links shaped
to --bandwidth; needs root) with `measure(..., profile=True)`, and prints for each method
the median time per call (timed without the profiler, methods in turn) and rank 0's
profile per call: lbcomm's stage ranges (lbcomm.hier.*, children included) and the
operators with the most self CPU time. Rounds alternate the methods so that load from
other processes hits them alike.

    sudo python -m bench.hier_stages --nodes 2 --ranks-per-node 2 --bandwidth 1gbit --size 8M \\
        --json bench/results/hier_stages_1gbit.json
"""
from __future__ import annotations

import argparse
import json
import sys

from lbcomm.cli import launch
from lbcomm.cli.units import format_count


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hier_stages", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--bandwidth", default="1gbit", help="link rate between nodes, or 'none' for loopback")
    ap.add_argument("--size", default="8M", help="elements (default: 8M)")
    ap.add_argument("--methods", default="onebit,hier")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from lbcomm.cli.args import _sizes

    n = _sizes(args.size)[0]
    G, world = args.ranks_per_node, args.nodes * args.ranks_per_node
    methods = args.methods.split(",")
    params = dict(sizes=[n], methods=methods, iters=args.iters, warmup=2, block_size=2048, pieces=None,
                  threads=args.threads, backend="gloo", progress=False, ranks_per_node=G, profile=True)
    rounds = []
    for r in range(args.rounds):
        spec = {"task": "allreduce", "params": params}
        if args.bandwidth == "none":
            res = launch.spawn(spec, world, "gloo")
        else:
            with launch.cluster_for(world, args.bandwidth, "50ms", "256kb", ranks_per_node=G) as cluster:
                res = launch.spawn(spec, world, "gloo", cluster=cluster)
        rounds.append(res["rows"])
        params["methods"] = methods[::-1] if r % 2 == 0 else methods  # alternate the order
        for row in res["rows"]:
            print(f"round {r + 1}: {row['method']:7s} {row['median_s'] * 1e3:7.1f} ms  inter-node "
                  f"{row['inter_node_bytes']} B/call", file=sys.stderr)
    print(f"# {args.nodes} nodes x {G} ranks, {args.bandwidth}, {format_count(n)} fp32, {args.iters} calls x "
          f"{args.rounds} rounds; rank 0's profile per call of the last round (ms)")
    for m in methods:
        meds = sorted(row["median_s"] for rows in rounds for row in rows if row["method"] == m)
        print(f"\n{m}: median per call {meds[len(meds) // 2] * 1e3:.1f} ms over rounds "
              f"{[round(v * 1e3, 1) for v in meds]}")
        row = next(row for row in rounds[-1] if row["method"] == m)
        for e in row["profile"]:
            print(f"  {e['kind']:5s} {e['ms']:8.2f}  {e['name']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(argv=sys.argv, rounds=rounds), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
