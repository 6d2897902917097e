"""OneBitLamb's per-range ops of the compression stage over one staging range (F.STAGE fp32
elements, one thread), as ratios in the same process: its direction, the fused op with its
IEEE roots (`kernels.lamb_direction_`), against the torch sequence with torch's fp32 roots
that it replaces (two roots, the two denominators, the ratio and its max, the quotient, the
clamp) and against `kernels.direction_torch` (its fallback, whose fp64 roots give the op's
bits); its fresh variance from the reduced momentum (`kernels.implied_variance_`)
against the six torch ops it replaces (`functional.implied_grad_variance_`); and the
clean-norm estimate's pass (`kernels.lamb_clean_pass_`, bf16 exp_avg_local advanced by a
gradient, the bound 1.0) against its torch fallback (`kernels.clean_pass_torch`). Medians
of at least 15, three rounds.

    python -m bench.lamb_direction
"""
import torch

from bench.kernels import median_time
from lbcomm.optim import functional as F
from lbcomm.optim import kernels as K


def torch_sequence(u, m, v, vf, stage, scale, eps, bc1, bound):
    """The direction in torch ops with torch's fp32 roots (OneBitLamb's code before the op)."""
    d = torch.sqrt(v, out=stage).div_(scale).add_(eps)
    r = torch.sqrt(vf, out=u).div_(scale).add_(eps)
    part = torch.amax(torch.div(d, r, out=r)).reshape(1)
    torch.div(m, bc1, out=u).div_(d).clamp_(-bound, bound)
    return part


def main() -> None:
    torch.set_num_threads(1)
    n, g = F.STAGE, torch.Generator().manual_seed(0)
    m, v, vf = torch.randn(n, generator=g) * 1e-2, torch.rand(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-3
    u, stage = torch.empty(n), torch.empty(n)
    args = (u, m, v, vf, stage, 0.3, 1e-8, 0.27, 1.0)
    for _ in range(3):
        seq = 1e3 * median_time(lambda: torch_sequence(*args), 15)
        op = 1e3 * median_time(lambda: K.lamb_direction_(*args), 15)
        fallback = 1e3 * median_time(lambda: K.direction_torch(*args), 15)
        print(f"{n} elements: direction: torch sequence {seq:.2f} ms, op {op:.2f} ms ({op / seq:.2f}x); "
              f"direction_torch (fp64 roots) {fallback:.2f} ms ({op / fallback:.2f}x)")
        mn, mo = torch.randn(n, generator=g) * 1e-2, m.clone()
        seq = 1e3 * median_time(lambda: F.implied_grad_variance_(vf, mn, mo, 0.9, 0.999), 15)
        op = 1e3 * median_time(lambda: K.implied_variance_(vf, mn, mo, 0.9, 0.999), 15)
        print(f"{n} elements: fresh variance: torch ops {seq:.2f} ms, op {op:.2f} ms ({op / seq:.2f}x)")
        ml, grad = m.bfloat16(), torch.randn(n, generator=g) * 1e-2
        acc, counts = torch.zeros(2, dtype=torch.float64), torch.empty(-(-n // K.EDGE_BLOCK), dtype=torch.int64)
        clean = (acc, counts, m, v, ml, grad, 0.1, None, 0.27, 0.3, 1e-8, 1.0, 1 - 1e-5)
        seq = 1e3 * median_time(lambda: K.clean_pass_torch(*clean), 15)
        op = 1e3 * median_time(lambda: K.lamb_clean_pass_(*clean), 15)
        print(f"{n} elements: clean-norm pass: torch fallback {seq:.2f} ms, op {op:.2f} ms ({op / seq:.2f}x)")


if __name__ == "__main__":
    main()
