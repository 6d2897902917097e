"""Tests for the emulated low-bandwidth cluster (lbcomm/cli/netem.py with netns.py, procs.py
and units.py).

Parsing and error-message tests run anywhere; the rest need root and iproute2 and are
skipped with the reason otherwise.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lbcomm.cli import netem, netns, procs

PREFIX = "lbctest"  # only ever touch namespaces that these tests create

_ok, _why = netem.available()
needs_netns = pytest.mark.skipif(not _ok, reason=f"emulated cluster unavailable: {_why}")
_delay_ok, _delay_why = netns.available(delay=True) if _ok else (False, _why)


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "text, bits",
    [
        ("1gbit", 10**9),
        ("10gbit", 10**10),
        ("100mbit", 10**8),
        ("100Mbit", 10**8),
        ("2.5gbit", 25 * 10**8),
        ("500kbit", 5 * 10**5),
        (" 1gbit/s ", 10**9),
        ("1gibit", 2**30),
        ("64bit", 64),
        (10**9, 10**9),
    ],
)
def test_parse_rate(text, bits):
    assert netem.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["", "gbit", "1", "1g", "1 gigabit", "fast", "-1gbit", "1gbit extra", "0bit"])
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError, match="Invalid bandwidth"):
        netem.parse_rate(text)


def test_parse_rate_rejects_byte_rates_with_hint():
    # tc reads "mbps" as megaBYTES per second; refuse rather than silently shape 8x too wide.
    with pytest.raises(ValueError, match=r"ambiguous.*'500mbit'"):
        netem.parse_rate("500mbps")


def test_parse_rate_types():
    with pytest.raises(TypeError):
        netem.parse_rate(1.5)
    with pytest.raises(TypeError):
        netem.parse_rate(True)


@pytest.mark.parametrize("text, nbytes", [("256kb", 262144), ("1mb", 2**20), ("1514", 1514), ("64k", 65536), ("8kbit", 1024)])
def test_parse_size(text, nbytes):
    assert netem.parse_size(text) == nbytes


@pytest.mark.parametrize("text, usec", [("50ms", 50_000), ("1s", 10**6), ("500us", 500), ("0.5ms", 500), (0.05, 50_000)])
def test_parse_time(text, usec):
    assert netem.parse_time(text) == usec


@pytest.mark.parametrize("fn, text", [(netem.parse_size, "256 apples"), (netem.parse_time, "50 years"), (netem.parse_time, "0ms")])
def test_parse_size_time_reject(fn, text):
    with pytest.raises(ValueError, match="Invalid"):
        fn(text)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=0), "world_size"),
        (dict(world_size=2, bandwidth="1gbps"), "ambiguous"),
        (dict(world_size=2, prefix="bad-prefix"), "prefix"),
        (dict(world_size=2, burst="1kb"), "burst"),
        (dict(world_size=5, subnet="10.9.0.0/30"), "subnet"),
        (dict(world_size=2, subnet="8.8.8.0/24"), "private"),
        (dict(world_size=2, subnet="not-a-net"), "subnet"),
        (dict(world_size=2, delay="50 years"), "time"),
    ],
)
def test_cluster_validates_up_front(kwargs, match):
    with pytest.raises(ValueError, match=match):
        netem.EmulatedCluster(**kwargs)


@pytest.mark.parametrize("text, usec", [("0", 0), ("0ms", 0), (0, 0), ("50ms", 50_000), ("1s", 10**6)])
def test_delay_parses_zero_as_none(text, usec):
    assert netem.EmulatedCluster(2, "10mbit", delay=text).delay_us == usec


def test_names_addresses_and_env():
    c = netem.EmulatedCluster(3, "100mbit", subnet="10.50.0.0/29", prefix=PREFIX)
    assert c.run_id.startswith(f"{PREFIX}-{os.getpid()}-")
    assert c.cmd_prefix(2) == ["ip", "netns", "exec", f"{c.run_id}-r2"]
    assert [c.addr(r) for r in range(3)] == ["10.50.0.1", "10.50.0.2", "10.50.0.3"]
    assert c.master_addr == "10.50.0.1"
    env = c.env(1)
    assert env["GLOO_SOCKET_IFNAME"] == c.ifname(1)
    assert (env["MASTER_ADDR"], env["RANK"], env["WORLD_SIZE"]) == ("10.50.0.1", "1", "3")
    with pytest.raises(IndexError):
        c.addr(3)
    # Two clusters in one process never share names.
    assert netem.EmulatedCluster(3, prefix=PREFIX).run_id != c.run_id


# --------------------------------------------------------------------------- requirements


def test_require_names_root_and_sudo(monkeypatch):
    monkeypatch.setattr(netns.sys, "platform", "linux")
    monkeypatch.setattr(netns.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match=r"root.*sudo"):
        netem.require()
    with pytest.raises(RuntimeError, match="root"):
        netem.EmulatedCluster(2, prefix=PREFIX).start()


def test_require_names_iproute2(monkeypatch):
    monkeypatch.setattr(netns.sys, "platform", "linux")
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/sbin/{tool}")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    with pytest.raises(RuntimeError, match=r"tc not found.*apt-get install iproute2"):
        netem.require()


def test_available_returns_reason():
    ok, why = netem.available()
    assert isinstance(ok, bool) and isinstance(why, str) and why


# --------------------------------------------------------------------------- real namespaces


def _netns_with(run_id):
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(run_id)]


def _host_links():
    out = subprocess.run(["ip", "-o", "link", "show"], check=True, capture_output=True, text=True).stdout
    return sorted(line.split(":")[1].strip() for line in out.splitlines())


def _wait_gone(run_id, timeout=60.0):
    """Namespaces vanish synchronously, their veths a moment later; poll for both."""
    deadline = time.monotonic() + timeout
    while _netns_with(run_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _netns_with(run_id)


_SERVER = r"""
import json, socket, sys, time
s = socket.socket()
s.bind((sys.argv[1], 5001))
s.listen(1)
conn, _ = s.accept()
n, t0 = 0, None
while True:
    b = conn.recv(1 << 20)
    if not b:
        break
    if t0 is None:
        t0 = time.perf_counter()
    n += len(b)
