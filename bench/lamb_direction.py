"""OneBitLamb's direction over one staging range (F.STAGE fp32 elements, one thread): the
torch sequence (`kernels.direction_torch`) against the fused op (`kernels.lamb_direction_`),
both after torch's two roots, and the roots alone, as ratios in the same process. Medians
of at least 15, three rounds.

    python -m bench.lamb_direction
"""
import torch

from bench.kernels import median_time
from lbcomm.optim import functional as F
from lbcomm.optim import kernels as K


def main() -> None:
    torch.set_num_threads(1)
    n, g = F.STAGE, torch.Generator().manual_seed(0)
    m, v, vf = torch.randn(n, generator=g) * 1e-2, torch.rand(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-3
    u, stage = torch.empty(n), torch.empty(n)

    def roots():
        torch.sqrt(vf, out=u)
        return torch.sqrt(v, out=stage)

    for _ in range(3):
        seq = 1e3 * median_time(lambda: K.direction_torch(u, m, roots(), 0.3, 1e-8, 0.27, 1.0, True), 15)
        op = 1e3 * median_time(lambda: K.lamb_direction_(u, m, roots(), 0.3, 1e-8, 0.27, 1.0, True), 15)
        r = 1e3 * median_time(roots, 15)
        print(f"{n} elements: torch sequence {seq:.2f} ms, op {op:.2f} ms ({op / seq:.2f}x); the roots alone "
              f"{r:.2f} ms, so after them {seq - r:.2f} against {op - r:.2f} ms ({(op - r) / (seq - r):.2f}x)")


if __name__ == "__main__":
    main()
