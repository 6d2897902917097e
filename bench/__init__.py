"""lbcomm's benchmarks and measurement scripts, run from the repository root as modules,
e.g. ``python -m bench.suite --quick`` (see bench/README.md)."""
