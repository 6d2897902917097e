"""Write tests/data/ddp_hook_state_v1/rank{r}.pt and expected{r}.pt (see tests/test_ddp_checkpoint.py).

Run from the repository root with the code whose checkpoint format is to be frozen:
    PYTHONPATH=$PWD:$PWD/tests python tests/data/make_ddp_hook_state.py
then, on a host where test_ddp_checkpoint passes bitwise, write host{r}.pt (the gradients
that tell a host with the same rounding):
    PYTHONPATH=$PWD:$PWD/tests python tests/data/make_ddp_hook_state.py --host
"""
import os
import sys

from dist_util import run_ranks
from test_ddp_checkpoint import DATA, P, generate, host_fingerprint

if __name__ == "__main__":
    os.makedirs(DATA, exist_ok=True)
    run_ranks(host_fingerprint if "--host" in sys.argv[1:] else generate, P, timeout=180)
    print(f"wrote {sorted(os.listdir(DATA))} in {DATA}")
