"""The --*-options flags of the benchmarks: a JSON object of keyword arguments, parsed and
checked when the command line is read (not later, on every rank of every run)."""
from __future__ import annotations

import argparse
import json

__all__ = ["json_options", "optimizer_options"]


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


def optimizer_options(options: dict, **comm_defaults) -> dict:
    """An options dict as lbcomm optimizer keyword arguments: the `lbcomm.CommConfig` fields
    (block_size, exact_numel, max_update, ...) go into ``comm``, on top of `comm_defaults`;
    the rest are the optimizer's hyperparameters."""
    import dataclasses

    import lbcomm

    fields = {f.name for f in dataclasses.fields(lbcomm.CommConfig)}
    comm = {**comm_defaults, **{k: v for k, v in options.items() if k in fields}}
    return {**{k: v for k, v in options.items() if k not in fields}, "comm": lbcomm.CommConfig(**comm)}
