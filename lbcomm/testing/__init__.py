"""Pure-torch simulations of lbcomm's algorithms, used as test oracles (as torch.testing is to
torch): every rank of a run simulated in one process, step by step, written from the
algorithm so that the real implementation can be compared to them bit for bit.

Not part of the library: `import lbcomm` never imports this package, and no module of the
library imports it. Import the module you need:

* kernels.py: the compressed allreduce of p ranks, flat and hierarchical
  (`compressed_allreduce`, `hierarchical_allreduce`), with the per-rank kernels of
  `lbcomm.reference` (the library's fallback when the C++ extension is missing) re-exported;
* optim.py: OneBitAdam, OneBitLamb, Lamb and Lars (`simulate_onebit_adam`, ...);
* zeroone.py: ZeroOneAdam (`simulate_zero_one_adam`);
* local.py: OneBitLocalUpdates (`simulate_local_updates`);
* compressors.py: the error-feedback state and the formulas the simulations share.
"""
