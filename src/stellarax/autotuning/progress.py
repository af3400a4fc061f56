"""A small progress bar counting measured configs, with time left."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
  """Counts configs measured out of a total and prints one updating line.

  Args:
    total: the number of configs expected.
    enabled: False prints nothing.
    stream: where to print (default stderr).
  """

  def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None):
    self.total = max(total, 1)
    self.done = 0
    self.skipped = 0
    self.enabled = enabled
    self.stream = stream or sys.stderr
    self._start = time.monotonic()

  def advance(self, n: int, label: str = "", *, skipped: bool = False) -> None:
    """Records `n` more configs done; `label` names the current op.

    Args:
      n: how many.
      label: the op being tuned.
      skipped: the search passed them over (a budget or a strategy left them out): done,
        but not measured, which the line says.
    """
    self.done = min(self.total, self.done + n)
    self.skipped += n if skipped else 0
    if not self.enabled:
      return
    elapsed = time.monotonic() - self._start
    left = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
    width = 24
    filled = int(width * self.done / self.total)
    bar = "#" * filled + "." * (width - filled)
    eta = f"{left:5.0f}s left" if left == left else "     ?s left"
    passed = f" ({self.skipped} passed over)" if self.skipped else ""
    self.stream.write(f"\rautotune [{bar}] {self.done}/{self.total} configs{passed}, {eta}  "
                      f"{label[:40]:<40}")
    self.stream.flush()

  def close(self) -> None:
    """Ends the line."""
    if self.enabled:
      self.stream.write("\n")
      self.stream.flush()
