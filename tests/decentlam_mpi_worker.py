"""DecentLaM / DmSGD over the MPI transport (its point-to-point sendrecv), run by
tests/test_decentlam.py under mpirun:

    mpirun --allow-run-as-root --oversubscribe -np 3 python tests/decentlam_mpi_worker.py OUT_DIR

Each rank writes OUT_DIR/<rank>.pt: {config: (x0, grads per step, flat model per step)},
which the test compares with the n-rank simulation bit for bit.
"""
from __future__ import annotations

import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lbcomm  # noqa: E402

CONFIGS = [("decentlam", "ring", False), ("dmsgd", "exponential", False), ("dmsgd", "ring", True)]
STEPS = 4


def main(out_dir):
    from mpi4py import MPI

    import test_decentlam as T

    torch.set_num_threads(1)
    rank = MPI.COMM_WORLD.Get_rank()
    try:
        out = {}
        for cfg in CONFIGS:
            model = T._model()
            x0 = T._flat(model)
            opt = T._make(lbcomm.DecentLaM, model, cfg, backend="mpi")
            assert type(opt.transport).__name__ == "MPITransport"
            grads, xs = [], []
            for k in range(STEPS):
                T._train(model, opt, rank, k, 1, grads)
                xs.append(T._flat(model))
            out[cfg] = {"x0": x0, "grads": grads, "xs": xs}
        torch.save({"ok": out}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
