"""The bookkeeping every reduction state shares with its calls: one call at a time (the
busy flag) and the call counters (`calls`, `skipped`, `last_skipped`)."""
from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["CallBook"]


class CallBook:
    """Mixed into a state class that sets ``CALL`` (what its calls are, for the message)
    and the attributes ``_busy``, ``calls``, ``skipped`` and ``last_skipped``."""

    CALL = "call"

    def ensure_idle(self) -> None:
        """Raise a RuntimeError while a call on this state is in flight."""
        if self._busy:
            raise RuntimeError(f"a {self.CALL} on this {type(self).__name__} is still in flight; wait for its "
                               "future before starting another call or touching its state")

    _ensure_idle = ensure_idle  # the 0.2 name

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Mark the state busy for the body of a call (`ensure_idle` then refuses others)."""
        self.ensure_idle()
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    def count(self, skipped: bool) -> None:
        """Count a finished call (skipped: for non-finite values)."""
        self.calls += 1
        self.last_skipped = skipped
        self.skipped += int(skipped)
