"""lbcomm.ft over torchft: replica groups that leave and join without a restart.

Real processes, real gloo, torchft's real Lighthouse (in-process, on 127.0.0.1): three
replica groups of one rank each train; one crashes mid-run (os._exit) between two
synchronizations or in the middle of a compressed exchange, the survivors go on
in a quorum of two, stay bitwise identical, and keep the error-feedback invariant over the
calls of a fixed membership; the crashed one is restarted, heals from a live peer and is
bitwise the survivors from its first synchronization on.
"""
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

torchft = pytest.importorskip("torchft")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ft_worker.py")
DEADLINE_S = 150


def test_import_lbcomm_does_not_import_torchft():
    code = "import sys, lbcomm, lbcomm.ft; assert 'torchft' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_torchft_names_the_install():
    code = ("import sys; sys.modules['torchft'] = None\n"
            "from lbcomm.ft import require_torchft\n"
            "try:\n    require_torchft()\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True)
    assert "pip install torchft" in out.stdout


@pytest.mark.parametrize("comm", [dict(nonfinite="raise"), dict(topology="flat", process_group=object())])
def test_settings_it_cannot_honour_are_refused(comm):
    """The exchange runs flat over the Manager's group and skips a non-finite round: a
    CommConfig asking for anything else is an error, not silently ignored."""
    import lbcomm
    from lbcomm.ft import FaultTolerantLocalUpdates

    model = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match="leave comm's process_group, topology and nonfinite"):
        FaultTolerantLocalUpdates(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1), 2, manager=None,
                                  pg=None, comm=lbcomm.CommConfig(**comm))


def _different_weights(rank, p):
    import torch.distributed as dist

    from lbcomm.ft import FaultTolerantLocalUpdates

    torch.manual_seed(rank)  # not replicas
    model = torch.nn.Linear(4, 1)
    try:
        FaultTolerantLocalUpdates(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1), 2, manager=None,
                                  pg=None, local_group=dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def _replicas_without_local_group(rank, p):
    from lbcomm.ft import FaultTolerantLocalUpdates

    torch.manual_seed(0)  # replicas, as under DDP
    model = torch.nn.Linear(4, 1)
    try:
        FaultTolerantLocalUpdates(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1), 2, manager=None,
                                  pg=None)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_local_group_of_ranks_with_different_weights_is_refused():
    from dist_util import run_ranks

    assert all("hold different weights" in r for r in run_ranks(_different_weights, 2)), "must refuse"


def test_replicas_in_the_default_group_without_local_group_are_refused():
    """Without local_group every rank would exchange the whole pseudo-gradient over its own
    torchft group, and the replicas of a group would drift apart (seen under torchrun)."""
    from dist_util import run_ranks

    assert all("pass local_group=torch.distributed.group.WORLD" in r
               for r in run_ranks(_replicas_without_local_group, 2)), "must refuse"


def _start(replica, lighthouse, out, *extra, incarnation=0):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    log = open(out + ".log", "w")
    cmd = [sys.executable, WORKER, "--replica", str(replica), "--incarnation", str(incarnation),
           "--lighthouse", lighthouse, "--out", out, *extra]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(procs, deadline, what):
    for p in procs:
        left = deadline - time.monotonic()
        try:
            p.wait(timeout=max(1.0, left))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{what}: a replica did not finish in time") from None


