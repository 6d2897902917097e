"""The fault race: local-update training as torchft replica groups, one of which crashes
and comes back, timed against the same run without the fault (`lbcomm-bench race --fault`,
docs/internet.md).

Every run starts a torchft Lighthouse and one process per replica group. Over loopback the
Lighthouse lives in this process; on an emulated cluster (`netem.EmulatedCluster`, one
namespace per replica) in the first replica's namespace, where the others reach it over
the emulated links. With the fault, the last replica exits (``os._exit``, no goodbye) after
a third of the inner steps and is started again `restart_after` seconds later: it joins
the next quorum, heals from a live peer and trains on, while the survivors never stop.

Methods: ``1bit`` (`lbcomm.ft.FaultTolerantLocalUpdates`, the 1-bit outer exchange),
``fp32`` (the same with ``compress=False``) and ``diloco`` (torchft's own ``DiLoCo``), each
with AdamW inner steps. A replica trains a `Task`: the race's byte-level transformer here
(`LMTask`); bench/ft_race.py brings a regression with emulated compute through the same
engine. Each replica logs its committed synchronizations and the held-out loss of the
committed model after each; the clock leaves the evaluations out.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from typing import Dict, List, Optional, Sequence

import torch

from ..config import DEFAULT_BLOCK_SIZE

__all__ = ["METHODS", "ENGINE_DEFAULTS", "LMTask", "run", "replica", "summary", "table", "ROW_FIELDS",
           "FAULT_ROW_FIELDS", "cmd_fault_race", "check_fault_doc"]

METHODS = ("1bit", "fp32", "diloco")
# the Lighthouse's timing (quick detection; a join timeout above a round: a group waiting for the
# others' next quorum starts its clock), the restart delay, the 1-bit block size and exact tensors:
# 300 is below the LM's width (512), so biases and norms are compressed too (the config says so)
ENGINE_DEFAULTS = dict(join_timeout_ms=60000, heartbeat_timeout_ms=1000, block_size=DEFAULT_BLOCK_SIZE,
                       exact_numel=300, restart_after=10.0)
LIGHTHOUSE_PORT = 29510

ROW_FIELDS = {
    "run": (str, "method and fault: <method>_clean | <method>_fault"),
    "method": (str, "1bit | fp32 | diloco, with _hH for diloco (the CLI: onebit_local_hH | diloco_hH)"),
    "fault": (bool, "the last replica crashed at a third of the inner steps and restarted"),
    "final_loss": (float, "held-out loss of the committed model after the last synchronization (replica 0)"),
    "last10_loss": (float, "mean of the last 10 such losses (at a noise floor the loss moves from sync to sync)"),
    "time_to_target_s": ((float, type(None)), "training seconds (evaluations left out) to the target; null: missed"),
    "train_s": (float, "training seconds of the whole run (evaluations left out)"),
    "wall_s": (float, "wall seconds of the whole run"),
    "syncs": (int, "committed synchronizations of replica 0"),
    "bytes_per_replica": (int, "bytes replica 0 sent in its outer exchanges"),
    "failed_attempts": ((int, type(None)), "exchanges replica 0 took again after a failed commit (1bit, fp32)"),
    "curve": (list, "[training seconds, held-out loss] after each committed synchronization"),
    "members": (list, "replica groups in each of replica 0's committed synchronizations (absent before 2026-12)"),
}
_SECONDS = (float, type(None))
FAULT_ROW_FIELDS = {  # with the fault; null where it did not happen
    "detect_s": (_SECONDS, "the crash to the survivors' first committed synchronization without it"),
    "recovery_s": (_SECONDS, "the crash to the restarted replica's first committed synchronization"),
    "rejoin_s": (_SECONDS, "the restart to that synchronization, of which:"),
    "quorum_s": (_SECONDS, "its wait in start_quorum, the fetch of a live peer's state included"),
    "heal_s": (_SECONDS, "loading that state"),
    "first_step_s": (_SECONDS, "its first exchange and commit"),
}
FAULT_FIELDS = tuple(FAULT_ROW_FIELDS)


class LMTask:
    """`lbcomm-bench race`'s task for one replica: its byte-level transformer (`cfg`: the
    race's model options), the replica's share of the race's global batch of each step,
    AdamW's lr from the race's schedule, the held-out loss over `val_seqs` sequences; the
    compute is real."""

    def __init__(self, spec: Dict):
        from .race import Data, _model, load_corpus

        cfg = spec["model"]
        self.spec, self.model = spec, _model(cfg)
        corpus = load_corpus(cfg["train_bytes"], cfg["val_bytes"])
        self.train = Data(cfg, spec["replica"], spec["replicas"], spec["seed"], spec["val_seqs"], corpus)
        self.val = Data(cfg, 0, 1, spec["seed"], spec["val_seqs"], corpus)  # every replica the whole held-out set

    def lr_at(self, t: int) -> float:
        from .race import lr_at

        s = self.spec
        return lr_at(t, s["lr"], s["warmup"], s["schedule"], s["steps"])

    def loss(self, sample: int) -> torch.Tensor:
        return self.model(self.train.batch_at(sample))

    def evaluate(self) -> float:
        from ..comm.loop import LoopTransport
        from .race import evaluate

        return evaluate(self.model, self.val, LoopTransport(1))  # one rank holds the whole set

    def first_sample(self) -> int:
        """Where this incarnation's samples start: a restarted replica takes new batches."""
        return 1_000_000 * self.spec["incarnation"]


