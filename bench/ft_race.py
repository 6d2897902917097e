"""A fault race, over loopback or on an emulated cluster:
`lbcomm.ft.FaultTolerantLocalUpdates` with the 1-bit outer exchange against the fp32 one
(compress=False, torchft's DiLoCo exchange) and against torchft's own ``DiLoCo`` (at each
H of --diloco-sync-every), each with and without a fault, from one run (docs/internet.md).

Every run starts a torchft Lighthouse and --replicas replica groups of one process each:
over loopback, the Lighthouse in this process; with --bandwidth (root), each replica in its
own namespace of an emulated cluster (`lbcomm.cli.netem`, links of that rate, --delay one
way between replicas) and the Lighthouse in the first replica's. With a fault, the last
replica crashes (os._exit) at a third of the inner steps and is restarted --restart-after
seconds later; it heals from a live peer and trains on. The task is a small regression
with emulated compute, or (--task lm) the byte-level transformer of `lbcomm-bench race`
with real compute (`lbcomm-bench race --fault` runs that task through the same engine,
`lbcomm.cli.faultrace`; this script adds the regression). Reported per run: the final
held-out loss of the committed model (and the mean of its last 10 evaluations: at a noise
floor the loss moves from one synchronization to the next), the time to --target (a
held-out loss; training time, the evaluations after each synchronization left out, as is
train_s, the whole run's; wall_s counts them), the curve of (training time, loss), the
bytes each replica sent, and the recovery phases: detect (the crash to
the survivors' first committed quorum without it), recovery (the crash to the restarted
replica's first committed synchronization), rejoin (the restart to the restarted replica's
first committed synchronization), of which quorum (its wait in start_quorum, the
checkpoint fetch included), heal (loading the peer's state) and first step (its first
exchange and commit).

    python -m bench.ft_race                  # 3 replicas, 900 inner steps, H=10
    python -m bench.ft_race --replicas 4 --json out.json
    python -m bench.ft_race --replicas 4 --methods 1bit,diloco --diloco-sync-every 10,30
    python -m bench.ft_race --replicas 4 --task lm --steps 300 --sync-every 16 --target 2.8875 --timeout 1200
    sudo python -m bench.ft_race --replicas 4 --bandwidth 10mbit --delay 50ms --hidden 2048
"""
import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

import torch

from lbcomm.cli import faultrace

DIM = 32


def _data(seed, n=64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(7))
    x = torch.randn(n, DIM, generator=g)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g)


class Regression:
    """The default task: a one-hidden-layer MLP regressing a fixed tanh of 32 inputs, fresh
    samples every step (each replica and incarnation its own), evaluated on 1,024 held-out
    ones; the compute of a step is emulated (--step-sleep)."""

    def __init__(self, spec):
        self.spec = spec
        self.model = torch.nn.Sequential(torch.nn.Linear(DIM, spec["hidden"]), torch.nn.Tanh(),
                                         torch.nn.Linear(spec["hidden"], 1))
        self.xe, self.ye = _data(999, 1024)

    def lr_at(self, t: int) -> float:
        return 1e-3

    def loss(self, sample: int) -> torch.Tensor:
        time.sleep(self.spec["step_sleep"])  # the compute of a real step
        x, y = _data(sample)
        return torch.nn.functional.mse_loss(self.model(x), y)

    @torch.no_grad()
    def evaluate(self) -> float:
        return float(torch.nn.functional.mse_loss(self.model(self.xe), self.ye))

    def first_sample(self) -> int:
        return 10_000 * (self.spec["replica"] + 1) + 1_000_000 * self.spec["incarnation"]