def _stop(procs, lighthouse):
    """Kill what is left of the replicas, then the Lighthouse."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    lighthouse.shutdown()


def _logs(tmp_path):
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(tmp_path.glob("*.log")))


def _check_invariant(runs):
    """Over every run of committed exchanges with one membership whose members all
    recorded it: sum out = sum mean x - mean e_T - concat s_T + mean e_0 + concat s_0."""
    by_step = {}
    for recs in runs:
        for r in recs:
            if "trace" in r:
                by_step.setdefault(r["step"], []).append(r["trace"])
    segments, cur, key = [], [], None
    for step in sorted(by_step):
        traces = by_step[step]
        members = traces[0]["members"]
        complete = len(traces) == len(members)
        if not complete or members != key or any(t["rebuilt"] for t in traces):
            if cur:
                segments.append(cur)
            cur, key = [], members
        if complete:
            cur.append(traces)
    if cur:
        segments.append(cur)
    checked = []
    for seg in segments:
        members = seg[0][0]["members"]
        p = len(members)
        order = {t["span"]: t for t in seg[0]}  # one trace per member, by the chunk it serves
        n = seg[0][0]["x"].numel()
        sum_out = sum(calls[0]["out"].double() for calls in seg)
        sum_mean = sum(torch.stack([t["x"].double() for t in calls]).mean(0) for calls in seg)

        def total(first, e_key, s_key):
            rows = seg[0] if first else seg[-1]
            e = torch.stack([t[e_key].double() for t in rows]).mean(0)
            s = torch.zeros(n, dtype=torch.float64)
            for t in rows:
                lo, hi = t["span"]
                s[lo:hi] = t[s_key][:hi - lo].double()
            return e + s

        assert len(order) == p
        for calls in seg:  # every member decoded the same mean
            assert all(torch.equal(calls[0]["out"], t["out"]) for t in calls)
        lhs = sum_out - sum_mean
        rhs = total(True, "e0", "s0") - total(False, "e1", "s1")
        scale = float(sum_mean.abs().max()) + 1.0
        err = float((lhs - rhs).abs().max())
        assert err <= 1e-5 * scale, f"error-feedback invariant off by {err} over {len(seg)} calls of {p} members"
        checked.append((p, len(seg)))
    return checked


def _restart_and_finish(procs, lighthouse, tmp_path, common, deadline):
    """Restart replica 2 (procs[2] crashed), wait for the survivors and it to finish
    cleanly; the restarted one's output file."""
    reborn = str(tmp_path / "r2b.pt")
    procs.append(_start(2, lighthouse, reborn, *common, incarnation=1))
    _wait([procs[0], procs[1], procs[3]], deadline, "training")
    assert [p.returncode for p in (procs[0], procs[1], procs[3])] == [0, 0, 0], _logs(tmp_path)
    return reborn


@pytest.mark.parametrize("when", ["between_syncs", "mid_sync"])
def test_replica_dies_survivors_go_on_and_a_restart_heals(tmp_path, when):
    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000, quorum_tick_ms=20,
                          heartbeat_timeout_ms=1000)
    procs = []
    deadline = time.monotonic() + DEADLINE_S
    try:
        addr = lh.address()
        h = 5
        die_at = 18 if when == "between_syncs" else 20  # mid_sync: inside the synchronization of step 20
        common = ["--sync-every", str(h), "--count-from", str(die_at)]
        dying = ["--die-at", str(die_at)] + (["--in-sync"] if when == "mid_sync" else [])
        outs = [str(tmp_path / f"r{i}.pt") for i in range(3)]
        procs = [_start(i, addr, outs[i], *common, *(dying if i == 2 else [])) for i in range(3)]
        try:
            rc = procs[2].wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError("the replica meant to crash did not\n" + _logs(tmp_path)) from None
        assert rc == 17, _logs(tmp_path)
        time.sleep(2.0)  # the survivors notice and go on without it
        assert procs[0].poll() is None and procs[1].poll() is None, _logs(tmp_path)
        reborn = _restart_and_finish(procs, addr, tmp_path, common, deadline)
    finally:
        _stop(procs, lh)

    a, b, c = (torch.load(f, weights_only=False) for f in (outs[0], outs[1], reborn))
    # the survivors went on in a quorum of two after the crash
    small = [r for r in a["records"] if r["members"] == 2 and r["inner_steps"] >= die_at]
    assert small, a["records"]
    if when == "mid_sync":  # the exchange of step 20 failed on the survivors and was retried in a quorum of two
        retried = [r for r in a["records"] if r["inner_steps"] == die_at]
        assert retried and retried[0]["attempts"] >= 2 and retried[0]["members"] == 2, a["records"][:6]
        assert a["stats"]["failed"] >= 1 and b["stats"]["failed"] >= 1
    # survivors and the restarted replica end bitwise identical
    ref = a["anchor"].numpy().tobytes()
    assert b["anchor"].numpy().tobytes() == ref and c["anchor"].numpy().tobytes() == ref
    # the restarted one healed at its first committed synchronization, and from then on every
    # replica holds the same model at every committed step
    first = c["records"][0]
    assert first["healed"], c["records"][:2]
    assert any(r["members"] == 3 for r in c["records"]), c["records"]
    assert c["stats"]["heals"] >= 1
    shas = {}
    for recs in (a["records"], b["records"], c["records"]):
        for r in recs:
            shas.setdefault(r["step"], set()).add(r["sha"])
    assert all(len(s) == 1 for s in shas.values()), {k: v for k, v in shas.items() if len(v) > 1}
    assert any(r["step"] == first["step"] for r in a["records"])
    # the error-feedback invariant over fixed memberships: the survivors' run of two
    checked = _check_invariant([a["records"], b["records"], c["records"]])
    assert any(p == 2 and k >= 2 for p, k in checked), checked
    assert any(p == 3 for p, _ in checked), checked
    # it learned
    assert a["loss"] < a["records"][0]["loss"]