def _manager(spec: Dict, load_state_dict=None, state_dict=None):
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=15))
    host = spec["host"]
    manager = Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=2,
                      use_async_quorum=False, replica_id=f"replica_{spec['replica']}",
                      lighthouse_addr=spec["lighthouse"],
                      rank=0, world_size=1, store_addr=host, store_port=store.port, hostname=host,
                      timeout=timedelta(seconds=15), quorum_timeout=timedelta(seconds=120))
    return manager, pg, store


class _Replica:
    """One replica's loop around its task: the inner step (and the crash), the log."""

    def __init__(self, spec: Dict, task):
        self.spec, self.task, self.log, self.eval_s = spec, task, [], 0.0
        self.inner = torch.optim.AdamW(task.model.parameters(), lr=task.lr_at(0))

    def train_step(self, t: int) -> None:
        for group in self.inner.param_groups:
            group["lr"] = self.task.lr_at(t)
        loss = self.task.loss(self.task.first_sample() + t)
        self.inner.zero_grad()
        loss.backward()
        self.inner.step()
        if self.spec["die_at"] and t + 1 == self.spec["die_at"]:
            with open(self.spec["out"] + ".died", "w") as f:
                f.write(str(time.time()))
            os._exit(17)

    def synced(self, **entry) -> None:
        """Log a committed synchronization: when, the held-out loss, and the seconds of
        evaluation before it (left out of the clock: a method that synchronizes more often
        is evaluated more often)."""
        t = time.time()
        self.log.append(dict(entry, t=t, eval=self.task.evaluate(), evals_before_s=self.eval_s))
        # the log so far, for a replica stopped before it finishes: a group left out of the
        # last round waits for a quorum that never comes, but its rejoin still counts
        with open(self.spec["out"] + ".tmp", "w") as f:
            json.dump({"log": self.log, "stats": None, "inner_steps": None}, f)
        os.replace(self.spec["out"] + ".tmp", self.spec["out"] + ".partial")
        self.eval_s += time.time() - t

    def finish(self, manager, stats: Dict, inner_steps: int) -> None:
        with open(self.spec["out"], "w") as f:
            json.dump({"log": self.log, "stats": stats, "inner_steps": inner_steps}, f)
        manager.shutdown(wait=False)
        os._exit(0)  # torchft's threads would keep the process alive


def _diloco(spec: Dict, task) -> None:
    """torchft's DiLoCo (fp32 outer exchange): its Manager heals a restarted replica with
    the model and the inner optimizer's state, and DiLoCo's own (the anchor, the outer
    optimizer)."""
    from torchft.local_sgd import DiLoCo

    from ..common import ring_allreduce_bytes

    r, model = _Replica(spec, task), task.model

    def load(sd):
        model.load_state_dict(sd["model"])
        r.inner.load_state_dict(sd["inner"])

    manager, pg, store = _manager(spec, load, lambda: {"model": model.state_dict(), "inner": r.inner.state_dict()})
    h, steps, momentum = spec["sync_every"], spec["steps"], spec["outer_momentum"]
    outer = torch.optim.SGD(model.parameters(), lr=spec["outer_lr"], momentum=momentum, nesterov=momentum > 0)
    numel = sum(p.numel() for p in model.parameters())
    sent, t = 0, 0
    with DiLoCo(manager, [model], r.inner, outer, sync_every=h, backup_device=torch.device("cpu"),
                pin_memory=False, use_bucketization=False):
        # until the committed synchronizations of `steps` (a replica whose commit failed takes
        # its round again, as the others do), at most twice the inner steps
        while manager.current_step() < steps // h and t < 2 * steps:
            before = manager.current_step()
            r.train_step(t)
            t += 1
            if t % h == 0:
                sent += int(ring_allreduce_bytes(4 * numel, manager.num_participants()))
            if manager.current_step() > before:
                r.synced(step=manager.current_step(), members=manager.num_participants(), quorum_s=None,
                         exchange_s=0.0, commit_s=0.0)
    r.finish(manager, {"syncs": len(r.log), "bytes_sent": sent, "failed": None}, t)


