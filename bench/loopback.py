"""Compressed allreduce vs gloo fp32/fp16 allreduce on local ranks over loopback (no shaping).

A thin wrapper of ``lbcomm-bench allreduce`` (the installed CLI, lbcomm/cli/), kept for its
target (onebit not slower than fp32 at 8M fp32 elements, 4 ranks)::

    python -m bench.loopback                      # = lbcomm-bench allreduce --world-size 4 --sizes 8M
    python -m bench.loopback --sizes 1M,8M --iters 10

Any ``lbcomm-bench allreduce`` option may be given; the defaults here are 4 ranks and 8M.
"""
import sys

from lbcomm.cli.commands import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    defaults = [] if "--world-size" in argv else ["--world-size", "4"]
    defaults += [] if "--sizes" in argv else ["--sizes", "8M"]
    sys.exit(main(["allreduce", *defaults, *argv]))
