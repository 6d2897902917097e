"""Units of lbcomm-bench's arguments, parsed in one place: tensor sizes (fp32 elements or
bytes), tc-style link rates, byte sizes and times.

Every parser reads a number and a unit with `_number_unit` and scales it by a table of
units; they differ only in their tables and in the checks of the result. Standard library
only (the emulated cluster imports it).
"""
from __future__ import annotations

import re

__all__ = ["parse_count", "parse_params", "parse_rate", "parse_size", "parse_time", "format_count", "format_rate"]

# Tensor sizes, case-insensitive: unit -> (multiplier, counts bytes). K, M, G are powers of
# 1024 for elements and bytes alike; a B suffix means bytes (4 per fp32 element).
_COUNT_UNITS = {"": (1, False), "k": (2**10, False), "m": (2**20, False), "g": (2**30, False),
                "b": (1, True), "kb": (2**10, True), "kib": (2**10, True), "mb": (2**20, True),
                "mib": (2**20, True), "gb": (2**30, True), "gib": (2**30, True)}
# Parameter counts, case-insensitive: powers of 1000, as model sizes are quoted (340M, 1.3B).
_PARAM_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
# tc's own units (tc(8) "PARAMETERS"). Rates in bits per second, SI and IEC prefixes.
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
               "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40}
# Sizes in bytes; tc reads k/kb/m/mb/g/gb as powers of 1024.
_SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "m": 2**20, "mb": 2**20, "g": 2**30, "gb": 2**30,
               "kbit": 2**10 / 8, "mbit": 2**20 / 8, "gbit": 2**30 / 8}
# Times in microseconds.
_TIME_UNITS = {"us": 1, "usec": 1, "ms": 10**3, "msec": 10**3, "s": 10**6, "sec": 10**6}

_NUMBER_UNIT_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*")


def _number_unit(value, what: str, example: str, typical: str) -> tuple:
    """(number, lower-case unit) of a string like "2.5gbit"; ValueError/TypeError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise TypeError(f"Invalid {what}: expected a string like {example!r}, got {value!r}")
    m = _NUMBER_UNIT_RE.fullmatch(value)
    if m is None:
        raise ValueError(f"Invalid {what}: {value!r}; {typical}")
    return float(m.group(1)), m.group(2).lower()


def _scaled(value, what: str, table: dict, example: str, choices: str, unit_hook=None) -> float:
    """number * table[unit] of a string like "2.5gbit"; `unit_hook(number, unit)` may rewrite
    or refuse the unit first."""
    number, unit = _number_unit(value, what, example, f"expected a number and a unit, e.g. {example!r}")
    if unit_hook is not None:
        unit = unit_hook(value, number, unit)
    if unit not in table:
        raise ValueError(f"Invalid {what}: {value!r}; unknown unit {unit!r}, expected one of {choices}")
    return number * table[unit]


def parse_count(text: str) -> int:
    """fp32 elements from "4096", "4K", "8M", "1.5M" (elements) or "32MB", "32MiB", "4096B" (bytes)."""
    typical = "use elements like '4K', '8M' or bytes like '32MB'"
    try:
        number, unit = _number_unit(text, "size", "8M", typical)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    if unit not in _COUNT_UNITS:
        raise ValueError(f"Invalid size: {text!r}; {typical}")
    scale, in_bytes = _COUNT_UNITS[unit]
    value = number * scale
    if in_bytes:
        if value % 4:
            raise ValueError(f"Invalid size: {text!r} is not a whole number of fp32 elements (4 bytes each)")
        value /= 4
    if value != int(value) or value < 1:
        raise ValueError(f"Invalid size: {text!r}; must be a positive whole number of elements")
    return int(value)


def parse_params(text: str) -> int:
    """A parameter count: "125000000", "125M", "1.3B" (K, M, B = powers of 1000)."""
    value = round(_scaled(text, "parameter count", _PARAM_UNITS, "350M", "K, M, B (powers of 1000), e.g. '350M'"))
    if value < 1:
        raise ValueError(f"Invalid parameter count: {text!r}; must be at least 1")
    return value


def _rate_unit(rate, number: float, unit: str) -> str:
    unit = unit.removesuffix("/s")
    if unit.endswith("bps"):
        raise ValueError(
            f"Invalid bandwidth: {rate!r} is ambiguous: tc reads 'bps' as bytes per second "
            f"({rate!r} = {number * 8:g} {unit[:-3]}bit) while it usually means bits per second; "
            f"write it in bits, e.g. '{number:g}{unit[:-3]}bit'"
        )
    return unit


def parse_rate(rate) -> int:
    """Parse a tc-style rate such as ``"1gbit"``, ``"100mbit"`` or ``"2.5gbit"``.

    Returns bits per second. Units: bit, kbit, mbit, gbit, tbit (powers of 1000) and kibit,
    mibit, gibit, tibit (powers of 1024); a trailing ``/s`` is accepted; an int is bits/s.
    Byte rates (``"mbps"``) are rejected on purpose: tc reads ``500mbps`` as 500 mega*bytes*
    per second (4 Gbit/s) while most people mean megabits.
    """
    if isinstance(rate, int) and not isinstance(rate, bool):
        bits = rate
    else:
        bits = round(_scaled(rate, "bandwidth", _RATE_UNITS, "1gbit",
                             f"{', '.join(_RATE_UNITS)} (e.g. '1gbit', '100mbit')", _rate_unit))
    if bits < 8:
        raise ValueError(f"Invalid bandwidth: {rate!r}; must be at least 8 bit/s")
    return bits


def parse_size(size) -> int:
    """Parse a tc-style size such as ``"256kb"`` (kb = 1024 bytes, as in tc). Returns bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        nbytes = size
    else:
        nbytes = round(_scaled(size, "size", _SIZE_UNITS, "256kb",
                               "b, kb, mb, gb (powers of 1024, as in tc), e.g. '256kb'"))
    if nbytes < 1:
        raise ValueError(f"Invalid size: {size!r}; must be positive")
    return nbytes


def parse_time(duration) -> int:
    """Parse a tc-style time such as ``"50ms"``, ``"1s"`` or ``"500us"``; a number is seconds.

    Returns microseconds.
    """
    if isinstance(duration, (int, float)) and not isinstance(duration, bool):
        usec = round(duration * 10**6)
    else:
        usec = round(_scaled(duration, "time", _TIME_UNITS, "50ms", "us, ms, s, e.g. '50ms'"))
    if usec < 1:
        raise ValueError(f"Invalid time: {duration!r}; must be at least 1us")
    return usec


def parse_delay(duration) -> int:
    """A link delay: like `parse_time`, but zero ("0", "0ms", 0) means none. Microseconds."""
    if re.fullmatch(r"\s*0*\.?0*\s*(us|ms|s)?\s*", str(duration)):
        return 0
    return parse_time(duration)


def format_rate(bits: int) -> str:
    """bits/s in tc's syntax: 1000000000 -> "1gbit"."""
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale and bits % scale == 0:
            return f"{bits // scale}{unit}"
    return f"{bits}bit"


def format_count(n: int) -> str:
    """Elements the way parse_count reads them: 8388608 -> "8M"."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)