def _worker(path: str) -> None:
    with open(path) as f:
        spec = json.load(f)
    torch.manual_seed(0)  # the same initial weights on every replica
    faultrace.replica(spec, Regression(spec))


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return _worker(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="1bit,fp32,diloco",
                    help="of 1bit (lbcomm's 1-bit exchange), fp32 (lbcomm, compress=False), diloco (torchft's DiLoCo)")
    ap.add_argument("--diloco-sync-every", default="",
                    help="H values of torchft's DiLoCo, comma separated (default: --sync-every)")
    ap.add_argument("--replicas", type=int, default=3, help="replica groups (3 or 4)")
    ap.add_argument("--block-size", type=int, default=faultrace.ENGINE_DEFAULTS["block_size"],
                    help="elements per scale block of the 1-bit exchange")
    ap.add_argument("--steps", type=int, default=900, help="inner steps per replica")
    ap.add_argument("--sync-every", type=int, default=10, help="H")
    ap.add_argument("--step-sleep", type=float, default=0.05, help="seconds of emulated compute per inner step")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="every method's outer SGD lr (default: 0.7, DiLoCo's)")
    ap.add_argument("--outer-momentum", type=float, default=0.9,
                    help="its Nesterov momentum; 0: plain averaging (default: 0.9, DiLoCo's)")
    ap.add_argument("--restart-after", type=float, default=faultrace.ENGINE_DEFAULTS["restart_after"],
                    help="seconds from the crash to the restart")
    ap.add_argument("--target", type=float, default=0.15, help="held-out loss of the time-to-target column")
    ap.add_argument("--join-timeout-ms", type=int, default=faultrace.ENGINE_DEFAULTS["join_timeout_ms"],
                    help="the Lighthouse's join timeout (default: the CLI's, above a round)")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=faultrace.ENGINE_DEFAULTS["heartbeat_timeout_ms"])
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    ap.add_argument("--task", choices=("regression", "lm"), default="regression",
                    help="regression: an MLP, emulated compute (default); lm: lbcomm-bench race's byte-level "
                         "transformer, real compute (what `lbcomm-bench race --fault` runs)")
    ap.add_argument("--hidden", type=int, default=256, help="regression: width of the model's hidden layer")
    for flag, default, what in (("--d-model", 512, "width"), ("--layers", 4, "blocks"), ("--heads", 8, "heads"),
                                ("--val-seqs", 256, "held-out sequences evaluated"), ("--seed", 0, "sample order")):
        ap.add_argument(flag, type=int, default=default, help=f"lm: {what} (default: the race's, {default})")
    ap.add_argument("--bandwidth", default=None,
                    help="run on an emulated cluster (root), one namespace per replica, links of this rate (tc "
                         "syntax, e.g. 10mbit); default: loopback")
    ap.add_argument("--delay", default="0", help="one-way delay between replicas on the emulated cluster, e.g. 50ms")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    methods = a.methods.split(",")
    bad = sorted(set(methods) - set(faultrace.METHODS))
    if bad:
        ap.error(f"unknown method(s) {bad}: use 1bit, fp32, diloco")
    runs = [(m, h) for m in methods for h in ([int(v) for v in a.diloco_sync_every.split(",")]
                                             if m == "diloco" and a.diloco_sync_every else [a.sync_every])]
    opts = dict(replicas=a.replicas, steps=a.steps, block_size=a.block_size, outer_lr=a.outer_lr,
                outer_momentum=a.outer_momentum, restart_after=a.restart_after, join_timeout_ms=a.join_timeout_ms,
                heartbeat_timeout_ms=a.heartbeat_timeout_ms, timeout=a.timeout, seed=a.seed)
    worker_cmd = None  # lm: the package's replica (the race's task)
    if a.task == "lm":
        from lbcomm.cli.racecli import MODEL

        opts.update(model=dict(MODEL, d_model=a.d_model, layers=a.layers, heads=a.heads), val_seqs=a.val_seqs,
                    lr=1e-3, warmup=10, schedule="constant")
    else:
        opts.update(hidden=a.hidden, step_sleep=a.step_sleep)
        worker_cmd = [sys.executable, os.path.abspath(__file__), "--worker"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ft_race_") as tmp, contextlib.ExitStack() as stack:
        cluster = None
        if a.bandwidth:
            from lbcomm.cli.netem import EmulatedCluster

            cluster = stack.enter_context(EmulatedCluster(a.replicas, a.bandwidth, delay=a.delay))
        for method, h in runs:
            for fault in (False, True):
                rows.append(faultrace.run(opts, method, h, fault, tmp, a.target, worker_cmd, cluster))
                print(json.dumps(rows[-1]), flush=True)
    print("\n".join(faultrace.table(rows) + faultrace.summary(rows, "1bit")))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
