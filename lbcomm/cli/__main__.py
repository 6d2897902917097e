"""``python -m lbcomm.cli`` and the ``lbcomm-bench`` console script; see lbcomm/cli/commands.py."""
import sys

from .commands import main

if __name__ == "__main__":
    sys.exit(main())
