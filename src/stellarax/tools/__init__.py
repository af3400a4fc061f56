"""Command-line tools: `stellarax` (cli), the demo, and xplane_to_bound_args."""

from __future__ import annotations

import argparse
import math


def positive_seconds(text: str) -> float:
  """An argparse `type` for a budget in seconds: a finite number > 0.

  Args:
    text: the option's value as typed.

  Returns:
    The number.

  Raises:
    argparse.ArgumentTypeError: for anything else (argparse prints it with the option's
      name and exits with status 2, before any work starts).
  """
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a number of seconds > 0 (e.g. 20 or 0.5)")
  return value
