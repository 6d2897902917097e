"""Emulated low-bandwidth cluster on one machine (see docs/cli.md).

Each rank gets its own network namespace with one veth interface; the other ends of the
veths are ports of a Linux bridge that lives in a dedicated namespace, so the host's own
namespace is never touched. Both ends of every veth are shaped with a token bucket
(``tc qdisc add dev IF root tbf rate RATE burst BURST latency LAT``): each rank has
``bandwidth`` upstream and ``bandwidth`` downstream, like a host on a switch port; with a
``delay``, a delay line in each node's namespace (`lbcomm.cli.delayline`: a TUN device
and a small process) holds every packet a node sends for that long before its token bucket.
Addresses come from a private subnet that exists only inside these namespaces.

Ranks are launched as ``ip netns exec NS python ...`` with ``GLOO_SOCKET_IFNAME`` and
``MASTER_ADDR`` pointing at the rank's interface and rank 0's address
(:meth:`EmulatedCluster.env`, :meth:`EmulatedCluster.popen`, :meth:`EmulatedCluster.launch`).
``torch.multiprocessing`` cannot be used: a spawned child stays in its parent's namespace.

Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2 (``ip``, ``tc``). Everything is torn
down when the ``with`` block exits, also on exceptions, Ctrl-C and SIGTERM; names contain the
pid so concurrent runs don't collide, and :func:`cleanup_stale` removes what a killed run
(SIGKILL, power loss) left behind; every new cluster calls it for its prefix first, so the
CLI never accumulates namespaces of dead runs.

Standard library only. The host-side pieces live beside it: `lbcomm.cli.netns` (the ip/tc
runner, `probe`/`require`, `cleanup_stale`), `lbcomm.cli.procs` (supervision of the ranks)
and `lbcomm.cli.units` (rates, sizes, times); this module re-exports their public names.

Example::

    with EmulatedCluster(4, "1gbit") as cluster:
        results = cluster.launch(
            [[sys.executable, "worker.py"] for _ in range(cluster.world_size)], timeout=120
        )
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from . import delayline
from .netns import (DEFAULT_PREFIX, PREFIX_RE, NetemError, available, cleanup_stale, list_netns, netns_pids, probe,
                    require, run)
from .procs import die_with_parent, failure_report, kill_sessions, wait_all
from .units import format_rate, parse_delay, parse_rate, parse_size, parse_time

__all__ = ["EmulatedCluster", "NetemError", "available", "cleanup_stale", "parse_rate", "parse_size", "parse_time",
           "probe", "require"]

logger = logging.getLogger(__name__)

# Lives only inside the namespaces a run creates (each has its own routing table), so it
# cannot clash with the host's networks.
DEFAULT_SUBNET = "10.213.0.0/24"
DEFAULT_MASTER_PORT = 29500

_BRIDGE = "br0"
_IFACE_MAX = 15  # IFNAMSIZ - 1
# Smallest burst that lets a full 1500-byte frame (+ Ethernet header) through the bucket.
MIN_BURST = 1514


def _raise_on_sigterm(signum, frame):
    # Turns SIGTERM into an exception so that ``with`` blocks unwind and tear down.
    raise SystemExit(128 + signum)


class EmulatedCluster:
    r"""A bandwidth-limited cluster of ``world_size`` network namespaces on one machine.

    Args:
        world_size (int): number of ranks (namespaces).
        bandwidth (str, optional): link rate per direction and rank, tc syntax in bits
            (``"1gbit"``, ``"10gbit"``, ``"100mbit"``). (default: ``"1gbit"``)
        latency (str, optional): tbf's ``latency``: the longest a packet may wait in the
            bucket's queue (this bounds the queue; it adds no fixed delay). (default: ``"50ms"``)
        burst (str, optional): tbf's bucket size; kb = 1024 bytes, as in tc. (default: ``"256kb"``)
        delay (str, optional): a fixed one-way delay between two nodes, as on a wide-area
            link (``"50ms"``): each node's delay line holds every packet it sends to another
            node that long, in front of the rate limit (`lbcomm.cli.delayline`); "0" for none.
            (default: ``"0"``)
        subnet (str, optional): IPv4 subnet for the ranks' addresses; it exists only inside
            the run's namespaces. (default: ``"10.213.0.0/24"``)
        prefix (str, optional): start of every namespace name; names are
            ``{prefix}-{pid}-{token}-r{rank}`` and ``...-br`` for the bridge. (default: ``"lbcomm"``)
        master_port (int, optional): ``MASTER_PORT`` given to the ranks; the namespaces are
            fresh, so no other program can hold it. (default: 29500)
        ranks_per_node (int, optional): ranks that share one namespace (an emulated node):
            they talk to each other over its loopback, unshaped, and to other nodes through
            its one shaped veth. ``world_size`` must be a multiple of it; rank r lives on
            node r // ranks_per_node. (default: 1, one namespace per rank)

    Use as a context manager; :meth:`start` / :meth:`close` do the same by hand.

    Example::

        with EmulatedCluster(2, "100mbit") as c:
            c.master_addr   # '10.213.0.1'
            c.ifname(1)     # 'veth1', for GLOO_SOCKET_IFNAME
            c.cmd_prefix(1) # ['ip', 'netns', 'exec', 'lbcomm-<pid>-<token>-r1']
            outs = c.launch([[sys.executable, "train.py"]] * c.world_size, timeout=600)
    """

    def __init__(
        self,
        world_size: int,
        bandwidth: str = "1gbit",
        *,
        latency: str = "50ms",
        burst: str = "256kb",
        delay: str = "0",
        subnet: str = DEFAULT_SUBNET,
        prefix: str = DEFAULT_PREFIX,
        master_port: int = DEFAULT_MASTER_PORT,
        ranks_per_node: int = 1,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"Invalid world_size: {world_size!r}; must be a positive int")
        if not isinstance(prefix, str) or not PREFIX_RE.fullmatch(prefix):
            raise ValueError(
                f"Invalid prefix: {prefix!r}; use 1-24 letters, digits or '_' starting with a letter "
                f"(no '-': it separates the pid in namespace names, see cleanup_stale)"
            )
        if (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1
                or world_size % ranks_per_node):
            raise ValueError(f"Invalid ranks_per_node: {ranks_per_node!r}; must be a positive int that divides "
                             f"world_size {world_size}")
        if not 1 <= master_port <= 65535:
            raise ValueError(f"Invalid master_port: {master_port}")
        self.rate_bits = parse_rate(bandwidth)
        self.latency_us = parse_time(latency)
        self.burst_bytes = parse_size(burst)
        self.delay_us = parse_delay(delay)
        if self.burst_bytes < MIN_BURST:
            raise ValueError(
                f"Invalid burst: {burst!r} = {self.burst_bytes} bytes; must be >= {MIN_BURST} "
                f"bytes so that one full Ethernet frame fits in the bucket"
            )
        try:
            net = ipaddress.IPv4Network(subnet)
        except ValueError as exc:
            raise ValueError(f"Invalid subnet: {subnet!r} ({exc}); e.g. '10.213.0.0/24'") from None
        if not net.is_private:
            raise ValueError(f"Invalid subnet: {subnet!r} is not a private range; e.g. '10.213.0.0/24'")
        n_hosts = net.num_addresses - 2 if net.prefixlen < 31 else net.num_addresses
        if n_hosts < world_size // ranks_per_node:
            raise ValueError(
                f"Invalid subnet: {subnet!r} has {n_hosts} host addresses, world_size {world_size} "
                f"needs one per rank; use a larger subnet"
            )
        if len(f"port{world_size - 1}") > _IFACE_MAX:
            raise ValueError(f"Invalid world_size: {world_size} is too large for interface names")

        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.nodes = world_size // ranks_per_node
        self.bandwidth = format_rate(self.rate_bits)
        self.subnet = net
        self.prefix = prefix
        self.master_port = master_port
        self.run_id = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge_netns = f"{self.run_id}-br"
        first = 1 if net.prefixlen < 31 else 0
        self._addrs = [str(net[first + a]) for a in range(self.nodes)]
        self._created: list[str] = []  # namespaces, in creation order
        self._procs: list[subprocess.Popen] = []
        self._started = False
        self._closed = False
        self._old_sigterm = None

    # -- names ---------------------------------------------------------------------------

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range for world_size {self.world_size}")
        return rank

    def node(self, rank: int) -> int:
        """The node (namespace index) that holds rank."""
        return self._check_rank(rank) // self.ranks_per_node

    def netns(self, rank: int) -> str:
        """Name of rank's network namespace (its node's)."""
        return f"{self.run_id}-r{self.node(rank)}"

    def ifname(self, rank: int) -> str:
        """Rank's interface inside its namespace (what GLOO_SOCKET_IFNAME must name); the
        ranks of one node share it, and their traffic to each other stays on loopback."""
        return f"veth{self.node(rank)}"

    def addr(self, rank: int) -> str:
        """Rank's IPv4 address (its node's)."""
        return self._addrs[self.node(rank)]

    @property
    def master_addr(self) -> str:
        """Rank 0's address, for MASTER_ADDR."""
        return self._addrs[0]

    @property
    def netns_names(self) -> list[str]:
        """All namespaces of this run: the ranks' and the bridge's."""
        return [self.netns(a * self.ranks_per_node) for a in range(self.nodes)] + [self.bridge_netns]

    def cmd_prefix(self, rank: int) -> list[str]:
        """``['ip', 'netns', 'exec', NS]``: prepend to a command to run it as ``rank``."""
        return ["ip", "netns", "exec", self.netns(rank)]

    def env(self, rank: int) -> dict[str, str]:
        """Environment for ``rank``: interface, rendezvous and rank for ``init_method='env://'``."""
        ifname = self.ifname(rank)
        env = {
            "GLOO_SOCKET_IFNAME": ifname,
            "TP_SOCKET_IFNAME": ifname,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
        }
        if self.ranks_per_node > 1:  # torchrun's view of a node: what Topology.from_env reads
            env.update(LOCAL_RANK=str(rank % self.ranks_per_node), LOCAL_WORLD_SIZE=str(self.ranks_per_node))
        return env

    def __repr__(self) -> str:
        return (
            f"EmulatedCluster(world_size={self.world_size}, ranks_per_node={self.ranks_per_node}, "
            f"bandwidth={self.bandwidth!r}, "
            f"latency='{self.latency_us}us', burst={self.burst_bytes}, run_id={self.run_id!r})"
        )

    # -- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # With an exception in flight, teardown errors are logged rather than masking it.
        self._teardown(raise_errors=exc_type is None)

    def start(self) -> EmulatedCluster:
        """Create the namespaces, bridge, veths, addresses and qdiscs."""
        if self._started:
            raise RuntimeError(f"{self.run_id} was already started; create a new EmulatedCluster")
        require(delay=bool(self.delay_us))
        # A run killed before its teardown (SIGKILL, a crashed test) leaves its namespaces;
        # each new cluster removes those of dead runs with its prefix (live runs are kept).
        try:
            cleanup_stale(self.prefix)
        except NetemError as exc:
            logger.warning("netem: could not remove the namespaces of dead runs: %s", exc)
        self._started = True
        self._install_sigterm()
        atexit.register(self._teardown, False)
        t0 = time.perf_counter()
        try:
            self._setup()
        except BaseException:
            self._teardown(raise_errors=False)
            raise
        logger.info(
            "netem: %s up in %.2fs: %d ranks, %s per direction (burst %d B, latency %d us, one-way delay %d us), "
            "subnet %s", self.run_id, time.perf_counter() - t0, self.world_size, self.bandwidth,
            self.burst_bytes, self.latency_us, self.delay_us, self.subnet,
        )
        return self

    def _add_netns(self, ns: str) -> None:
        if ns in list_netns():
            raise RuntimeError(f"network namespace {ns} already exists; remove it with `ip netns del {ns}`")
        run(["ip", "netns", "add", ns])
        self._created.append(ns)
        run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _tbf(self, ns: str, dev: str) -> None:
        """The rate limit of one hop."""
        run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_bits}bit",
             "burst", str(self.burst_bytes), "latency", f"{self.latency_us}us"])

    def _setup(self) -> None:
        br = self.bridge_netns
        self._add_netns(br)
        run(["ip", "-n", br, "link", "add", _BRIDGE, "type", "bridge"])
        run(["ip", "-n", br, "link", "set", _BRIDGE, "up"])
        prefixlen = self.subnet.prefixlen
        for node in range(self.nodes):
            rank = node * self.ranks_per_node
            ns, dev, port = self.netns(rank), self.ifname(rank), f"port{node}"
            self._add_netns(ns)
            # Created inside the bridge's namespace with the peer placed straight into the
            # rank's: no interface ever appears in the host's namespace.
            run(["ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns])
            run(["ip", "-n", br, "link", "set", port, "master", _BRIDGE])
            run(["ip", "-n", ns, "addr", "add", f"{self.addr(rank)}/{prefixlen}", "dev", dev])
            self._tbf(ns, dev)  # rank -> switch
            self._tbf(br, port)  # switch -> rank
            run(["ip", "-n", br, "link", "set", port, "up"])
            run(["ip", "-n", ns, "link", "set", dev, "up"])
            if self.delay_us:
                delayline.start(ns, self.addr(rank), str(self.subnet), self.delay_us,
                                lambda argv, **kw: self.popen(rank, argv, **kw))

    def close(self) -> None:
        """Kill processes left in the namespaces and delete them. Idempotent."""
        self._teardown(raise_errors=True)

    def _teardown(self, raise_errors: bool) -> None:
        if self._closed or not self._started:
            return
        self._closed = True
        atexit.unregister(self._teardown)
        # No Ctrl-C / SIGTERM half-way through the teardown: they are delivered after it.
        blockable = threading.current_thread() is threading.main_thread()
        if blockable:
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        errors = []
        try:
            self._kill_procs()
            # Also names that exist but were not recorded (a signal between `ip netns add`
            # returning and the bookkeeping); ranks first, the bridge last.
            try:
                listed = [ns for ns in list_netns() if ns.startswith(f"{self.run_id}-")]
            except NetemError as exc:
                errors.append(str(exc))
                listed = []
            names = list(dict.fromkeys(list(reversed(self._created)) + listed))
            names.sort(key=lambda ns: ns == self.bridge_netns)
            for ns in names:
                pids = netns_pids(ns)
                if pids:
                    logger.warning("netem: killing processes still in %s: %s", ns, pids)
                    for pid in pids:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                try:
                    run(["ip", "netns", "del", ns])
                except NetemError as exc:
                    errors.append(str(exc))
            self._created.clear()
        finally:
            self._restore_sigterm()
            if blockable:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if errors:
            msg = (
                f"netem: teardown of {self.run_id} incomplete ({'; '.join(errors)}); the next emulated cluster "
                f"with prefix {self.prefix!r} removes what is left once this process has exited (or call "
                f"lbcomm.cli.netem.cleanup_stale({self.prefix!r}))"
            )
            if not raise_errors:
                logger.error("%s", msg)
            else:
                raise RuntimeError(msg)
        else:
            logger.info("netem: %s torn down", self.run_id)

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is None:
            return
        if signal.getsignal(signal.SIGTERM) is _raise_on_sigterm:
            signal.signal(signal.SIGTERM, self._old_sigterm)
        self._old_sigterm = None

    # -- running ranks -------------------------------------------------------------------

    def popen(
        self, rank: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs
    ) -> subprocess.Popen:
        """Start ``argv`` as ``rank``: inside its namespace, with :meth:`env` added to the
        environment (then ``env``). The process gets its own session and is SIGKILLed if this
        process dies; :meth:`close` kills it if it is still running.
        """
        if not self._started or self._closed:
            raise RuntimeError(f"{self.run_id} is not running; use it inside `with EmulatedCluster(...)`")
        full_env = dict(os.environ)
        full_env.update(self.env(rank))
        if env:
            full_env.update(env)
        kwargs.setdefault("start_new_session", True)
        if sys.platform.startswith("linux"):
            kwargs.setdefault("preexec_fn", die_with_parent)
        proc = subprocess.Popen(self.cmd_prefix(rank) + list(argv), env=full_env, **kwargs)
        self._procs.append(proc)
        return proc

    def launch(
        self,
        argv: Sequence[Sequence[str]] | Callable[[int], Sequence[str]],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> list[subprocess.CompletedProcess]:
        """Run one command per rank, wait for all, return their outputs (text).

        ``argv`` is a list with one argv per rank or a function ``rank -> argv``. If a rank
        fails or ``timeout`` (seconds) passes, all ranks are killed and a RuntimeError with the
        failed ranks' stderr is raised; on any exception (Ctrl-C too) no rank is left running.
        """
        argvs = [list(argv(r)) for r in range(self.world_size)] if callable(argv) else [list(a) for a in argv]
        if len(argvs) != self.world_size:
            raise ValueError(f"launch: got {len(argvs)} commands for world_size {self.world_size}")
        procs: list[tuple[subprocess.Popen, object, object]] = []
        try:
            for rank, a in enumerate(argvs):
                out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
                procs.append((self.popen(rank, a, env=env, stdout=out, stderr=err, text=True), out, err))
            waited = wait_all([p for p, _, _ in procs], timeout)
            kill_sessions(p for p, _, _ in procs)
            results = []
            for p, out, err in procs:
                out.seek(0)
                err.seek(0)
                results.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
        finally:
            kill_sessions(p for p, _, _ in procs)
            for _, out, err in procs:
                out.close()
                err.close()
        if not waited.ok:
            shown = waited.failed or range(self.world_size)
            report = failure_report(waited, timeout, [(r, results[r].returncode, results[r].stderr) for r in shown])
            raise RuntimeError(f"{self.run_id}: {report}")
        return results

    def _kill_procs(self) -> None:
        kill_sessions(self._procs)
        self._procs.clear()
