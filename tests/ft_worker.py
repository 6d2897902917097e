"""One replica group (one process) of the torchft tests (tests/test_ft.py): a small
regression model trained with `lbcomm.ft.FaultTolerantLocalUpdates` against a Lighthouse.

It leaves with os._exit at inner step --die-at (a crash between synchronizations) or, with
--in-sync, inside the synchronization of inner step --die-at: in the middle of the compressed
exchange, after the membership all-gather, while its peers wait on it. Otherwise it stops at the first
synchronization after which it has seen --stop-after committed synchronizations of
--full members (the survivors count from their first smaller quorum after inner step
--count-from), so that every
member stops at the same synchronization. Its records (per committed synchronization: the
Manager's step, the members, a hash of the model, the exchange's trace) go to --out.

With --local-size G the replica group has G ranks (--local-rank, the group's store on
--store-port, hosted by local rank 0): DDP inside the group over a gloo group of its own,
and the node topology (``local_group``) between the groups.
"""
import argparse
import hashlib
import os
import sys
import time
from datetime import timedelta

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--incarnation", type=int, default=0)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--sync-every", type=int, default=5)
    ap.add_argument("--die-at", type=int, default=0)
    ap.add_argument("--in-sync", action="store_true")
    ap.add_argument("--full", type=int, default=3)
    ap.add_argument("--stop-after", type=int, default=3)
    ap.add_argument("--count-from", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--compress", type=int, default=1)
    ap.add_argument("--step-sleep", type=float, default=0.03)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local-size", type=int, default=1)
    ap.add_argument("--local-rank", type=int, default=0)
    ap.add_argument("--store-port", type=int, default=0)
    ap.add_argument("--distinct-init", action="store_true", help="groups of several ranks start apart (a misuse)")
    ap.add_argument("--nan-at", type=int, default=0, help="this group's last weight is NaN after inner step N")
    ap.add_argument("--late-at", type=int, default=0, help="sleep --late-s before the step() of inner step N")
    ap.add_argument("--late-s", type=float, default=0.0)
    ap.add_argument("--eval-at", type=int, default=0, help="sleep --late-s after the synchronization of inner "
                    "step N (an evaluation that this replica's host runs slowly)")
    a = ap.parse_args()

    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    from lbcomm import CommConfig
    from lbcomm.ft import FaultTolerantLocalUpdates

    torch.set_num_threads(1)  # three replicas share the cores
    first = a.local_rank == 0
    store = dist.TCPStore("127.0.0.1", a.store_port, world_size=a.local_size, is_master=first,
                          wait_for_workers=False, timeout=timedelta(seconds=60))
    local_group = None
    if a.local_size > 1:
        dist.init_process_group("gloo", store=dist.PrefixStore("local", store), rank=a.local_rank,
                                world_size=a.local_size)
        local_group = dist.group.WORLD
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    manager = Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=2, use_async_quorum=False,
                      replica_id=f"replica_{a.replica}", lighthouse_addr=a.lighthouse, rank=a.local_rank,
                      world_size=a.local_size,
                      store_addr="127.0.0.1", store_port=store.port, hostname="127.0.0.1",
                      timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=60),
                      connect_timeout=timedelta(seconds=10))
    # A restarted replica starts elsewhere: it must heal. Groups of several ranks start alike, as
    # torchft's first quorum assumes when it heals each rank from another peer.
    torch.manual_seed(100 + 10 * a.replica * (a.local_size == 1 or a.distinct_init) + a.incarnation)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    params = list(model.parameters())
    if local_group is not None:  # data parallelism inside the replica group
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=local_group)
    inner = torch.optim.AdamW(params, lr=3e-3)
    local = FaultTolerantLocalUpdates(params, inner, a.sync_every, manager=manager, pg=pg,
                                      compress=bool(a.compress), comm=CommConfig(block_size=256, exact_numel=100),
                                      trace=True, local_group=local_group)
    if a.die_at and a.in_sync:  # the first all-to-all of the compressed call at that synchronization
        from lbcomm.comm.torchft import TorchFTTransport

        all_to_all = TorchFTTransport.all_to_all

        def dying_all_to_all(self, *args, **kwargs):
            if local.inner_steps >= a.die_at:
                os._exit(17)
            return all_to_all(self, *args, **kwargs)

        TorchFTTransport.all_to_all = dying_all_to_all
    teacher = torch.Generator().manual_seed(7)
    w_true = torch.randn(16, 1, generator=teacher)
    data = torch.Generator().manual_seed(1000 + 10 * a.replica + a.incarnation + 100 * a.local_rank)
    records, seen_small, full_after, loss = [], a.incarnation > 0, 0, float("nan")
    while local.inner_steps < a.max_steps:
        x = torch.randn(32, 16, generator=data)
        y = torch.tanh(x @ w_true)
        loss = torch.nn.functional.mse_loss(model(x), y)
        inner.zero_grad()
        loss.backward()
        inner.step()
        if a.nan_at and local.inner_steps + 1 == a.nan_at:
            with torch.no_grad():
                params[-1].view(-1)[-1] = float("nan")  # in the last slice only
        if a.die_at and not a.in_sync and local.inner_steps + 1 == a.die_at:
            os._exit(17)  # a crash: no goodbye to anyone
        if a.late_at and local.inner_steps + 1 == a.late_at:
            time.sleep(a.late_s)  # a host that slows this replica down just before a synchronization
        if local.step():
            info = local.last_sync
            anchor = local.anchor.detach().clone()
            rec = {"step": manager.current_step(), "inner_steps": local.inner_steps, "members": info["members"],
                   "healed": info["healed"], "attempts": info["attempts"], "rebuilt": info["rebuilt"],
                   "sha": hashlib.sha256(anchor.numpy().tobytes()).hexdigest(), "loss": float(loss)}
            tr = local.last_trace
            if tr is not None and "out" in tr:
                rec["trace"] = {k: tr[k] for k in ("x", "out", "e0", "e1", "s0", "s1", "span", "members", "rebuilt")}
                local.last_trace = None
            records.append(rec)
            print(f"committed inner step {local.inner_steps} with {info['members']} members", flush=True)
            if info["members"] < a.full and local.inner_steps >= a.count_from:
                seen_small = True
            elif seen_small:
                full_after += 1
            if full_after >= a.stop_after:
                break
            if local.inner_steps == a.eval_at:
                time.sleep(a.late_s)
        time.sleep(a.step_sleep)
    if local_group is not None:  # rank 0 hosts the group's Manager server: the others' last answer comes through it
        dist.monitored_barrier(local_group, timeout=timedelta(seconds=60))
    torch.save({"records": records, "anchor": local.anchor.detach().clone(), "uid": local.uid,
                "stats": local.stats(), "loss": float(loss)}, a.out)
    manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)  # the Manager's threads need no orderly teardown


if __name__ == "__main__":
    main()
