"""Cost of the max_update rule (issue 16) in the compression-stage step, measured side by side.

2 gloo ranks, a model of --numel parameters (8 equal Linear weights), fixed random local
gradients; after the freeze, rounds of --steps steps alternate between the published
rule (max_update=None, the unbounded fused update) and the default max_update (1.0 for
OneBitAdam and OneBitLamb) on twin optimizers, so machine noise hits both alike. Printed:
median step time of each and their ratio (target: within 3 %).

Kind "hook": DDP + onebit_hook + SGD momentum, normalize=None, exact_numel=0 (published) vs the default
normalize="warmup" (the weights read by the compression and the decode), or the options
of --hook-options (e.g. '{"momentum": 0.9, "normalize": "adaptive"}'); a step is then
forward, backward (the compressed allreduce of every bucket) and the SGD step.

Kind "hook_lm": the train benchmark's TinyLM "small" (13.8M parameters, batch 1 x 32 tokens,
biases and LayerNorms among them) under DDP + onebit_hook + AdamW, four hook configurations
interleaved: published (normalize=None, exact_numel=0), the weights only (exact_numel=0),
the exact small parameters only (normalize=None), and the defaults; --numel is ignored.

Kinds "adam_lm" / "lamb_lm": the same TinyLM "small" trained by OneBitAdam / OneBitLamb
themselves (no DDP), published (max_update=None, exact_numel=0) against the defaults
(max_update=1.0, exact_numel=4096: the biases and LayerNorms averaged exactly), and
max_update=1.0 alone (exact_numel=0).

    python bench/step_cost.py [--numel N] [--kinds adam,lamb,hook,hook_lm,adam_lm,lamb_lm] [--hook-options JSON]
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lbcomm  # noqa: E402
from cli_options import json_options  # noqa: E402


RULES = ("published", "default")


def make(kind, params, rule):
    kw = dict(lr=1e-3, freeze_step=2)
    if rule == "published":
        kw["max_update"] = None
    cls = {"adam": lbcomm.OneBitAdam, "lamb": lbcomm.OneBitLamb}[kind]
    return cls(params, **kw)


class HookTwin:
    """DDP (8 bias-free Linear layers side x side) + onebit_hook + SGD, past its start."""

    def __init__(self, side, rule, g, options):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(8)])
        self.ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = lbcomm.OneBitHookState(start_iter=2, **({"normalize": None, "exact_numel": 0} if rule == "published"
                                                              else options))
        self.ddp.register_comm_hook(state, lbcomm.onebit_hook)
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        self.x = torch.randn(4, side, generator=g)
        for _ in range(3):  # full-precision start, first compressed step
            self.step()

    def step(self):
        self.opt.zero_grad(set_to_none=False)
        self.ddp(self.x).square().mean().backward()
        self.opt.step()


LM_CONFIGS = {"published": dict(normalize=None, exact_numel=0), "weights only": dict(exact_numel=0),
              "exact only": dict(normalize=None), "defaults": {}}


class LMTwin:
    """TinyLM "small", past its start: DDP + onebit_hook with `options` + AdamW, or (`onebit`:
    "adam" / "lamb") the 1-bit optimizer with `options` averaging by itself."""

    def __init__(self, options, g, onebit=None):
        from lbcomm.cli.train import MODEL_PRESETS, TinyLM

        self.cfg = cfg = MODEL_PRESETS["small"]
        torch.manual_seed(0)
        model = TinyLM(cfg["vocab"], cfg["d_model"], cfg["layers"], cfg["heads"], cfg["seq_len"] + 1)
        if onebit is None:
            self.ddp = torch.nn.parallel.DistributedDataParallel(model)
            self.ddp.register_comm_hook(lbcomm.OneBitHookState(start_iter=2, **options), lbcomm.onebit_hook)
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        else:
            self.ddp = model
            cls = {"adam": lbcomm.OneBitAdam, "lamb": lbcomm.OneBitLamb}[onebit]
            self.opt = cls(model.parameters(), lr=1e-4, freeze_step=2, **options)
        self.g = g
        for _ in range(4):
            self.step()

    def step(self):
        x = torch.randint(0, self.cfg["vocab"], (self.cfg["batch"], self.cfg["seq_len"] + 1), generator=self.g)
        self.opt.zero_grad(set_to_none=False)
        self.ddp(x).backward()
        self.opt.step()


OPT_LM_CONFIGS = {"published": dict(max_update=None, exact_numel=0), "max_update only": dict(exact_numel=0),
                  "defaults": {}}


def _opt_configs(kind):
    """OPT_LM_CONFIGS; for OneBitAdam every rule but the defaults also keeps the variance
    frozen (rescale_variance=False), and "defaults, frozen v" isolates what the rescale costs."""
    if kind != "adam_lm":
        return OPT_LM_CONFIGS
    out = {name: (dict(o, rescale_variance=False) if name != "defaults" else o) for name, o in OPT_LM_CONFIGS.items()}
    out["defaults, frozen v"] = dict(rescale_variance=False)
    return out


def twin(kind, rule, side, g, a):
    """A HookTwin, or an optimizer of 8 side x side parameters past its first compressed step."""
    if kind == "hook":
        return HookTwin(side, rule, g, a.hook_options)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(side, side) * 0.02) for _ in range(8)]
    for p in params:
        p.grad = torch.randn(side, side, generator=g) * 1e-3
    opt = make(kind, params, rule)
    for _ in range(3):  # warmup, freeze, first compressed step
        opt.step()
    return opt


def rank_main(rank, world, a, init_file, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    per = a.numel // 8
    side = int(per ** 0.5)
    g = torch.Generator().manual_seed(rank)
    times = {}
    for kind in a.kinds:
        if kind == "hook_lm":
            twins = {name: LMTwin(options, g) for name, options in LM_CONFIGS.items()}
        elif kind.endswith("_lm"):
            twins = {name: LMTwin(options, g, onebit=kind[:-3]) for name, options in _opt_configs(kind).items()}
        else:
            twins = {mu: twin(kind, mu, side, g, a) for mu in RULES}
        names = list(twins)
        t = {mu: [] for mu in names}
        for r in range(a.rounds):
            for mu in (names if r % 2 == 0 else names[::-1]):  # none always goes first
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    twins[mu].step()
                t[mu].append((time.perf_counter() - t0) / a.steps)
        times[kind] = t
    if rank == 0:
        torch.save(times, out)
    dist.destroy_process_group()


def _configs_row(what, t):
    """One line: every configuration's median step and its ratio to the published one."""
    m0 = statistics.median(t["published"])
    return f"  TinyLM small, {what}, batch 1: " + "   ".join(
        f"{name} {statistics.median(v) * 1e3:.2f} ms ({statistics.median(v) / m0:.3f})" for name, v in t.items())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=2**22)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--kinds", default="adam,lamb")
    p.add_argument("--hook-options", default="", type=json_options,
                   help="JSON dict of the hook's OneBitHookState options "
                   "(default: its defaults)")
    a = p.parse_args(argv)
    a.kinds = a.kinds.split(",")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "t.pt")
        mp.start_processes(rank_main, args=(2, a, os.path.join(d, "init"), out), nprocs=2, start_method="spawn")
        times = torch.load(out)
    size = f"{a.numel:,} parameters" if not all(k.endswith("_lm") for k in a.kinds) else "TinyLM small"
    print(f"compression-stage step, {size}, 2 gloo ranks, median of {a.rounds} alternating rounds of {a.steps} steps")
    default = {"adam": "1.0", "lamb": "1.0"}
    for kind, t in times.items():
        if kind == "hook_lm":
            print(_configs_row("DDP + onebit_hook + AdamW", t))
            continue
        if kind.endswith("_lm"):
            print(_configs_row(f"OneBit{kind[:-3].capitalize()}", t))
            continue
        m0, m1 = statistics.median(t["published"]), statistics.median(t["default"])
        if kind == "hook":
            print(f"  onebit_hook+SGD normalize=None {m0 * 1e3:8.2f} ms   {a.hook_options or 'defaults'} "
                  f"{m1 * 1e3:8.2f} ms   ratio {m1 / m0:.3f}")
            continue
        print(f"  OneBit{kind.capitalize():<5} max_update=None {m0 * 1e3:8.2f} ms   max_update={default[kind]:<8} "
              f"{m1 * 1e3:8.2f} ms   ratio {m1 / m0:.3f}")


if __name__ == "__main__":
    main()