@pytest.mark.parametrize("where", ["before_sync", "after_sync"])
def test_a_replica_late_at_a_synchronization_is_waited_for_not_left_out(tmp_path, where):
    """A round's quorum is asked for as the members leave the last synchronization together,
    so a member that reaches the next one, or its next step (a slow evaluation), later than
    the Lighthouse's join timeout still takes part (it was left out and healed when the
    quorum was asked for at the synchronization, or at the round's first step)."""
    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000, quorum_tick_ms=20,
                          heartbeat_timeout_ms=1000)
    procs = []
    deadline = time.monotonic() + DEADLINE_S
    try:
        outs = [str(tmp_path / f"r{i}.pt") for i in range(3)]
        # slow steps, so that all three have joined well before the late one (the first
        # quorums may form without a replica that is still starting)
        common = ["--sync-every", "5", "--max-steps", "115", "--stop-after", "1000", "--step-sleep", "0.1"]
        late = ["--late-at" if where == "before_sync" else "--eval-at", "100", "--late-s", "3"]
        procs = [_start(i, lh.address(), outs[i], *common, *(late if i == 1 else [])) for i in range(3)]
        _wait(procs, deadline, "training")
        assert [p.returncode for p in procs] == [0, 0, 0], _logs(tmp_path)
    finally:
        _stop(procs, lh)
    runs = [torch.load(f, weights_only=False) for f in outs]
    for run in runs:  # all three before the late step, and at it and after it
        late = [r for r in run["records"] if r["inner_steps"] >= 95]
        assert [r["inner_steps"] for r in late] == [95, 100, 105, 110, 115], run["records"]
        assert all(r["members"] == 3 and not r["healed"] for r in late), late
    assert len({run["anchor"].numpy().tobytes() for run in runs}) == 1