print(json.dumps({"bytes": n, "seconds": time.perf_counter() - t0}))
"""

_CLIENT = r"""
import socket, sys, time
deadline = time.monotonic() + 10
while True:
    try:
        s = socket.create_connection((sys.argv[1], 5001), timeout=10)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)
s.sendall(b"x" * int(sys.argv[2]))
s.close()
"""


@needs_netns
def test_tcp_throughput_is_capped_and_torn_down():
    links_before = _host_links()
    cap = 100e6
    nbytes = 8_000_000  # ~0.65 s at 100 Mbit/s
    with netem.EmulatedCluster(2, "100mbit", prefix=PREFIX) as c:
        assert sorted(_netns_with(c.run_id)) == sorted(c.netns_names)
        assert _host_links() == links_before, "the host's namespace must not change"
        for ns, dev in [(c.netns(0), c.ifname(0)), (c.bridge_netns, "port0")]:
            q = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], check=True,
                               capture_output=True, text=True).stdout
            assert "tbf" in q and "100Mbit" in q, q
        addr = subprocess.run(c.cmd_prefix(1) + ["ip", "-o", "-4", "addr", "show", "dev", c.ifname(1)],
                              check=True, capture_output=True, text=True).stdout
        assert f"{c.addr(1)}/24" in addr
        t0 = time.perf_counter()
        res = c.launch(
            [[sys.executable, "-c", _CLIENT, c.addr(1), str(nbytes)],
             [sys.executable, "-c", _SERVER, c.addr(1)]],
            timeout=15,
        )
        wall = time.perf_counter() - t0
        run_id = c.run_id
    out = json.loads(res[1].stdout)
    assert out["bytes"] == nbytes
    rate = out["bytes"] * 8 / out["seconds"]
    print(f"100mbit link: {rate / 1e6:.1f} Mbit/s measured ({nbytes} bytes in {out['seconds']:.3f} s)")
    assert rate < 1.3 * cap, f"{rate / 1e6:.1f} Mbit/s: the tbf cap of 100 Mbit/s is not applied"
    # no lower bound on the rate: a busy machine can starve the sender (the cap is what is tested)
    assert wall > nbytes * 8 / (1.3 * cap)
    assert _wait_gone(run_id) == []
    assert _host_links() == links_before


_ECHO_SERVER = r"""
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], 5002))
s.listen(1)
conn, _ = s.accept()
for _ in range(5):
    conn.sendall(conn.recv(1))
"""

_ECHO_CLIENT = r"""
import json, socket, sys, time
deadline = time.monotonic() + 10
while True:
    try:
        s = socket.create_connection((sys.argv[1], 5002), timeout=10)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(5):
    t0 = time.perf_counter()
    s.sendall(b"x")
    s.recv(1)
    rtts.append(time.perf_counter() - t0)
