"""Emulated low-bandwidth cluster on one machine (DESIGN.md §5).

Each rank gets its own network namespace with one veth interface; the other ends of the
veths are ports of a Linux bridge that lives in a dedicated namespace, so the host's own
namespace is never touched. Both ends of every veth are shaped with a token bucket
(``tc qdisc add dev IF root tbf rate RATE burst BURST latency LAT``): each rank has
``bandwidth`` upstream and ``bandwidth`` downstream, like a host on a switch port.
Addresses come from a private subnet that exists only inside these namespaces.

Ranks are launched as ``ip netns exec NS python ...`` with ``GLOO_SOCKET_IFNAME`` and
``MASTER_ADDR`` pointing at the rank's interface and rank 0's address
(:meth:`EmulatedCluster.env`, :meth:`EmulatedCluster.popen`, :meth:`EmulatedCluster.launch`).
``torch.multiprocessing`` cannot be used: a spawned child stays in its parent's namespace.

Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2 (``ip``, ``tc``). Everything is torn
down when the ``with`` block exits, also on exceptions, Ctrl-C and SIGTERM; names contain the
pid so concurrent runs don't collide, and :func:`cleanup_stale` removes what a killed run
(SIGKILL, power loss) left behind.

This module imports only the standard library, so it can be used (and tested) on its own.

Example::

    with EmulatedCluster(4, "1gbit") as cluster:
        results = cluster.launch(
            [[sys.executable, "worker.py"] for _ in range(cluster.world_size)], timeout=120
        )
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import ipaddress
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "EmulatedCluster",
    "available",
    "cleanup_stale",
    "parse_rate",
    "parse_size",
    "parse_time",
    "probe",
    "require",
]

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "lbcomm"
# Lives only inside the namespaces a run creates (each has its own routing table), so it
# cannot clash with the host's networks.
DEFAULT_SUBNET = "10.213.0.0/24"
DEFAULT_MASTER_PORT = 29500

_BRIDGE = "br0"
_PREFIX_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,23}")
_IFACE_MAX = 15  # IFNAMSIZ - 1

# tc's own units (tc(8) "PARAMETERS"). Rates in bits per second, SI and IEC prefixes.
_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
}
# Sizes in bytes; tc reads k/kb/m/mb/g/gb as powers of 1024.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kb": 2**10,
    "m": 2**20,
    "mb": 2**20,
    "g": 2**30,
    "gb": 2**30,
    "kbit": 2**10 / 8,
    "mbit": 2**20 / 8,
    "gbit": 2**30 / 8,
}
# Times in microseconds.
_TIME_UNITS = {"us": 1, "usec": 1, "ms": 10**3, "msec": 10**3, "s": 10**6, "sec": 10**6}
_NUMBER_UNIT_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*")

# Smallest burst that lets a full 1500-byte frame (+ Ethernet header) through the bucket.
_MIN_BURST = 1514


# --------------------------------------------------------------------------- parsing


def _split(value: str, what: str, example: str) -> tuple[float, str]:
    if not isinstance(value, str):
        raise TypeError(f"Invalid {what}: expected a string like {example!r}, got {value!r}")
    m = _NUMBER_UNIT_RE.fullmatch(value)
    if m is None:
        raise ValueError(f"Invalid {what}: {value!r}; expected a number and a unit, e.g. {example!r}")
    return float(m.group(1)), m.group(2).lower()


def parse_rate(rate: str | int) -> int:
    """Parse a tc-style rate such as ``"1gbit"``, ``"100mbit"`` or ``"2.5gbit"``.

    Returns bits per second. Units: bit, kbit, mbit, gbit, tbit (powers of 1000) and kibit,
    mibit, gibit, tibit (powers of 1024); a trailing ``/s`` is accepted; an int is bits/s.
    Byte rates (``"mbps"``) are rejected on purpose: tc reads ``500mbps`` as 500 mega*bytes*
    per second (4 Gbit/s) while most people mean megabits.
    """
    if isinstance(rate, bool):
        raise TypeError(f"Invalid bandwidth: {rate!r}")
    if isinstance(rate, int):
        bits = rate
    else:
        number, unit = _split(rate, "bandwidth", "1gbit")
        unit = unit.removesuffix("/s")
        if unit.endswith("bps"):
            raise ValueError(
                f"Invalid bandwidth: {rate!r} is ambiguous: tc reads 'bps' as bytes per second "
                f"({rate!r} = {number * 8:g} {unit[:-3]}bit) while it usually means bits per second; "
                f"write it in bits, e.g. '{number:g}{unit[:-3]}bit'"
            )
        if unit not in _RATE_UNITS:
            raise ValueError(
                f"Invalid bandwidth: {rate!r}; unknown unit {unit!r}, expected one of "
                f"{', '.join(_RATE_UNITS)} (e.g. '1gbit', '100mbit')"
            )
        bits = round(number * _RATE_UNITS[unit])
    if bits < 8:
        raise ValueError(f"Invalid bandwidth: {rate!r}; must be at least 8 bit/s")
    return bits


def parse_size(size: str | int) -> int:
    """Parse a tc-style size such as ``"256kb"`` (kb = 1024 bytes, as in tc). Returns bytes."""
    if isinstance(size, bool):
        raise TypeError(f"Invalid size: {size!r}")
    if isinstance(size, int):
        nbytes = size
    else:
        number, unit = _split(size, "size", "256kb")
        if unit not in _SIZE_UNITS:
            raise ValueError(
                f"Invalid size: {size!r}; unknown unit {unit!r}, expected one of "
                f"b, kb, mb, gb (powers of 1024, as in tc), e.g. '256kb'"
            )
        nbytes = round(number * _SIZE_UNITS[unit])
    if nbytes < 1:
        raise ValueError(f"Invalid size: {size!r}; must be positive")
    return nbytes


def parse_time(duration: str | float) -> int:
    """Parse a tc-style time such as ``"50ms"``, ``"1s"`` or ``"500us"``; a number is seconds.

    Returns microseconds.
    """
    if isinstance(duration, bool):
        raise TypeError(f"Invalid time: {duration!r}")
    if isinstance(duration, (int, float)):
        usec = round(duration * 10**6)
    else:
        number, unit = _split(duration, "time", "50ms")
        if unit not in _TIME_UNITS:
            raise ValueError(
                f"Invalid time: {duration!r}; unknown unit {unit!r}, expected one of "
                f"us, ms, s, e.g. '50ms'"
            )
        usec = round(number * _TIME_UNITS[unit])
    if usec < 1:
        raise ValueError(f"Invalid time: {duration!r}; must be at least 1us")
    return usec


def _format_rate(bits: int) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale and bits % scale == 0:
            return f"{bits // scale}{unit}"
    return f"{bits}bit"


# --------------------------------------------------------------------------- commands


class NetemError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message holds the command and its stderr."""


