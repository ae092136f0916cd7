"""`python -m recipe RUN_DIR`: train the run in RUN_DIR (what every job runs)."""

import sys

from recipe.job import main
from store import RunState

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m recipe RUN_DIR")
    state = main(sys.argv[1])
    sys.exit(0 if state == RunState.COMPLETED else 3)