def replica(spec: Dict, task) -> None:
    """Run one replica process of `spec` (written by `run`) on `task`; exits the process."""
    torch.set_num_threads(1)  # the replicas share the cores
    if spec["method"] == "diloco":
        return _diloco(spec, task)
    from .. import CommConfig
    from ..ft import FaultTolerantLocalUpdates

    manager, pg, store = _manager(spec)
    r = _Replica(spec, task)
    local = FaultTolerantLocalUpdates(task.model.parameters(), r.inner, spec["sync_every"], manager=manager, pg=pg,
                                      compress=spec["method"] == "1bit", outer_lr=spec["outer_lr"],
                                      outer_momentum=spec["outer_momentum"],
                                      comm=CommConfig(exact_numel=spec["exact_numel"], block_size=spec["block_size"]))
    while local.inner_steps < spec["steps"]:
        r.train_step(local.inner_steps)
        if local.step():
            r.synced(step=manager.current_step(), **local.last_sync)
    r.finish(manager, local.stats(), local.inner_steps)


def _lighthouse(opts: Dict, cluster):
    """torchft's Lighthouse: (address, stop), in this process or in the first replica's
    namespace of `cluster`."""
    kw = dict(min_replicas=2, join_timeout_ms=opts["join_timeout_ms"], quorum_tick_ms=20,
              heartbeat_timeout_ms=opts["heartbeat_timeout_ms"])
    if cluster is None:
        from torchft.coordination import LighthouseServer

        lh = LighthouseServer(bind="127.0.0.1:0", **kw)
        return lh.address(), lh.shutdown
    code = ("import sys\nfrom torchft.coordination import LighthouseServer\n"
            f"lh = LighthouseServer(bind='{cluster.addr(0)}:{LIGHTHOUSE_PORT}', **{kw!r})\n"
            "print('ready', flush=True)\nsys.stdin.read()\n")
    proc = cluster.popen(0, [sys.executable, "-c", code], env={"RUST_LOG": "warn"}, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the Lighthouse did not start in the first replica's namespace")

    def stop():
        proc.kill()
        proc.wait(timeout=30)

    return f"http://{cluster.addr(0)}:{LIGHTHOUSE_PORT}", stop  # its own address() names the host


def _start(spec: Dict, worker_cmd: Sequence[str], cluster):
    """Start one replica process on `spec` (written next to its output)."""
    with open(spec["out"] + ".spec", "w") as f:
        json.dump(spec, f)
    cmd = list(worker_cmd) + [spec["out"] + ".spec"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", RUST_LOG="warn")
    log = open(spec["out"] + ".log", "w")
    if cluster is None:
        return subprocess.Popen(cmd, env=dict(env, GLOO_SOCKET_IFNAME="lo"), stdout=log, stderr=subprocess.STDOUT)
    # torchft advertises socket.gethostname() for its checkpoint server, the host's name in
    # every namespace: each replica gets a UTS namespace whose hostname is its address
    cmd = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', spec["host"]] + cmd
    return cluster.popen(spec["replica"], cmd, env=dict(env, RANK="0", WORLD_SIZE="1"), stdout=log,
                         stderr=subprocess.STDOUT)


def run(opts: Dict, method: str, sync_every: int, fault: bool, tmp: str, target: float,
        worker_cmd: Optional[Sequence[str]] = None, cluster=None, name: Optional[str] = None) -> Dict:
    """One run of `method` (of METHODS) at H = `sync_every` on opts["replicas"] replicas,
    with or without the fault; returns its row (ROW_FIELDS, and with the fault the recovery
    phases). `opts` holds the task's options and the engine's (ENGINE_DEFAULTS, steps,
    timeout, ...); `worker_cmd` starts a replica on a spec file (default: this module's)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: one of {', '.join(METHODS)}")
    opts = dict(ENGINE_DEFAULTS, **opts)
    worker_cmd = worker_cmd or [sys.executable, "-m", __name__]
    name = name or (f"diloco_h{sync_every}" if method == "diloco" else method)
    tag = f"{name}_{'fault' if fault else 'clean'}"
    n, victim = opts["replicas"], opts["replicas"] - 1
    lighthouse, stop_lighthouse = _lighthouse(opts, cluster)

    def start(i: int, incarnation: int = 0, die_at: int = 0):
        out = os.path.join(tmp, f"{tag}_r{i}_{incarnation}.json")
        spec = dict(opts, replica=i, incarnation=incarnation, lighthouse=lighthouse, out=out, method=method,
                    sync_every=sync_every, die_at=die_at, host="127.0.0.1" if cluster is None else cluster.addr(i))
        return _start(spec, worker_cmd, cluster), out

    procs, outs, t_restart = [], [], None
    try:
        for i in range(n):
            p, o = start(i, die_at=opts["steps"] // 3 if fault and i == victim else 0)
            procs.append(p)
            outs.append(o)
        t0 = time.time()
        if fault:
            procs[victim].wait(timeout=opts["timeout"])
            time.sleep(opts["restart_after"])
            p, o = start(victim, incarnation=1)
            t_restart = time.time()
            procs.append(p)
            outs.append(o)
        for p in procs[:victim]:
            p.wait(timeout=opts["timeout"])
        if fault:
            try:
                procs[-1].wait(timeout=30)
            except subprocess.TimeoutExpired:  # left out of the last round: its partial log counts
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        stop_lighthouse()
    return _row(tag, name, fault, target, t0, t_restart, outs, victim, n)


def _result(out: str) -> Optional[Dict]:
    """A replica's result, else its log as of its last synchronization (stats None), else None."""
    for path in (out, out + ".partial"):
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
    return None


def _row(tag: str, name: str, fault: bool, target: float, t0: float, t_restart: Optional[float],
         outs: List[str], victim: int, n: int) -> Dict:
    res = [_result(o) for o in outs]
    ref = res[0]
    if ref is None or ref["stats"] is None or not ref["log"]:
        tail = open(outs[0] + ".log").read()[-3000:] if os.path.exists(outs[0] + ".log") else ""
        raise RuntimeError(f"{tag}: replica 0 did not finish or committed no synchronization; its log ends "
                           f"with:\n{tail}")
    log = ref["log"]
    clock = [e["t"] - t0 - e.get("evals_before_s", 0.0) for e in log]  # training time, evaluations left out
    hit = next((c for c, e in zip(clock, log) if e["eval"] <= target), None)
    tail = [e["eval"] for e in log[-10:]]
    row = {"run": tag, "method": name, "fault": fault, "final_loss": log[-1]["eval"],
           "last10_loss": sum(tail) / len(tail), "time_to_target_s": hit, "train_s": clock[-1],
           "wall_s": log[-1]["t"] - t0, "syncs": ref["stats"]["syncs"],
           "bytes_per_replica": int(ref["stats"]["bytes_sent"]), "failed_attempts": ref["stats"]["failed"],
           "curve": [[round(c, 3), e["eval"]] for c, e in zip(clock, log)], "members": [e["members"] for e in log]}
    if fault:
        died = float(open(outs[victim] + ".died").read())
        after = [e for e in log if e["t"] > died and e["members"] < n]
        row.update({k: None for k in FAULT_FIELDS}, detect_s=after[0]["t"] - died if after else None)
        joiner = res[-1]
        if joiner and joiner["log"]:
            first = joiner["log"][0]
            row.update(recovery_s=first["t"] - died, rejoin_s=first["t"] - t_restart, quorum_s=first["quorum_s"],
                       heal_s=first.get("heal_apply_s"), first_step_s=first["exchange_s"] + first["commit_s"])
    return row


def summary(rows: List[Dict], ref_name: str) -> List[str]:
    """Per method: fault / clean; and under the fault each other method against `ref_name`."""
    by = {r["run"]: r for r in rows}
    names = list(dict.fromkeys(r["method"] for r in rows))
    lines = []
    for name in names:
        c, f = by.get(f"{name}_clean"), by.get(f"{name}_fault")
        if c and f:
            lines.append(f"{name}: final loss fault/clean = {f['final_loss'] / c['final_loss']:.3f}, mean of the "
                         f"last 10 evaluations fault/clean = {f['last10_loss'] / c['last10_loss']:.3f}")
    ref = by.get(f"{ref_name}_fault")
    for name in names:
        other = by.get(f"{name}_fault")
        if ref is None or other is None or name == ref_name:
            continue
        times = (ref["time_to_target_s"], other["time_to_target_s"])
        ratio = f"{times[1] / times[0]:.2f}x" if None not in times else "-"
        lines.append(f"with the fault, {name} / {ref_name}: time to target {ratio}, last10 loss "
                     f"{other['last10_loss'] / ref['last10_loss']:.3f}, bytes per replica "
                     f"{other['bytes_per_replica'] / ref['bytes_per_replica']:.1f}x")
    return lines


def table(rows: List[Dict]) -> List[str]:
    cols = ["run", "final_loss", "last10_loss", "time_to_target_s", "train_s", "wall_s", "syncs",
            "bytes_per_replica", "failed_attempts", *FAULT_FIELDS]

    def fmt(v):
        return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))

    return (["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows])


def cmd_fault_race(args, model: Dict) -> int:
    """`lbcomm-bench race --fault` (args checked by racecli.check): each local-update run of
    args.runs without and with the fault, per bandwidth; prints the table and the ratios,
    writes the JSON document."""
    import contextlib
    import tempfile

    from . import launch
    from .schema import document, write_json

    opts = dict(replicas=args.world_size, steps=args.steps, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                restart_after=args.restart_after, timeout=args.timeout, seed=args.seed, model=model,
                val_seqs=args.val_seqs, lr=args.lr, warmup=args.warmup, schedule=args.schedule,
                block_size=args.local_block_size)
    runs = []
    for bw in args.bandwidth:
        rows = []
        with tempfile.TemporaryDirectory(prefix="lbcomm_fault_race_") as tmp, contextlib.ExitStack() as stack:
            cluster = None
            if bw:
                cluster = stack.enter_context(launch.cluster_for(args.world_size, bw, args.latency, args.burst,
                                                                 delay=args.delay))
            for r in args.runs:
                method = "1bit" if r["family"] == "onebit_local" else "diloco"
                for fault in (False, True):
                    what = "fault" if fault else "no fault"
                    print(f"# {bw or 'loopback'}: {r['label']}, {what} ...", file=sys.stderr)
                    rows.append(run(opts, method, r["sync_every"], fault, tmp, args.target_loss, cluster=cluster,
                                    name=r["label"]))
        runs.append(dict(bandwidth=bw, target_loss=args.target_loss, rows=rows))
        print(f"\n# {bw or 'loopback'}: {args.world_size} replica groups of one process, {args.steps} inner steps "
              "each; "
              f"target {args.target_loss}; the last replica crashes at step {args.steps // 3} and restarts "
              f"{args.restart_after:g} s later; clock: training time, evaluations left out")
        ref = next((r["label"] for r in args.runs if r["family"] == "onebit_local"), args.runs[0]["label"])
        print("\n".join(table(rows) + summary(rows, ref)))
    if args.json:
        config = {k: opts[k] for k in ("replicas", "steps", "outer_lr", "outer_momentum", "restart_after", "seed",
                                       "model", "val_seqs", "lr", "warmup", "schedule")}
        config.update(block_size=opts["block_size"], exact_numel=ENGINE_DEFAULTS["exact_numel"],
                      latency=args.latency, burst=args.burst,
                      delay=args.delay, crash_at_step=args.steps // 3)
        from .race import _model

        params = sum(p.numel() for p in _model(model).parameters())
        write_json(args.json, document("race-fault", config=config, params=params, runs=runs))
    return 0


def check_fault_doc(doc: Dict) -> None:
    """Raise ValueError naming the first field of `doc` that breaks the race-fault schema."""
    from .schema import _check_fields, check_head

    check_head(doc, "race-fault", {"config", "params", "runs"})
    for i, r in enumerate(doc["runs"]):
        if set(r) != {"bandwidth", "target_loss", "rows"}:
            raise ValueError(f"runs[{i}]: keys {sorted(r)}, expected ['bandwidth', 'rows', 'target_loss']")
        for j, row in enumerate(r["rows"]):
            _check_fields(row, dict(ROW_FIELDS, **(FAULT_ROW_FIELDS if row.get("fault") else {})),
                          f"runs[{i}].rows[{j}]")


def _main(argv: List[str]) -> None:
    with open(argv[0]) as f:
        spec = json.load(f)
    torch.manual_seed(0)  # the same initial weights on every replica
    replica(spec, LMTask(spec))


if __name__ == "__main__":
    _main(sys.argv[1:])
