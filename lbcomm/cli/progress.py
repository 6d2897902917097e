"""A progress bar on stderr for rank 0: redrawn in place on a terminal, one plain line per
finished item otherwise (log files, CI), nothing with enabled=False."""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO


class Progress:
    """Call it once per unit of work (e.g. one timed iteration).

    Args:
        total (int): units in the whole run.
        per_item (int): units per item (e.g. iterations per size and method).
        label (callable): item index -> text (e.g. "8M fp32").
        stream (file, optional): where to draw (default: sys.stderr).
        enabled (bool, optional): draw at all (default: True).
    """

    def __init__(self, total: int, per_item: int, label: Callable[[int], str], stream: Optional[TextIO] = None,
                 enabled: bool = True, title: str = ""):
        self.total, self.per_item, self.label = max(1, total), max(1, per_item), label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.title = title
        self.count = 0
        self.start = time.monotonic()
        self._drawn = 0.0

    def __call__(self) -> None:
        if not self.enabled:
            return
        self.count += 1
        item = (self.count - 1) // self.per_item
        done_item = self.count % self.per_item == 0
        if self.tty:
            now = time.monotonic()
            if now - self._drawn >= 0.1 or self.count == self.total:
                self._drawn = now
                width = 30
                fill = int(width * self.count / self.total)
                elapsed = now - self.start
                self.stream.write(f"\r{self.title}[{'#' * fill}{'.' * (width - fill)}] {self.count}/{self.total} "
                                  f"{self.label(item)} {elapsed:5.0f}s \x1b[K")
                self.stream.flush()
        elif done_item:
            items = -(-self.total // self.per_item)
            self.stream.write(f"{self.title}[{item + 1}/{items}] {self.label(item)} done "
                              f"({time.monotonic() - self.start:.0f}s)\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty and self.count:
            self.stream.write("\n")
            self.stream.flush()
