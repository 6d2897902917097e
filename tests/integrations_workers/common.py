"""Shared pieces of the integration workers (run under torchrun, one process per rank)."""
import os
import socket
import struct

import torch

_TCP_INFO_BYTES_ACKED = 120  # struct tcp_info: __u64 tcpi_bytes_acked (Linux >= 4.1)
_TCP_INFO_BYTES_SENT = 200  # __u64 tcpi_bytes_sent (Linux >= 4.19): payload bytes, retransmits included


def tcp_bytes_sent() -> int:
    """Payload bytes this process has sent on its TCP sockets so far, read from the kernel
    (TCP_INFO) — independent of what lbcomm or torch report. The rendezvous store's
    connection (MASTER_PORT) is left out: its keep-alive traffic comes at any time and is
    not the training's communication."""
    assert socket.getdefaulttimeout() is None  # wrapping an fd must not change its blocking mode
    store_port = int(os.environ.get("MASTER_PORT", "0"))
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if store_port and store_port in (s.getsockname()[1], s.getpeername()[1]):
                continue
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:
            continue
        finally:
            s.close()  # the duplicate only
        off = _TCP_INFO_BYTES_SENT if len(info) >= _TCP_INFO_BYTES_SENT + 8 else _TCP_INFO_BYTES_ACKED
        total += struct.unpack_from("Q", info, off)[0]
    return total


def rank_world():
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def flat_grads(params):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().clone()
                      for p in params])


def tensors_of(obj, prefix=""):
    """{path: tensor} of every tensor in a nested state dict (for bitwise comparisons)."""
    out = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().cpu().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensors_of(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(tensors_of(v, f"{prefix}/{i}"))
    elif isinstance(obj, (int, float, bool, str)) or obj is None:
        out[prefix] = obj
    return out


def save_result(out_dir, result):
    rank, _ = rank_world()
    torch.save(result, os.path.join(out_dir, f"result-rank{rank}.pt"))
