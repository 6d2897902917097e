"""Process supervision for lbcomm-bench: start ranks that die with their launcher, wait
for a group of them (the one wait loop), kill a group with its children, and say what
went wrong. Standard library only (the emulated cluster imports it)."""
from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import List, NamedTuple, Optional, Sequence, Tuple

__all__ = ["die_with_parent", "kill_sessions", "pid_alive", "wait_all", "Waited", "failure_report"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: SIGKILL the child if the launcher dies (even by SIGKILL). Linux only."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_sessions(procs) -> None:
    """SIGKILL each still-running Popen started in its own session, with its children."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: pgid == pid
            except (ProcessLookupError, PermissionError):
                p.kill()
            p.wait()


class Waited(NamedTuple):
    """What `wait_all` saw: every exit code (None: still running) and the failed indices."""

    codes: List[Optional[int]]
    failed: List[int]

    @property
    def ok(self) -> bool:
        return all(c == 0 for c in self.codes)


def wait_all(procs: Sequence, timeout: Optional[float] = None, interval: float = 0.02) -> Waited:
    """Poll `procs` (anything with ``poll() -> exit code or None``) until all exited with 0,
    one exited otherwise, or `timeout` seconds passed. Kills nothing."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed or all(c == 0 for c in codes) or (deadline is not None and time.monotonic() > deadline):
            return Waited(codes, failed)
        time.sleep(interval)


def failure_report(waited: Waited, timeout: Optional[float], outputs: Sequence[Tuple[int, object, str]]) -> str:
    """"rank(s) [1] failed" or "timed out after T s", then each (rank, exit code, output)'s tail."""
    what = f"rank(s) {waited.failed} failed" if waited.failed else f"timed out after {timeout:g} s"
    details = [f"--- rank {r} (exit {code}):\n{text.strip()[-3000:] or '(no output)'}" for r, code, text in outputs]
    return "\n".join([what, *details])
