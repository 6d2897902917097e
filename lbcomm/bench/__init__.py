"""Deprecated alias of `lbcomm.cli` (the installed benchmark CLI, renamed so that it is not
confused with the repository's benchmark suite in bench/). Importing it warns once;
``python -m lbcomm.bench`` still runs the CLI."""
import importlib
import sys
import warnings

warnings.warn("lbcomm.bench is deprecated and will be removed: the benchmark CLI moved to lbcomm.cli "
              "(`lbcomm-bench` or `python -m lbcomm.cli`)", FutureWarning, stacklevel=2)

# Modules that moved whole: lbcomm.bench.X is lbcomm.cli.X (cli and model: see their shims).
for _name in ("allreduce", "launch", "netem", "plot", "progress", "soak", "train"):
    sys.modules[f"{__name__}.{_name}"] = globals()[_name] = importlib.import_module(f"lbcomm.cli.{_name}")
del _name
