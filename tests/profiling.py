"""Helpers for tests that take a profile with jax.profiler.trace."""

import gc

import jax


def drop_live_programs() -> None:
  """Drops JAX's caches of compiled programs and collects them.

  `jax.profiler.trace` embeds the HLO of every live program in the profile it writes.
  Late in a full test run that is thousands of programs, and each trace took about 14 s
  instead of 0.4 s. Call this before compiling what the profile should hold.
  """
  jax.clear_caches()
  gc.collect()
