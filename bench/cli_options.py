"""The --*-options flags of the benchmarks: a JSON object of keyword arguments, parsed and
checked when the command line is read (not later, on every rank of every run)."""
from __future__ import annotations

import argparse
import json

__all__ = ["json_options", "optimizer_options", "construct"]

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
    (block_size, exact_numel, ...) go into ``comm``, on top of `comm_defaults`; the
    `lbcomm.OneBitOptions` fields (max_update, capped_decode, ...) into ``options``; the
    param-group options (``OneBitLamb.GROUP_OPTIONS``, the only optimizer with some) into
    ``param_group``, for `construct`; the rest are the optimizer's hyperparameters."""
    import lbcomm
    from lbcomm.config import split_settings

    comm, onebit, rest = split_settings(options)
    grouped = set(lbcomm.OneBitLamb.GROUP_OPTIONS)
    out = {k: v for k, v in rest.items() if k not in grouped}
    group = {k: v for k, v in rest.items() if k in grouped}
    return {**out, "comm": lbcomm.CommConfig(**{**comm_defaults, **comm}),
            **({"options": lbcomm.OneBitOptions(**onebit)} if onebit else {}),
            **({"param_group": group} if group else {})}


def construct(cls, params, param_group=None, **kw):
    """cls(params, **kw) from `optimizer_options`' keyword arguments: its ``param_group``
    options (the class's ``GROUP_OPTIONS``) are set on the one param group; a class without
    them refuses."""
    if not param_group:
        return cls(params, **kw)
    bad = sorted(set(param_group) - set(getattr(cls, "GROUP_OPTIONS", ())))
    if bad:
        raise ValueError(f"{cls.__name__} takes no param-group option {', '.join(bad)}")
    return cls([{"params": list(params), **param_group}], **kw)
