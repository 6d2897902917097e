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
with real compute. Reported per run: the final
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
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch

DIM = 32


def _data(seed, n=64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(7))
    x = torch.randn(n, DIM, generator=g)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g)


class Regression:
    """The default task: a one-hidden-layer MLP regressing a fixed tanh of 32 inputs, fresh
    samples every step, evaluated on 1,024 held-out ones; the compute of a step is emulated
    (--step-sleep)."""

    def __init__(self, a):
        self.model = torch.nn.Sequential(torch.nn.Linear(DIM, a.hidden), torch.nn.Tanh(),
                                         torch.nn.Linear(a.hidden, 1))
        self.xe, self.ye = _data(999, 1024)

    def lr_at(self, t: int) -> float:
        return 1e-3

    def loss(self, sample: int) -> torch.Tensor:
        x, y = _data(sample)
        return torch.nn.functional.mse_loss(self.model(x), y)

    @torch.no_grad()
    def evaluate(self) -> float:
        return float(torch.nn.functional.mse_loss(self.model(self.xe), self.ye))


class ByteLM:
    """`lbcomm-bench race`'s task: its byte-level transformer (--d-model, --layers, --heads;
    32 tokens, one sequence per replica and step, AdamW at 1e-3 after 10 steps of warmup),
    each replica its share of the race's global batches, evaluated on --val-seqs held-out
    sequences; the compute is real."""

    def __init__(self, a):
        from lbcomm.cli.race import Data, _model
        from lbcomm.cli.racecli import MODEL

        cfg = dict(MODEL, d_model=a.d_model, layers=a.layers, heads=a.heads)
        self.model = _model(cfg)
        self.train = Data(cfg, a.replica, a.replicas, a.seed, a.val_seqs)
        self.val = Data(cfg, 0, 1, a.seed, a.val_seqs)  # every replica the whole held-out set

    def lr_at(self, t: int) -> float:
        from lbcomm.cli.race import lr_at

        return lr_at(t, 1e-3, 10)

    def loss(self, sample: int) -> torch.Tensor:
        return self.model(self.train.batch_at(sample))

    def evaluate(self) -> float:
        from lbcomm.cli.race import evaluate
        from lbcomm.comm.loop import LoopTransport

        return evaluate(self.model, self.val, LoopTransport(1))  # one rank holds the whole set


def _task(a):
    torch.manual_seed(0)  # the same initial weights on every replica
    task = (ByteLM if a.task == "lm" else Regression)(a)
    task.eval_s = 0.0  # seconds spent evaluating so far
    return task


def _manager(a, load_state_dict=None, state_dict=None):
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=15))
    manager = Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=2,
                      use_async_quorum=False, replica_id=f"replica_{a.replica}", lighthouse_addr=a.lighthouse,
                      rank=0, world_size=1, store_addr=a.host, store_port=store.port, hostname=a.host,
                      timeout=timedelta(seconds=15), quorum_timeout=timedelta(seconds=120))
    return manager, pg, store


def _train_step(a, task, inner, step_seed, t) -> None:
    for group in inner.param_groups:
        group["lr"] = task.lr_at(t)
    loss = task.loss(step_seed + t)
    inner.zero_grad()
    loss.backward()
    inner.step()
    if a.task == "regression":
        time.sleep(a.step_sleep)  # the compute of a real step
    if a.die_at and t + 1 == a.die_at:
        with open(a.out + ".died", "w") as f:
            f.write(str(time.time()))
        os._exit(17)


def _synced(task, log, **entry) -> None:
    """Log a committed synchronization: when it committed, the held-out loss, and the
    seconds of evaluation before it (which the race's clock leaves out: a method that
    synchronizes more often is evaluated more often)."""
    t = time.time()
    log.append(dict(entry, t=t, eval=task.evaluate(), evals_before_s=task.eval_s))
    task.eval_s += time.time() - t


def _step_seed(a) -> int:
    """Where a replica's samples start: the regression draws its own per replica (and per
    incarnation, so a restarted one sees new samples); the LM takes the replica's share of
    the race's global batch of each step (a restarted replica a new one)."""
    if a.task == "lm":
        return 1_000_000 * a.incarnation
    return 10_000 * (a.replica + 1) + 1_000_000 * a.incarnation


