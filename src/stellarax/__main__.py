"""`python -m stellarax ...`: the `stellarax` command line (`stellarax.tools.cli`)."""

from stellarax.tools.cli import command

if __name__ == "__main__":
  command()
