"""The --*-options flags of the benchmarks: a JSON object of keyword arguments, parsed and
checked when the command line is read (not later, on every rank of every run)."""
from __future__ import annotations

import argparse
import json

__all__ = ["json_options"]


def json_options(text: str) -> dict:
    """argparse ``type=`` of an options flag: '' -> {}, else a JSON object."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of options is needed, e.g. '{{\"block_size\": 256}}', "
                                         f"not {text!r}")
    return value
