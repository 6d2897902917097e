"""A wide-area link's fixed delay for the emulated cluster, in user space.

The kernel's netem qdisc is the usual way to delay packets, but many kernels (containers,
minimal cloud images) ship without sch_netem. This needs only a TUN device: in each node's
namespace, every packet the node sends to another node is routed into a TUN device
(``dly0``); a small process reading it holds each packet for the delay and writes it back,
and the kernel forwards it out of the node's shaped veth as if it had just been sent. So
every node's egress is delayed by the one-way delay, before its rate limit, and a round
trip between two nodes takes twice the delay plus the transfer time.

Routing inside the namespace: locally sent packets (``ip rule ... iif lo``) look up a table
whose route to the subnet goes through ``dly0`` with the node's address as source;
packets coming back out of ``dly0`` use the main table (subnet on the veth) and are
forwarded. That needs forwarding on, reverse-path filtering off, and ``accept_local`` on
``dly0`` (the packets carry the node's own source address); the delay process sets these
sysctls itself, since it runs inside the namespace.

The process releases a packet no earlier than its arrival plus the delay (polling at
millisecond resolution), in arrival order. It costs one read and one write per packet of
up to the MTU: about 850 packets per second per direction at 10 Mbit/s, far more at
1 Gbit/s; it is meant for wide-area rates. Standard library only, and run as a script
(``python .../delayline.py --delay-us 50000``), so that it does not import torch.
"""
from __future__ import annotations

import argparse
import collections
import fcntl
import math
import os
import select
import struct
import subprocess
import sys
import time

__all__ = ["DEV", "TABLE", "probe", "start"]

DEV = "dly0"
TABLE = "100"
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_READY = "ready"


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def _sysctl(path: str, value: str) -> None:
    with open(f"/proc/sys/net/ipv4/{path}", "w") as f:
        f.write(value)


def serve(dev: str, delay_us: int) -> None:
    """Create `dev`, configure this namespace's sysctls, say ready, then delay packets
    forever (until killed)."""
    fd = _open_tun(dev)
    _sysctl("ip_forward", "1")
    for conf in os.listdir("/proc/sys/net/ipv4/conf"):  # all, default and every interface (the veth)
        _sysctl(f"conf/{conf}/rp_filter", "0")
    _sysctl(f"conf/{dev}/accept_local", "1")
    print(_READY, flush=True)
    delay = delay_us / 1e6
    queue: collections.deque = collections.deque()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        timeout = None
        if queue:  # rounded up: a packet never leaves early
            timeout = max(0, math.ceil((queue[0][0] - time.monotonic()) * 1e3))
        ready = poller.poll(timeout)
        now = time.monotonic()
        if ready:
            while True:
                try:
                    queue.append((now + delay, os.read(fd, 65536)))
                except BlockingIOError:
                    break
        while queue and queue[0][0] <= now:
            try:
                os.write(fd, queue[0][1])
            except BlockingIOError:
                break  # the kernel's backlog is full: retry at the next wake-up
            queue.popleft()


def probe() -> tuple[bool, str]:
    """``(True, "")`` if this process can create a TUN device (needs /dev/net/tun and
    CAP_NET_ADMIN), else ``(False, why + fix)``. Run in a throwaway namespace by the caller."""
    if not os.path.exists("/dev/net/tun"):
        return False, "no /dev/net/tun for the delay line (`modprobe tun`; in a container, --device /dev/net/tun)"
    try:
        os.close(_open_tun("lbcprobe0"))
    except OSError as exc:
        return False, f"cannot create a TUN device for the delay line ({exc}); it needs CAP_NET_ADMIN"
    return True, ""


def start(ns: str, addr: str, subnet: str, delay_us: int, popen, timeout: float = 30.0):
    """Start the delay line of the node in namespace `ns` (address `addr`; its veth must
    exist already, for the sysctls) and route its traffic to `subnet` through it. `popen(argv, **kwargs)` starts the
    process inside `ns` (the cluster's, so that its teardown kills it). Returns the process."""
    from .netns import NetemError, run

    proc = popen([sys.executable, os.path.abspath(__file__), "--dev", DEV, "--delay-us", str(delay_us)],
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().strip() if ready else ""
    if line != _READY:
        proc.kill()
        err = proc.stderr.read() if proc.poll() is not None else "(no answer)"
        raise NetemError(f"the delay line in {ns} did not start: {line or err.strip()}")
    proc.stdout.close()
    run(["ip", "-n", ns, "link", "set", DEV, "up"])
    run(["ip", "-n", ns, "route", "add", subnet, "dev", DEV, "src", addr, "table", TABLE])
    run(["ip", "-n", ns, "rule", "add", "iif", "lo", "lookup", TABLE, "pref", TABLE])
    return proc


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Hold every packet routed into a TUN device for a fixed delay.")
    p.add_argument("--dev", default=DEV)
    p.add_argument("--delay-us", type=int, default=0)
    p.add_argument("--probe", action="store_true", help="say whether a TUN device can be created, and exit")
    args = p.parse_args(argv)
    if args.probe:
        ok, why = probe()
        print("ok" if ok else why)
        return
    if args.delay_us < 0:
        p.error("--delay-us must be >= 0")
    try:
        serve(args.dev, args.delay_us)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
