"""Mosaic GPU interpret mode under the race detector, with races recorded, not raised."""

import dataclasses

from jax.experimental.pallas import mosaic_gpu as plgpu


def race_check_params() -> plgpu.InterpretGPUParams:
  """Interpret params that detect races and record them in `get_races().races_found`.

  jax 0.12 added `on_race`, "raise" by default: the first race then stops the kernel
  with an exception inside a warpgroup's callback. The tests read `races_found` after
  the run (some expect a race there), as jax 0.11.2 always lets them; "warn" keeps that
  behaviour on both versions.
  """
  fields = {field.name for field in dataclasses.fields(plgpu.InterpretGPUParams)}
  record = {"on_race": "warn"} if "on_race" in fields else {}
  return plgpu.InterpretGPUParams(detect_races=True, **record)


RACE_CHECK = race_check_params()
