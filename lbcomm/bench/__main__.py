"""``python -m lbcomm.bench`` and the ``lbcomm-bench`` console script; see lbcomm/bench/cli.py."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