def _run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    logger.debug("netem: %s", " ".join(args))
    try:
        return subprocess.run(list(args), check=check, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        stderr = (exc.stderr or "").strip() or "(no stderr)"
        raise NetemError(f"`{' '.join(args)}` failed with exit code {exc.returncode}: {stderr}") from None


def _list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = _run(["ip", "netns", "list"]).stdout
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    res = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _missing_requirements() -> str | None:
    """Why the testbed cannot run here (cheap checks only), or None."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (
            f"{' and '.join(missing)} not found on PATH; install iproute2 "
            f"(`apt-get install iproute2`, or `dnf install iproute-tc`)"
        )
    if os.geteuid() != 0:
        return (
            "creating network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); "
            "run as root, e.g. `sudo -E env PATH=$PATH python ...`"
        )
    return None


@functools.lru_cache(maxsize=1)
def probe() -> tuple[bool, str]:
    """Try the real thing once: a namespace with a veth pair shaped by tbf, then remove it.

    Returns ``(ok, reason)``; cached for the life of the process. Catches what the cheap
    checks of :func:`available` cannot: a container without CAP_SYS_ADMIN, a kernel without
    veth or sch_tbf.
    """
    reason = _missing_requirements()
    if reason is not None:
        return False, reason
    # Named like a run's namespace so that cleanup_stale() finds it if we are killed here.
    ns = f"{DEFAULT_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-br"
    try:
        _run(["ip", "netns", "add", ns])
    except NetemError as exc:
        return False, (
            f"cannot create a network namespace ({exc}); in a container run it with "
            f"--privileged (or --cap-add NET_ADMIN --cap-add SYS_ADMIN)"
        )
    try:
        _run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
    except NetemError as exc:
        return False, f"cannot create a veth pair ({exc}); the kernel needs CONFIG_VETH (`modprobe veth`)"
    else:
        try:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", "p0", "root", "tbf",
                  "rate", "1gbit", "burst", "256kb", "latency", "50ms"])
        except NetemError as exc:
            return False, f"cannot add a tbf qdisc ({exc}); the kernel needs sch_tbf (`modprobe sch_tbf`)"
        return True, "network namespaces, veth and tbf work"
    finally:
        _run(["ip", "netns", "del", ns], check=False)


def available() -> tuple[bool, str]:
    """``(True, reason)`` if :class:`EmulatedCluster` can run here, else ``(False, why + fix)``.

    Meant for tests: ``ok, why = available(); pytest.skip(why) if not ok``.
    """
    return probe()


def require() -> None:
    """Raise a RuntimeError that names the problem and the fix unless the testbed can run."""
    reason = _missing_requirements()
    if reason is None:
        ok, reason = probe()
        if ok:
            return
    raise RuntimeError(f"lbcomm emulated cluster unavailable: {reason}")


# --------------------------------------------------------------------------- stale cleanup


def _stale_re(prefix: str) -> re.Pattern:
    return re.compile(rf"{re.escape(prefix)}-(\d+)-[0-9a-f]+-(?:br|r\d+)")


def cleanup_stale(prefix: str = DEFAULT_PREFIX, *, force: bool = False) -> list[str]:
    """Delete namespaces left behind by crashed runs that used ``prefix``.

    A namespace belongs to a crashed run when the pid in its name is no longer alive; with
    ``force=True`` all namespaces with the prefix are removed, also those of live runs.
    Processes still inside a removed namespace are not killed (their pids are logged); the
    namespace disappears once they exit. Returns the names removed.
    """
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"Invalid prefix: {prefix!r}")
    pattern = _stale_re(prefix)
    removed = []
    for ns in _list_netns():
        m = pattern.fullmatch(ns)
        if m is None:
            continue
        pid = int(m.group(1))
        if not force and (pid == os.getpid() or _pid_alive(pid)):
            continue
        pids = _netns_pids(ns)
        if pids:
            logger.warning("netem: stale namespace %s still has processes %s; not killing them", ns, pids)
        _run(["ip", "netns", "del", ns])
        removed.append(ns)
    if removed:
        logger.info("netem: removed %d stale namespaces: %s", len(removed), ", ".join(removed))
    return removed


# --------------------------------------------------------------------------- the cluster


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL the rank if the launcher dies (even by SIGKILL). Linux only."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _raise_on_sigterm(signum, frame):
    # Turns SIGTERM into an exception so that ``with`` blocks unwind and tear down.
    raise SystemExit(128 + signum)


def kill_sessions(procs) -> None:
    """SIGKILL each still-running Popen started in its own session, with its children."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: pgid == pid
            except (ProcessLookupError, PermissionError):
                p.kill()
            p.wait()


class EmulatedCluster:
    r"""A bandwidth-limited cluster of ``world_size`` network namespaces on one machine.

    Args:
        world_size (int): number of ranks (namespaces).
        bandwidth (str, optional): link rate per direction and rank, tc syntax in bits
            (``"1gbit"``, ``"10gbit"``, ``"100mbit"``). (default: ``"1gbit"``)
        latency (str, optional): tbf's ``latency``: the longest a packet may wait in the
            bucket's queue (this bounds the queue; it adds no fixed delay). (default: ``"50ms"``)
        burst (str, optional): tbf's bucket size; kb = 1024 bytes, as in tc. (default: ``"256kb"``)
        subnet (str, optional): IPv4 subnet for the ranks' addresses; it exists only inside
            the run's namespaces. (default: ``"10.213.0.0/24"``)
        prefix (str, optional): start of every namespace name; names are
            ``{prefix}-{pid}-{token}-r{rank}`` and ``...-br`` for the bridge. (default: ``"lbcomm"``)
        master_port (int, optional): ``MASTER_PORT`` given to the ranks; the namespaces are
            fresh, so no other program can hold it. (default: 29500)

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
        subnet: str = DEFAULT_SUBNET,
        prefix: str = DEFAULT_PREFIX,
        master_port: int = DEFAULT_MASTER_PORT,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"Invalid world_size: {world_size!r}; must be a positive int")
        if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(
                f"Invalid prefix: {prefix!r}; use 1-24 letters, digits or '_' starting with a letter "
                f"(no '-': it separates the pid in namespace names, see cleanup_stale)"
            )
        if not 1 <= master_port <= 65535:
            raise ValueError(f"Invalid master_port: {master_port}")
        self.rate_bits = parse_rate(bandwidth)
        self.latency_us = parse_time(latency)
        self.burst_bytes = parse_size(burst)
        if self.burst_bytes < _MIN_BURST:
            raise ValueError(
                f"Invalid burst: {burst!r} = {self.burst_bytes} bytes; must be >= {_MIN_BURST} "
                f"bytes so that one full Ethernet frame fits in the bucket"
            )
        try:
            net = ipaddress.IPv4Network(subnet)
        except ValueError as exc:
            raise ValueError(f"Invalid subnet: {subnet!r} ({exc}); e.g. '10.213.0.0/24'") from None
        if not net.is_private:
            raise ValueError(f"Invalid subnet: {subnet!r} is not a private range; e.g. '10.213.0.0/24'")
        n_hosts = net.num_addresses - 2 if net.prefixlen < 31 else net.num_addresses
        if n_hosts < world_size:
            raise ValueError(
                f"Invalid subnet: {subnet!r} has {n_hosts} host addresses, world_size {world_size} "
                f"needs one per rank; use a larger subnet"
            )
        if len(f"port{world_size - 1}") > _IFACE_MAX:
            raise ValueError(f"Invalid world_size: {world_size} is too large for interface names")

        self.world_size = world_size
        self.bandwidth = _format_rate(self.rate_bits)
        self.subnet = net
        self.prefix = prefix
        self.master_port = master_port
        self.run_id = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge_netns = f"{self.run_id}-br"
        first = 1 if net.prefixlen < 31 else 0
        self._addrs = [str(net[first + r]) for r in range(world_size)]
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

    def netns(self, rank: int) -> str:
        """Name of rank's network namespace."""
        return f"{self.run_id}-r{self._check_rank(rank)}"

    def ifname(self, rank: int) -> str:
        """Rank's interface inside its namespace (what GLOO_SOCKET_IFNAME must name)."""
        return f"veth{self._check_rank(rank)}"

    def addr(self, rank: int) -> str:
        """Rank's IPv4 address."""
        return self._addrs[self._check_rank(rank)]

    @property
    def master_addr(self) -> str:
        """Rank 0's address, for MASTER_ADDR."""
        return self._addrs[0]

    @property
    def netns_names(self) -> list[str]:
        """All namespaces of this run: the ranks' and the bridge's."""
        return [self.netns(r) for r in range(self.world_size)] + [self.bridge_netns]

    def cmd_prefix(self, rank: int) -> list[str]:
        """``['ip', 'netns', 'exec', NS]``: prepend to a command to run it as ``rank``."""
        return ["ip", "netns", "exec", self.netns(rank)]

    def env(self, rank: int) -> dict[str, str]:
        """Environment for ``rank``: interface, rendezvous and rank for ``init_method='env://'``."""
        ifname = self.ifname(rank)
        return {
            "GLOO_SOCKET_IFNAME": ifname,
            "TP_SOCKET_IFNAME": ifname,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
        }

    def __repr__(self) -> str:
        return (
            f"EmulatedCluster(world_size={self.world_size}, bandwidth={self.bandwidth!r}, "
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
        require()
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
            "netem: %s up in %.2fs: %d ranks, %s per direction (burst %d B, latency %d us), subnet %s",
            self.run_id, time.perf_counter() - t0, self.world_size, self.bandwidth,
            self.burst_bytes, self.latency_us, self.subnet,
        )
        return self

    def _add_netns(self, ns: str) -> None:
        if ns in _list_netns():
            raise RuntimeError(f"network namespace {ns} already exists; remove it with `ip netns del {ns}`")
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _tbf(self, ns: str, dev: str) -> None:
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
              "rate", f"{self.rate_bits}bit", "burst", str(self.burst_bytes),
              "latency", f"{self.latency_us}us"])

    def _setup(self) -> None:
        br = self.bridge_netns
        self._add_netns(br)
        _run(["ip", "-n", br, "link", "add", _BRIDGE, "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", _BRIDGE, "up"])
        prefixlen = self.subnet.prefixlen
        for rank in range(self.world_size):
            ns, dev, port = self.netns(rank), self.ifname(rank), f"port{rank}"
            self._add_netns(ns)
            # Created inside the bridge's namespace with the peer placed straight into the
            # rank's: no interface ever appears in the host's namespace.
            _run(["ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns])
            _run(["ip", "-n", br, "link", "set", port, "master", _BRIDGE])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(rank)}/{prefixlen}", "dev", dev])
            self._tbf(ns, dev)  # rank -> switch
            self._tbf(br, port)  # switch -> rank
            _run(["ip", "-n", br, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])

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
                listed = [ns for ns in _list_netns() if ns.startswith(f"{self.run_id}-")]
            except NetemError as exc:
                errors.append(str(exc))
                listed = []
            names = list(dict.fromkeys(list(reversed(self._created)) + listed))
            names.sort(key=lambda ns: ns == self.bridge_netns)
            for ns in names:
                pids = _netns_pids(ns)
                if pids:
                    logger.warning("netem: killing processes still in %s: %s", ns, pids)
                    for pid in pids:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                try:
                    _run(["ip", "netns", "del", ns])
                except NetemError as exc:
                    errors.append(str(exc))
            self._created.clear()
        finally:
            self._restore_sigterm()
            if blockable:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if errors:
            msg = (
                f"netem: teardown of {self.run_id} incomplete ({'; '.join(errors)}); once this "
                f"process has exited, run lbcomm.bench.netem.cleanup_stale({self.prefix!r})"
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
            kwargs.setdefault("preexec_fn", _die_with_parent)
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
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for rank, a in enumerate(argvs):
                out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
                procs.append((self.popen(rank, a, env=env, stdout=out, stderr=err, text=True), out, err))
            while True:
                codes = [p.poll() for p, _, _ in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed or all(c == 0 for c in codes):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            self._kill(p for p, _, _ in procs)
            results = []
            for rank, (p, out, err) in enumerate(procs):
                out.seek(0)
                err.seek(0)
                results.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
        finally:
            self._kill(p for p, _, _ in procs)
            for _, out, err in procs:
                out.close()
                err.close()
        if failed or not all(c == 0 for c in codes):
            what = f"rank(s) {failed} failed" if failed else f"timed out after {timeout}s"
            details = []
            for r in failed or range(self.world_size):
                tail = results[r].stderr.strip()[-2000:] or "(no stderr)"
                details.append(f"--- rank {r} (exit {results[r].returncode}): {tail}")
            raise RuntimeError(f"{self.run_id}: {what}\n" + "\n".join(details))
        return results

    @staticmethod
    def _kill(procs) -> None:
        kill_sessions(procs)

    def _kill_procs(self) -> None:
        self._kill(self._procs)
        self._procs.clear()