@pytest.mark.parametrize("join_timeout_ms", [1000, 60000])
def test_a_restart_that_asks_early_leaves_a_survivor_out_only_under_a_short_join_timeout(tmp_path, join_timeout_ms):
    """A restarted group asks for a quorum at its first step, while the survivors are still
    in their round (here in a 10 s evaluation after a synchronization). The Lighthouse's join
    timeout counts from that request: shorter than the wait, the quorum forms with the first
    survivor to ask and leaves the other out, which heals, loses its round and says so in a
    warning; longer, every survivor takes part in every round."""
    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=join_timeout_ms, quorum_tick_ms=20,
                          heartbeat_timeout_ms=1000)
    procs = []
    deadline = time.monotonic() + DEADLINE_S
    try:
        addr = lh.address()
        common = ["--sync-every", "5", "--max-steps", "60", "--stop-after", "1000", "--step-sleep", "0.05"]
        outs = [str(tmp_path / f"r{i}.pt") for i in range(3)]
        procs = [_start(i, addr, outs[i], *common, "--eval-at", "30", "--late-s", "10") for i in range(2)]
        procs.append(_start(2, addr, outs[2], *common, "--die-at", "18"))
        assert procs[2].wait(timeout=max(1.0, deadline - time.monotonic())) == 17, _logs(tmp_path)
        while "committed inner step 30 " not in open(outs[0] + ".log").read():  # the survivors' evaluation starts
            assert time.monotonic() < deadline and procs[0].poll() is None, _logs(tmp_path)
            time.sleep(0.05)
        reborn = _restart_and_finish(procs, addr, tmp_path, common, deadline)
    finally:
        _stop(procs, lh)
    a, b, c = (torch.load(f, weights_only=False) for f in (outs[0], outs[1], reborn))
    assert c["records"][0]["healed"] and len({r["anchor"].numpy().tobytes() for r in (a, b, c)}) == 1
    after = [r for run in (a, b) for r in run["records"] if r["inner_steps"] > 35]
    survivor_logs = open(outs[0] + ".log").read() + open(outs[1] + ".log").read()
    if join_timeout_ms < 10000:
        assert any(r["healed"] for r in after), after
        assert "after being left out of a round" in survivor_logs, survivor_logs
    else:
        for run in (a, b):
            late = [r for r in run["records"] if r["inner_steps"] > 35]
            assert [r["inner_steps"] for r in late] == list(range(40, 61, 5)), run["records"]
            assert not any(r["healed"] for r in late) and late[-1]["members"] == 3, late
        assert "left out" not in survivor_logs, survivor_logs


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(g, lighthouse, tmp_path, *args, incarnation=0):
    """The two ranks of replica group g (one store, hosted by local rank 0)."""
    port = str(_free_port())
    outs = [str(tmp_path / f"g{g}i{incarnation}l{l}.pt") for l in range(2)]
    return outs, [_start(g, lighthouse, outs[l], "--local-size", "2", "--local-rank", str(l), "--store-port", port,
                         *args, incarnation=incarnation) for l in range(2)]


def test_node_topology_replica_groups_that_start_apart_are_refused(tmp_path):
    """torchft's first quorum heals each rank of a group from its own peer, which is only
    right when every group starts from the same weights: otherwise the ranks of a group end
    up apart, and the first synchronization says so instead of training on."""
    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000, quorum_tick_ms=20,
                          heartbeat_timeout_ms=1000)
    procs = []
    try:
        for g in range(2):
            procs += _group(g, lh.address(), tmp_path, "--distinct-init", "--sync-every", "5")[1]
        _wait(procs, time.monotonic() + DEADLINE_S, "the first synchronization")
    finally:
        _stop(procs, lh)
    logs = _logs(tmp_path)
    assert any(p.returncode != 0 for p in procs), logs
    assert "the ranks of this replica group hold different models" in logs, logs


