"""lbcomm-bench's argument types: every value parsed and range-checked as argparse reads
it (sizes, rates and times through `units`), and `UsageError` for what does not fit."""
from __future__ import annotations

import argparse
from typing import Callable, List, Optional

from .units import parse_count, parse_rate, parse_time

__all__ = ["UsageError", "check_onebit", "check_cluster"]


class UsageError(ValueError):
    """Arguments that do not fit together (or this machine); reported before anything runs."""



# ---------------------------------------------------------------------------- value types


def _typed(parse: Callable, *, keep_text: bool = False):
    """An argparse type from a parser of lbcomm.cli.units; keep_text returns the checked text."""

    def convert(text: str):
        try:
            value = parse(text.strip())
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text.strip() if keep_text else value

    return convert


def _int_at_least(low: int):
    def convert(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = low - 1
        if v < low:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text!r}")
        return v

    return convert


def _float_over(low: float, what: str):
    def convert(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = float("nan")
        if not v > low:
            raise argparse.ArgumentTypeError(f"must be a {what} > {low:g}, got {text!r}")
        return v

    return convert


def _momentum(text: str) -> float:
    """A momentum coefficient: a number with 0 <= value < 1."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be a momentum, 0 <= value < 1, got {text!r}")
    return v


def _comma(convert: Callable):
    def convert_all(text: str) -> list:
        items = [s.strip() for s in text.split(",") if s.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return [convert(s) for s in items]

    return convert_all


def _choices(choices, what: str):
    def convert(text: str) -> List[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"invalid {what} {','.join(bad) or text!r}; choose from "
                                             f"{', '.join(choices)}")
        return items

    return convert


def _rate_or_none(text: str) -> Optional[str]:
    return None if text.strip().lower() in ("none", "loopback") else _rate(text)


def _seconds(text: str) -> float:
    """Seconds: a plain number ("50e-6") or a time with a unit ("50us")."""
    try:
        v = float(text)
    except ValueError:
        v = _typed(parse_time)(text) / 1e6
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text!r}")
    return v


_positive = _int_at_least(1)
_sizes = _comma(_typed(parse_count))


def _bytes_per_s(text: str) -> float:
    """Bytes per second: '3TB', '360GB', '3e12' (K, M, G, T = powers of 1000; a trailing B or
    /s optional)."""
    t = text.strip().upper().removesuffix("/S").removesuffix("B")
    scale = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid bandwidth {text!r}: use bytes per second like 3TB or 360GB "
                                         "(powers of 1000)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"invalid bandwidth {text!r}: must be > 0")
    return value
_rate = _typed(parse_rate, keep_text=True)


def check_onebit(block_size: Optional[int], pieces: Optional[int] = None) -> None:
    """lbcomm's own rules for a block size and a piece count (ValueError otherwise), on a
    state of no elements."""
    from ..comm import LoopTransport
    from ..compressed import CompressionState

    CompressionState(0, transport=LoopTransport(2), device="cpu", block_size=block_size, pieces=pieces)


def check_cluster(world: int, bandwidths, latency: str, burst: str, ranks_per_node: int = 1, delay: str = "0") -> None:
    """The emulated cluster's own rules for each bandwidth given (None: loopback, nothing to
    check), as a UsageError; builds the cluster's description only, starts nothing. Shared
    by checks.py and racecli.py (which import nothing of each other)."""
    from .netem import EmulatedCluster

    for bw in bandwidths:
        if bw:
            try:
                EmulatedCluster(world, bw, latency=latency, burst=burst, delay=delay,
                                ranks_per_node=ranks_per_node)  # checks only; starts nothing
            except ValueError as exc:
                raise UsageError(str(exc)) from None


def _block_size(text: str) -> Optional[int]:
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
        check_onebit(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid block size {text!r}: use a positive multiple of 32 (e.g. 2048) "
                                         "or 'none' (one scale per chunk)") from None
    return value