print(json.dumps(rtts))
"""


@pytest.mark.skipif(not _delay_ok, reason=f"emulated cluster unavailable: {_delay_why}")
def test_delay_adds_a_wide_area_round_trip():
    """delay="40ms": each node's delay line holds what it sends 40 ms, so a round trip
    between two ranks takes at least 80 ms (a lower bound only: a loaded machine can only
    add to it), and the rate limit stays on the veth."""
    with netem.EmulatedCluster(2, "100mbit", delay="40ms", prefix=PREFIX) as c:
        q = subprocess.run(["tc", "-n", c.netns(0), "qdisc", "show", "dev", c.ifname(0)], check=True,
                           capture_output=True, text=True).stdout
        assert "tbf" in q, q
        rules = subprocess.run(["ip", "-n", c.netns(0), "rule", "show"], check=True, capture_output=True,
                               text=True).stdout
        assert "iif lo lookup 100" in rules, rules
        res = c.launch([[sys.executable, "-c", _ECHO_CLIENT, c.addr(1)],
                        [sys.executable, "-c", _ECHO_SERVER, c.addr(1)]], timeout=30)
    rtts = json.loads(res[0].stdout)
    print(f"round trips with a 40 ms one-way delay: {[round(r * 1e3, 1) for r in rtts]} ms")
    assert min(rtts) >= 0.078, rtts


@needs_netns
def test_teardown_on_exception_kills_ranks():
    c = netem.EmulatedCluster(2, "1gbit", prefix=PREFIX)
    with pytest.raises(ZeroDivisionError):
        with c:
            proc = c.popen(1, [sys.executable, "-c", "import time; time.sleep(60)"])
            assert _netns_with(c.run_id)
            1 / 0
    assert proc.poll() is not None, "rank process left running"
    assert _wait_gone(c.run_id) == []
    c.close()  # idempotent


@needs_netns
def test_launch_reports_failed_rank_and_kills_the_rest():
    with netem.EmulatedCluster(2, "1gbit", prefix=PREFIX) as c:
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[0\] failed[\s\S]*boom"):
            c.launch([[sys.executable, "-c", "raise SystemExit('boom')"],
                      [sys.executable, "-c", "import time; time.sleep(60)"]], timeout=30)
        assert time.perf_counter() - t0 < 10
        with pytest.raises(RuntimeError, match="timed out"):
            c.launch([[sys.executable, "-c", "import time; time.sleep(60)"]] * 2, timeout=0.5)
        assert netns.netns_pids(c.netns(1)) == []
    assert _wait_gone(c.run_id) == []


_HOLDER = r"""
import sys, time
from lbcomm.cli import netem
with netem.EmulatedCluster(2, "1gbit", prefix=sys.argv[1]) as c:
    p = c.popen(0, [sys.executable, "-c", "import time; time.sleep(60)"])
    print(c.run_id, p.pid, flush=True)
    time.sleep(60)
"""


def _kill_and_clean(holder):
    """The holder killed if the test failed before it exited, and its namespaces removed,
    so that a failing test leaves nothing behind."""
    if holder.poll() is None:
        holder.kill()
        holder.wait()
    netns.cleanup_stale(PREFIX)


def _start_holder():
    root = str(Path(__file__).resolve().parents[1])  # this checkout's lbcomm
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    # SIGINT as in a user's terminal, also when this test run itself ignores it (started in
    # the background by a non-interactive shell): the child would inherit SIG_IGN
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, PREFIX],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    line = holder.stdout.readline().split()
    if not line:
        holder.kill()
        pytest.fail(f"holder did not start: {holder.stderr.read()}")
    return holder, line[0], int(line[1])


# SIGTERM becomes SystemExit(143); an uncaught KeyboardInterrupt re-raises SIGINT on exit.
@needs_netns
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_teardown_on_signal(sig, code):
    holder, run_id, rank_pid = _start_holder()
    try:
        assert len(_netns_with(run_id)) == 3
        holder.send_signal(sig)
        assert holder.wait(timeout=300) == code  # generous: `ip netns del` crawls on a loaded machine
        assert _wait_gone(run_id) == []
        assert not procs.pid_alive(rank_pid) or _is_zombie(rank_pid)
    finally:
        _kill_and_clean(holder)


def _is_zombie(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@needs_netns
def test_cleanup_stale_after_sigkill():
    def killed_holder():
        holder, run_id, rank_pid = _start_holder()
        holder.kill()  # no chance to tear down
        holder.wait()
        assert len(_netns_with(run_id)) == 3
        # The rank dies with its launcher (PR_SET_PDEATHSIG), so nothing is left in the namespace.
        deadline = time.monotonic() + 60
        while not (not procs.pid_alive(rank_pid) or _is_zombie(rank_pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not procs.pid_alive(rank_pid) or _is_zombie(rank_pid)
        return run_id

    first = killed_holder()
    # A new cluster with the same prefix removes the dead run's namespaces as it starts.
    with netem.EmulatedCluster(1, prefix=PREFIX) as live:
        assert _wait_gone(first) == []
        second = killed_holder()
        # Our own live run is not stale; the dead holder's is.
        removed = netem.cleanup_stale(PREFIX)
        assert len([ns for ns in removed if ns.startswith(second)]) == 3
        assert not [ns for ns in removed if ns.startswith(live.run_id)]
        assert sorted(_netns_with(live.run_id)) == sorted(live.netns_names)
    assert _wait_gone(second) == []
    assert netem.cleanup_stale(PREFIX) == []


_GLOO_RANK = r"""
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
x = torch.full((1000,), float(dist.get_rank() + 1))
dist.all_reduce(x)
assert torch.equal(x, torch.full_like(x, 3.0)), x[:4]
print(dist.get_rank(), float(x[0]))
dist.destroy_process_group()
"""


@needs_netns
def test_gloo_allreduce_across_namespaces():
    pytest.importorskip("torch")
    with netem.EmulatedCluster(2, "1gbit", prefix=PREFIX) as c:
        res = c.launch([[sys.executable, "-c", _GLOO_RANK]] * 2, timeout=60)
    assert [r.stdout.split() for r in res] == [["0", "3.0"], ["1", "3.0"]]
