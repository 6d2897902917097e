"""The pipelining job (pieces 1 against automatic on the same tensors) and its summary."""
from __future__ import annotations

import time

from .ranks import RankContext


def _auto_cpu_pieces(ctx: RankContext, n: int) -> int:
    """The pieces lbcomm's automatic rule gives a CPU tensor of n elements on this group."""
    import torch

    import lbcomm

    return len(lbcomm.CompressionState(n, device=torch.device("cpu"), backend=ctx.lbcomm_backend).piece_spans)


def job_pipelining(ctx: RankContext, params):
    """Time compressed_allreduce with each pieces setting ("auto": the CPU rule), interleaved."""
    import torch

    import lbcomm

    cuda = ctx.device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(ctx.device)

    out = {}
    for n in params["sizes"]:
        g = torch.Generator().manual_seed(n + ctx.rank)
        x = torch.randn(n, generator=g).to(ctx.device)
        states, first = {}, {}
        for s in params["settings"]:
            pieces = _auto_cpu_pieces(ctx, n) if s == "auto" else int(s)
            st = lbcomm.CompressionState(n, device=ctx.device, backend=ctx.lbcomm_backend, pieces=pieces)
            first[s] = lbcomm.compressed_allreduce(x, st, out=torch.empty_like(x)).cpu()  # from zero errors: must not depend on pieces
            states[s] = st
        same = all(torch.equal(first[s], first[params["settings"][0]]) for s in params["settings"])
        times = {s: [] for s in params["settings"]}
        buf = torch.empty_like(x)
        for _ in range(2):  # warm up every state's buffers
            for s in params["settings"]:
                lbcomm.compressed_allreduce(x, states[s], out=buf)
        for _ in range(params["iters"]):
            for s in params["settings"]:
                sync()
                ctx.barrier()
                t0 = time.perf_counter()
                lbcomm.compressed_allreduce(x, states[s], out=buf)
                sync()
                times[s].append(time.perf_counter() - t0)
        out[n] = {"pieces": {s: len(states[s].piece_spans) for s in params["settings"]}, "same_output": same,
                  "times": times}
        del states, x, buf
    return out


def summarize_pipelining(results, params):
    """Per size: median over calls of the slowest rank's time, per setting, and the ratio."""
    import statistics

    fig, problems, parts = {"sizes": {}}, [], []
    base = params["settings"][0]
    for n in params["sizes"]:
        key = n if n in results[0] else str(n)
        per = {}
        for s in params["settings"]:
            per_call = [max(res[key]["times"][s][i] for res in results) for i in range(params["iters"])]
            per[s] = statistics.median(per_call) * 1e3
        pieces = results[0][key]["pieces"]
        same = all(res[key]["same_output"] for res in results)
        if not same:
            problems.append(f"{n}: the output depends on the pieces setting")
        entry = {"ms": per, "pieces": pieces, "same_output": same}
        for s in params["settings"][1:]:
            entry[f"speedup_{s}_vs_{base}"] = per[base] / per[s]
        fig["sizes"][str(n)] = entry
        parts.append(f"{n >> 20}M: " + " vs ".join(f"{pieces[s]} piece(s) {per[s]:.2f} ms" for s in params["settings"]))
    fig["problems"] = problems
    fig["summary"] = "; ".join(parts)
    return not problems, fig
