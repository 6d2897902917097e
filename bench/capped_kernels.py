"""What the capped decode costs inside the CPU kernels, one thread: the worker compress and
the unpack of N fp32 elements (blocks of 2048, 4 chunks) without caps, with the caps as a
tensor, and with the caps computed from a variance inside the kernels (`TableCaps`, what
the 1-bit optimizers pass on the CPU), each as a ratio to the uncapped call, beside a copy
of N elements and the caps' own pass (`lbcomm::decode_caps_table_`). Medians of at least 5.

    python -m bench.capped_kernels [N]
"""
import sys
import torch

from bench.kernels import median_time
from lbcomm import ops
from lbcomm.optim import kernels as K
from lbcomm.reduce.inputs import TableCaps


def main(n: int, params: int = 286, p: int = 4, block: int = 2048) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    numels = [n // params] * (params - 1) + [n - n // params * (params - 1)]
    starts = torch.tensor([0] + torch.tensor(numels).cumsum(0).tolist())
    v = torch.rand(n, generator=g) * 1e-4
    table = torch.tensor([(300.0, 3e-6, 1.0)] * params)
    caps = torch.empty(n)
    K.decode_caps_table_(caps, v, 0, starts, table)
    fill = lambda lo, hi, buf: K.decode_caps_table_(buf[:hi - lo], v, lo, starts, table)  # noqa: E731
    table_caps = TableCaps(v, starts, table, fill, n)
    m = -(-n // p // block) * block
    x, err, out = torch.randn(n, generator=g) * 1e-3, torch.zeros(p, m), torch.empty(n)
    packed, scales = ops.worker_compress(x, err, block)
    base = None
    print(f"{n} fp32 elements, {params} parameters, {p} chunks, blocks of {block}, one thread")
    for name, cap in [("no caps", None), ("caps tensor", caps), ("TableCaps", table_caps)]:
        w = 1e3 * median_time(lambda: ops.worker_compress(x, err, block, cap=cap), 5)
        u = 1e3 * median_time(lambda: ops.unpack_into(packed, scales, block, out, cap=cap), 5)
        base = base or (w, u)
        print(f"{name:12s} worker_compress {w:6.1f} ms ({w / base[0]:.2f}x)   unpack_into {u:6.1f} ms "
              f"({u / base[1]:.2f}x)")
    print(f"decode_caps_table_ {1e3 * median_time(lambda: K.decode_caps_table_(caps, v, 0, starts, table), 5):.1f} ms, "
          f"copy {1e3 * median_time(lambda: out.copy_(x), 5):.1f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 13_800_000)
