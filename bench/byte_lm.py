"""The byte-level language model of bench/convergence.py and the benchmarks built on it.

The corpus (the source text of Python's standard library, which every machine has offline,
with whole files held out for validation), the sample stream (windows drawn from a seed,
so every optimizer sees the same ones), a small transformer decoder over bytes, its loss,
and the validation loss averaged over the ranks.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


# ---------------------------------------------------------------------- data
def load_corpus(train_bytes: int, val_bytes: int):
    """The standard library's .py files (tests and site-packages left out), sorted by
    path; every 10th file is held out for validation. Returns two uint8 tensors."""
    root = os.path.dirname(os.__file__)
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__", "test", "tests", "idle_test"))
        files += [os.path.join(d, f) for f in sorted(names) if f.endswith(".py")]
    train, val, nt, nv = [], [], 0, 0
    for i, path in enumerate(files):
        held_out = i % 10 == 0
        if (nv if held_out else nt) >= (val_bytes if held_out else train_bytes):
            continue
        with open(path, "rb") as f:
            text = f.read() + b"\n\n"
        (val if held_out else train).append(text)
        if held_out:
            nv += len(text)
        else:
            nt += len(text)
    as_tensor = lambda parts, n: torch.frombuffer(bytearray(b"".join(parts)[:n]), dtype=torch.uint8)  # noqa: E731
    return as_tensor(train, train_bytes), as_tensor(val, val_bytes), root, len(files)


def sample(data: torch.Tensor, n: int, ctx: int, seed: int) -> torch.Tensor:
    """n windows of ctx + 1 bytes at offsets drawn from seed: the same for every optimizer."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - ctx - 1, (n,), generator=g)
    return torch.stack([data[s:s + ctx + 1] for s in starts.tolist()]).long()


# ---------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteLM(nn.Module):
    """Byte-level decoder; the output layer is not tied to the embedding, so the rows of
    bytes that never occur get no gradient (so the 1-bit optimizers' zero-variance mask is exercised)."""

    def __init__(self, d: int, layers: int, heads: int, ctx: int):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, x):
        h = self.tok(x) + self.pos[: x.shape[1]]
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln(h))


def lm_loss(model, seqs):
    logits = model(seqs[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 256), seqs[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, seqs, chunk=64):
    """Mean loss over this rank's sequences, averaged over the ranks (weights by count)."""
    total = torch.zeros(2, dtype=torch.float64)
    for i in range(0, seqs.shape[0], chunk):
        part = seqs[i:i + chunk]
        total[0] += lm_loss(model, part).double() * part.shape[0]
        total[1] += part.shape[0]
    dist.all_reduce(total)
    return (total[0] / total[1]).item()
