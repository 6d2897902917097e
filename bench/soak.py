"""Soak: 10,000 compressed allreduce steps on 4 gloo ranks.

    python -m bench.soak [--steps 10000] [--world-size 4] [--numel 100000]
Checks that outputs stay bitwise identical across ranks at every step and that the error
norms stay bounded, and prints the figures.
"""
import argparse
import time

from lbcomm.cli.soak import check, soak_rank
from tests.dist_util import run_ranks


def _rank(rank, p, steps, numel):
    return soak_rank(rank, steps, numel)


def main():
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--numel", type=int, default=100_003)
    args = ap.parse_args()
    t0 = time.time()
    results = run_ranks(_rank, args.world_size, args.steps, args.numel, timeout=24 * 3600)
    summary = check(results, window=max(1, args.steps // 10))
    print(f"soak: {args.world_size} ranks, {summary['steps']} steps of {args.numel} elements in "
          f"{time.time() - t0:.0f} s: outputs bitwise identical on all ranks at every step; max error norm "
          f"first 10% {summary['max_error_norm_early']:.4g}, last 10% {summary['max_error_norm_late']:.4g}")


if __name__ == "__main__":
    main()
