"""Network namespaces on this host: the ``ip``/``tc`` command runner, whether the emulated
cluster can run here (cheap checks, then one real probe), and the cleanup of namespaces that
killed runs left behind. Standard library only."""
from __future__ import annotations

import functools
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Sequence

from .procs import pid_alive

__all__ = ["NetemError", "run", "list_netns", "netns_pids", "missing_requirements", "probe", "available", "require",
           "cleanup_stale", "DEFAULT_PREFIX", "PREFIX_RE"]

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "lbcomm"
PREFIX_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,23}")


class NetemError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message holds the command and its stderr."""


def run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    logger.debug("netem: %s", " ".join(args))
    try:
        return subprocess.run(list(args), check=check, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        stderr = (exc.stderr or "").strip() or "(no stderr)"
        raise NetemError(f"`{' '.join(args)}` failed with exit code {exc.returncode}: {stderr}") from None


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = run(["ip", "netns", "list"]).stdout
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(ns: str) -> list[int]:
    res = run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def missing_requirements() -> str | None:
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


@functools.lru_cache(maxsize=2)
def probe(delay: bool = False) -> tuple[bool, str]:
    """Try the real thing once: a namespace with a veth pair shaped by tbf (and, with
    `delay`, a TUN device for the delay line), then remove it.

    Returns ``(ok, reason)``; cached for the life of the process. Catches what the cheap
    checks of :func:`available` cannot: a container without CAP_SYS_ADMIN, a kernel without
    veth or sch_tbf.
    """
    reason = missing_requirements()
    if reason is not None:
        return False, reason
    # Named like a run's namespace so that cleanup_stale() finds it if we are killed here.
    ns = f"{DEFAULT_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-br"
    try:
        run(["ip", "netns", "add", ns])
    except NetemError as exc:
        return False, (
            f"cannot create a network namespace ({exc}); in a container run it with "
            f"--privileged (or --cap-add NET_ADMIN --cap-add SYS_ADMIN)"
        )
    try:
        run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
    except NetemError as exc:
        return False, f"cannot create a veth pair ({exc}); the kernel needs CONFIG_VETH (`modprobe veth`)"
    else:
        try:
            run(["tc", "-n", ns, "qdisc", "add", "dev", "p0", "root", "tbf",
                  "rate", "1gbit", "burst", "256kb", "latency", "50ms"])
        except NetemError as exc:
            return False, f"cannot add a tbf qdisc ({exc}); the kernel needs sch_tbf (`modprobe sch_tbf`)"
        if delay:
            script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delayline.py")
            res = run(["ip", "netns", "exec", ns, sys.executable, script, "--probe"], check=False)
            if res.stdout.strip() != "ok":
                return False, res.stdout.strip() or f"the delay line's probe failed: {res.stderr.strip()[-300:]}"
        return True, "network namespaces, veth and tbf work" + (" (a TUN device too)" if delay else "")
    finally:
        run(["ip", "netns", "del", ns], check=False)


def available(delay: bool = False) -> tuple[bool, str]:
    """``(True, reason)`` if :class:`EmulatedCluster` can run here (with a `delay`: a TUN
    device too), else ``(False, why + fix)``.

    Meant for tests: ``ok, why = available(); pytest.skip(why) if not ok``.
    """
    return probe(delay)


def require(delay: bool = False) -> None:
    """Raise a RuntimeError that names the problem and the fix unless the testbed can run."""
    reason = missing_requirements()
    if reason is None:
        ok, reason = probe(delay)
        if ok:
            return
    raise RuntimeError(f"lbcomm emulated cluster unavailable: {reason}")


def stale_re(prefix: str) -> re.Pattern:
    return re.compile(rf"{re.escape(prefix)}-(\d+)-[0-9a-f]+-(?:br|r\d+)")


def cleanup_stale(prefix: str = DEFAULT_PREFIX, *, force: bool = False) -> list[str]:
    """Delete namespaces left behind by crashed runs that used ``prefix``.

    A namespace belongs to a crashed run when the pid in its name is no longer alive; with
    ``force=True`` all namespaces with the prefix are removed, also those of live runs.
    Processes still inside a removed namespace are not killed (their pids are logged); the
    namespace disappears once they exit. Returns the names removed.
    """
    if not PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"Invalid prefix: {prefix!r}")
    pattern = stale_re(prefix)
    removed = []
    for ns in list_netns():
        m = pattern.fullmatch(ns)
        if m is None:
            continue
        pid = int(m.group(1))
        if not force and (pid == os.getpid() or pid_alive(pid)):
            continue
        pids = netns_pids(ns)
        if pids:
            logger.warning("netem: stale namespace %s still has processes %s; not killing them", ns, pids)
        run(["ip", "netns", "del", ns])
        removed.append(ns)
    if removed:
        logger.info("netem: removed %d stale namespaces: %s", len(removed), ", ".join(removed))
    return removed
