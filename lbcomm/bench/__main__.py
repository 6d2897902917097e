"""``python -m lbcomm.bench``: deprecated, runs ``python -m lbcomm.cli``."""
import sys

from ..cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