def diloco_worker(a) -> None:
    """torchft's DiLoCo (fp32 outer exchange) on the same model, data and fault: its
    Manager heals a restarted replica with the model and the inner optimizer's state, and
    DiLoCo's own fragment state (the anchor, the outer optimizer)."""
    from torchft.local_sgd import DiLoCo

    from lbcomm.common import ring_allreduce_bytes

    torch.set_num_threads(1)
    task = _task(a)
    model = task.model
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def load(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager, pg, store = _manager(a, load, lambda: {"model": model.state_dict(), "inner": inner.state_dict()})
    outer = torch.optim.SGD(model.parameters(), lr=a.outer_lr, momentum=a.outer_momentum,
                            nesterov=a.outer_momentum > 0)
    step_seed = _step_seed(a)
    numel = sum(p.numel() for p in model.parameters())
    log, sent, t = [], 0, 0
    with DiLoCo(manager, [model], inner, outer, sync_every=a.sync_every, backup_device=torch.device("cpu"),
                pin_memory=False, use_bucketization=False):
        # until the committed synchronizations of --steps (a replica whose commit failed
        # takes its round again, as the others do), at most twice the inner steps
        while manager.current_step() < a.steps // a.sync_every and t < 2 * a.steps:
            before = manager.current_step()
            _train_step(a, task, inner, step_seed, t)
            t += 1
            if t % a.sync_every == 0:
                sent += int(ring_allreduce_bytes(4 * numel, manager.num_participants()))
            if manager.current_step() > before:  # a committed synchronization
                _synced(task, log, step=manager.current_step(), members=manager.num_participants(), quorum_s=None,
                        exchange_s=0.0, commit_s=0.0)
    with open(a.out, "w") as f:
        json.dump({"log": log, "stats": {"syncs": len(log), "bytes_sent": sent, "failed": None}, "inner_steps": t}, f)
    manager.shutdown(wait=False)
    os._exit(0)


def worker(a) -> None:
    from lbcomm import CommConfig
    from lbcomm.ft import FaultTolerantLocalUpdates

    torch.set_num_threads(1)  # several replicas share the cores
    manager, pg, store = _manager(a)
    task = _task(a)
    model = task.model
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    local = FaultTolerantLocalUpdates(model.parameters(), inner, a.sync_every, manager=manager, pg=pg,
                                      compress=bool(a.compress), outer_lr=a.outer_lr, outer_momentum=a.outer_momentum,
                                      comm=CommConfig(exact_numel=300, block_size=a.block_size))
    step_seed = _step_seed(a)
    log = []
    while local.inner_steps < a.steps:
        _train_step(a, task, inner, step_seed, local.inner_steps)
        if local.step():
            _synced(task, log, step=manager.current_step(), **local.last_sync)
    with open(a.out, "w") as f:
        json.dump({"log": log, "stats": local.stats(), "inner_steps": local.inner_steps}, f)
    manager.shutdown(wait=False)
    os._exit(0)


LIGHTHOUSE_PORT = 29510


def _lighthouse(args, cluster):
    """torchft's Lighthouse: (address, stop). In this process over loopback; on an emulated
    cluster in the first replica's namespace, where every replica reaches it over the
    emulated links."""
    opts = dict(min_replicas=2, join_timeout_ms=args.join_timeout_ms, quorum_tick_ms=20,
                heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    if cluster is None:
        from torchft.coordination import LighthouseServer

        lh = LighthouseServer(bind="127.0.0.1:0", **opts)
        return lh.address(), lh.shutdown
    code = ("import sys, time\nfrom torchft.coordination import LighthouseServer\n"
            f"lh = LighthouseServer(bind='{cluster.addr(0)}:{LIGHTHOUSE_PORT}', **{opts!r})\n"
            "print('ready', flush=True)\nsys.stdin.read()\n")
    proc = cluster.popen(0, [sys.executable, "-c", code], env={"RUST_LOG": "warn"}, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the Lighthouse did not start in the first replica's namespace")
    address = f"http://{cluster.addr(0)}:{LIGHTHOUSE_PORT}"  # its own address() names the host

    def stop():
        proc.kill()
        proc.wait(timeout=30)

    return address, stop


def run(args, method: str, fault: bool, tmp: str, sync_every: int, cluster=None) -> dict:
    """One run of `method` ("1bit", "fp32" or "diloco") with H = `sync_every`, over
    loopback or on `cluster` (a started `lbcomm.cli.netem.EmulatedCluster`, one namespace
    per replica)."""
    lighthouse, stop_lighthouse = _lighthouse(args, cluster)
    name = f"diloco_h{sync_every}" if method == "diloco" else method
    tag = f"{name}_{'fault' if fault else 'clean'}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", RUST_LOG="warn")

    def start(i, incarnation=0, die_at=0):
        out = os.path.join(tmp, f"{tag}_r{i}_{incarnation}.json")
        host = "127.0.0.1" if cluster is None else cluster.addr(i)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--replica", str(i), "--incarnation",
               str(incarnation), "--lighthouse", lighthouse, "--out", out, "--compress", str(int(method == "1bit")),
               "--steps", str(args.steps), "--sync-every", str(sync_every), "--step-sleep", str(args.step_sleep),
               "--die-at", str(die_at), "--block-size", str(args.block_size), "--hidden", str(args.hidden),
               "--task", args.task, "--d-model", str(args.d_model), "--layers", str(args.layers),
               "--heads", str(args.heads), "--val-seqs", str(args.val_seqs), "--seed", str(args.seed),
               "--replicas", str(args.replicas), "--outer-lr", str(args.outer_lr),
               "--outer-momentum", str(args.outer_momentum), "--host", host] + (["--diloco"] * (method == "diloco"))
        log = open(out + ".log", "w")
        if cluster is None:
            return subprocess.Popen(cmd, env=dict(env, GLOO_SOCKET_IFNAME="lo"), stdout=log,
                                    stderr=subprocess.STDOUT), out
        # torchft advertises socket.gethostname() for its checkpoint server, the host's name in
        # every namespace: each replica gets a UTS namespace whose hostname is its address
        cmd = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host] + cmd
        return cluster.popen(i, cmd, env=dict(env, RANK="0", WORLD_SIZE="1"), stdout=log,
                             stderr=subprocess.STDOUT), out

    victim = args.replicas - 1
    procs, outs = [], []
    t_restart = None
    try:
        for i in range(args.replicas):
            p, o = start(i, die_at=args.steps // 3 if fault and i == victim else 0)
            procs.append(p)
            outs.append(o)
        t0 = time.time()
        if fault:
            procs[victim].wait(timeout=args.timeout)
            time.sleep(args.restart_after)
            p, o = start(victim, incarnation=1)
            t_restart = time.time()
            procs.append(p)
            outs.append(o)
        for p in procs[:victim]:
            p.wait(timeout=args.timeout)
        if fault:
            try:
                procs[-1].wait(timeout=30)
            except subprocess.TimeoutExpired:  # came after the others finished: reported as not rejoined
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        stop_lighthouse()
    res = [json.load(open(o)) if os.path.exists(o) else None for o in outs]
    ref = res[0]
    if ref is None:
        tail = open(outs[0] + ".log").read()[-3000:] if os.path.exists(outs[0] + ".log") else ""
        raise RuntimeError(f"{tag}: replica 0 wrote no result; its log ends with:\n{tail}")
    log = ref["log"]
    final = log[-1]["eval"]
    clock = [e["t"] - t0 - e.get("evals_before_s", 0.0) for e in log]  # training time, evaluations left out
    hit = next((c for c, e in zip(clock, log) if e["eval"] <= args.target), None)
    tail = [e["eval"] for e in log[-10:]]  # the final loss at a noise floor moves from sync to sync
    row = {"run": tag, "method": name, "fault": fault, "final_loss": final, "last10_loss": sum(tail) / len(tail),
           "time_to_target_s": hit, "wall_s": log[-1]["t"] - t0,
           "syncs": ref["stats"]["syncs"], "bytes_per_replica": ref["stats"]["bytes_sent"],
           "failed_attempts": ref["stats"]["failed"],
           "train_s": clock[-1], "curve": [[round(c, 3), e["eval"]] for c, e in zip(clock, log)]}
    if fault:
        died = float(open(outs[victim] + ".died").read())
        after = [e for e in log if e["t"] > died and e["members"] < args.replicas]
        row["detect_s"] = after[0]["t"] - died if after else None
        joiner = res[-1]
        if joiner and joiner["log"]:
            first = joiner["log"][0]
            row.update(recovery_s=first["t"] - died, rejoin_s=first["t"] - t_restart, quorum_s=first["quorum_s"],
                       heal_s=first.get("heal_apply_s"), first_step_s=first["exchange_s"] + first["commit_s"])
        else:
            row["rejoin_s"] = None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--incarnation", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--compress", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--diloco", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--methods", default="1bit,fp32,diloco",
                    help="of 1bit (lbcomm's 1-bit exchange), fp32 (lbcomm, compress=False), diloco (torchft's DiLoCo)")
    ap.add_argument("--diloco-sync-every", default="",
                    help="H values of torchft's DiLoCo, comma separated (default: --sync-every)")
    ap.add_argument("--die-at", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--replicas", type=int, default=3, help="replica groups (3 or 4)")
    ap.add_argument("--block-size", type=int, default=2048, help="elements per scale block of the 1-bit exchange")
    ap.add_argument("--steps", type=int, default=900, help="inner steps per replica")
    ap.add_argument("--sync-every", type=int, default=10, help="H")
    ap.add_argument("--step-sleep", type=float, default=0.05, help="seconds of emulated compute per inner step")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="every method's outer SGD lr (default: 0.7, DiLoCo's)")
    ap.add_argument("--outer-momentum", type=float, default=0.9,
                    help="its Nesterov momentum; 0: plain averaging (default: 0.9, DiLoCo's)")
    ap.add_argument("--restart-after", type=float, default=10.0, help="seconds from the crash to the restart")
    ap.add_argument("--target", type=float, default=0.15, help="held-out loss of the time-to-target column")
    ap.add_argument("--join-timeout-ms", type=int, default=5000)
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    ap.add_argument("--task", choices=("regression", "lm"), default="regression",
                    help="regression: an MLP, emulated compute (default); lm: lbcomm-bench race's byte-level "
                         "transformer, real compute")
    ap.add_argument("--hidden", type=int, default=256, help="regression: width of the model's hidden layer")
    for flag, default, what in (("--d-model", 512, "width"), ("--layers", 4, "blocks"), ("--heads", 8, "heads"),
                                ("--val-seqs", 256, "held-out sequences evaluated"), ("--seed", 0, "sample order")):
        ap.add_argument(flag, type=int, default=default, help=f"lm: {what} (default: the race's, {default})")
    ap.add_argument("--bandwidth", default=None,
                    help="run on an emulated cluster (root), one namespace per replica, links of this rate (tc "
                         "syntax, e.g. 10mbit); default: loopback")
    ap.add_argument("--delay", default="0", help="one-way delay between replicas on the emulated cluster, e.g. 50ms")
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    if a.worker:
        (diloco_worker if a.diloco else worker)(a)
        return
    methods = a.methods.split(",")
    bad = sorted(set(methods) - {"1bit", "fp32", "diloco"})
    if bad:
        ap.error(f"unknown method(s) {bad}: use 1bit, fp32, diloco")
    runs = [(m, h) for m in methods for h in ([int(v) for v in a.diloco_sync_every.split(",")]
                                             if m == "diloco" and a.diloco_sync_every else [a.sync_every])]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ft_race_") as tmp, contextlib.ExitStack() as stack:
        cluster = None
        if a.bandwidth:
            from lbcomm.cli.netem import EmulatedCluster

            cluster = stack.enter_context(EmulatedCluster(a.replicas, a.bandwidth, delay=a.delay))
        for method, h in runs:
            for fault in (False, True):
                rows.append(run(a, method, fault, tmp, h, cluster))
                print(json.dumps(rows[-1]), flush=True)
    cols = ["run", "final_loss", "last10_loss", "time_to_target_s", "train_s", "wall_s", "syncs", "bytes_per_replica",
            "failed_attempts", "detect_s", "recovery_s", "rejoin_s", "quorum_s", "heal_s", "first_step_s"]

    def fmt(v):
        return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))

    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
    by = {r["run"]: r for r in rows}
    names = list(dict.fromkeys(r["method"] for r in rows))
    for name in names:
        c, f = by[f"{name}_clean"], by[f"{name}_fault"]
        print(f"{name}: final loss fault/clean = {f['final_loss'] / c['final_loss']:.3f}, "
              f"mean of the last 10 evaluations fault/clean = {f['last10_loss'] / c['last10_loss']:.3f}")
    if "1bit" in names:
        ref = by["1bit_fault"]
        for name in names[1:] if names[0] == "1bit" else [n for n in names if n != "1bit"]:
            other = by[f"{name}_fault"]
            times = (ref["time_to_target_s"], other["time_to_target_s"])
            ratio = f"{times[1] / times[0]:.2f}x" if None not in times else "-"
            print(f"with the fault, {name} / 1bit: time to target {ratio}, last10 loss "
                  f"{other['last10_loss'] / ref['last10_loss']:.3f}, bytes per replica "
                  f"{other['bytes_per_replica'] / ref['bytes_per_replica']:.1f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