def test_node_topology_a_slice_that_is_not_finite_skips_the_round_in_every_group(tmp_path):
    """Group 0's Δ is NaN in one coordinate of the last slice only: that slice's exchange
    skips, the other goes through, and every rank of every group still discards the round
    alike and trains on."""
    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000, quorum_tick_ms=20,
                          heartbeat_timeout_ms=1000)
    procs, outs = [], []
    try:
        for g in range(2):
            o, ps = _group(g, lh.address(), tmp_path, "--sync-every", "5", "--max-steps", "25",
                           *(["--nan-at", "10"] if g == 0 else []))
            outs, procs = outs + o, procs + ps
        _wait(procs, time.monotonic() + DEADLINE_S, "training")
        assert [p.returncode for p in procs] == [0] * 4, _logs(tmp_path)
    finally:
        _stop(procs, lh)
    runs = [torch.load(f, weights_only=False) for f in outs]
    assert [r["stats"]["skipped"] for r in runs] == [1] * 4, [r["stats"] for r in runs]
    assert all(torch.equal(r["anchor"], runs[0]["anchor"]) and bool(torch.isfinite(r["anchor"]).all()) for r in runs)
    shas = {}
    for r in runs:
        for rec in r["records"]:
            shas.setdefault(rec["step"], set()).add(rec["sha"])
    assert len(shas) >= 3 and all(len(v) == 1 for v in shas.values()), shas


def test_node_topology_groups_of_two_ranks_lose_one_and_heal_it(tmp_path):
    """Three replica groups of two ranks each (DDP inside a group, `local_group`): every
    rank exchanges its half of the pseudo-gradient with the same rank of the other groups.
    A group crashes between synchronizations and restarts; every rank of every group holds
    the same model at every committed step, and the invariant holds per slice."""
    from torchft.coordination import LighthouseServer

    from lbcomm.topology import slice_spans

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000, quorum_tick_ms=20,
                          heartbeat_timeout_ms=1000)
    procs = []
    deadline = time.monotonic() + 2 * DEADLINE_S
    die_at, common = 18, ["--sync-every", "5", "--count-from", "18"]

    try:
        groups = [_group(g, lh.address(), tmp_path, *common, *(["--die-at", str(die_at)] if g == 2 else []))
                  for g in range(3)]
        procs = [p for _, ps in groups for p in ps]
        for p in groups[2][1]:
            try:
                assert p.wait(timeout=max(1.0, deadline - time.monotonic())) == 17, _logs(tmp_path)
            except subprocess.TimeoutExpired:
                raise AssertionError("the group meant to crash did not\n" + _logs(tmp_path)) from None
        time.sleep(2.0)
        assert all(p.poll() is None for _, ps in groups[:2] for p in ps), _logs(tmp_path)
        reborn = _group(2, lh.address(), tmp_path, *common, incarnation=1)
        procs += reborn[1]
        live = [p for _, ps in groups[:2] for p in ps] + reborn[1]
        _wait(live, deadline, "training")
        assert [p.returncode for p in live] == [0] * 6, _logs(tmp_path)
    finally:
        _stop(procs, lh)

    runs = [[torch.load(f, weights_only=False) for f in outs] for outs in (groups[0][0], groups[1][0], reborn[0])]
    ref = runs[0][0]["anchor"]
    assert all(torch.equal(r["anchor"], ref) for g in runs for r in g)
    shas = {}
    for g in runs:
        for r in g:
            for rec in r["records"]:
                shas.setdefault(rec["step"], set()).add(rec["sha"])
    assert all(len(s) == 1 for s in shas.values()), {k: v for k, v in shas.items() if len(v) > 1}
    assert runs[2][0]["records"][0]["healed"] and runs[2][1]["records"][0]["healed"]
    assert any(rec["members"] == 2 and rec["inner_steps"] >= die_at for rec in runs[0][0]["records"])
    spans = slice_spans(ref.numel(), 2)
    for l in range(2):  # rank l of every group exchanges slice l only, with its own error feedback
        traced = [rec["trace"] for rec in runs[0][l]["records"] if "trace" in rec]
        assert traced and all(t["x"].numel() == spans[l][1] - spans[l][0] for t in traced)
        checked = _check_invariant([g[l]["records"] for g in runs])
        assert any(p == 2 and k >= 2 for p, k in checked) and any(p == 3 for p, _ in checked), checked
    assert runs[0][0]["loss"] < runs[0][0]["records"][0]["loss"]
