"""`python -m stellarax ...`: the `stellarax` command line (`stellarax.tools.cli`)."""

import sys

from stellarax.tools.cli import main

if __name__ == "__main__":
  sys.exit(main())
