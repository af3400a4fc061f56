"""Finding the op calls of a program: from a callable, a jax.stages.Traced or Lowered,
or JSON.

Every op call leaves a marker (see `stellarax.core.markers`) in the lowered
program; capture lowers the program and reads the markers back from its text. A
kernel's call on arrays split over Auto mesh axes is split only when XLA compiles the
program: then capture compiles it, and takes the per-device calls the partitioner
recorded (`partitioning.per_device_calls`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from stellarax.core import markers
from stellarax.core import partitioning
from stellarax.core import specs
from stellarax.core.bound_args import BoundArguments
from stellarax.core.resolution import miss_policy_scope


def program_of_arrays(f: Callable[..., Any], args: tuple,
                      kwargs: Mapping[str, Any]) -> tuple[Callable[[list], Any], list]:
  """`f(*args, **kwargs)` as a function of the arrays among its arguments alone.

  The other leaves of the arguments (strings, Python and NumPy scalars, None, ...) are
  closed over as constants, so that `jax.jit` of the program takes whatever `f` does,
  e.g. a mode string that a plain function branches on (`jax.jit(f)` would try to trace
  it), or `np.int64(16)` for a static argument of a jitted `f` (traced, it raised JAX's
  "Non-hashable static arguments"). A scalar `f` computes with is the same constant.

  Args:
    f: the callable.
    args, kwargs: its arguments; arrays (JAX, NumPy) or `jax.ShapeDtypeStruct`s are
      the program's inputs.

  Returns:
    (program, arrays): `program(arrays)` calls `f` with the arguments rebuilt and
    returns the list of its outputs' array leaves (a string or other value among them
    cannot be an output of a jitted program; the ops' outputs are arrays).
  """
  arrays, rebuild = specs.split_arrays(
      (tuple(args), dict(kwargs)),
      lambda x: isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)))

  def program(new_arrays):
    a, k = rebuild(new_arrays)
    return [x for x in jax.tree.leaves(f(*a, **k))
            if isinstance(x, (jax.Array, np.ndarray, np.generic))]  # float0 gradients too

  program.__name__ = getattr(f, "__name__", "program")
  return program, arrays


def _lowered(f: Any, args: tuple, kwargs: dict) -> jax.stages.Lowered:
  if isinstance(f, (jax.stages.Lowered, jax.stages.Traced)):
    if args or kwargs:
      raise TypeError(f"A jax.stages.{type(f).__name__} takes no arguments: it was traced "
                      "with its own.")
    return f if isinstance(f, jax.stages.Lowered) else f.lower()
  if isinstance(f, jax.stages.Compiled):
    raise TypeError("A jax.stages.Compiled is past the StableHLO that op calls are found "
                    "in: pass the function, or its .trace(...) or .lower(...) before "
                    ".compile().")
  if not callable(f):
    raise TypeError(f"Expected a callable, a jax.stages.Traced or Lowered, got "
                    f"{type(f).__name__}: {f!r}.")
  program, arrays = program_of_arrays(f, args, kwargs)
  # Capture only reads which ops run: no tuning on the spot while tracing.
  with miss_policy_scope("heuristics"):
    return jax.jit(program).lower(arrays)


def bound_args_from_text(text: str, per_device: Mapping[str, BoundArguments] | None = None
                         ) -> list[BoundArguments]:
  """The unique bound arguments of the markers in a lowered program's text.

  Args:
    text: the program's text.
    per_device: marker -> the calls one device runs at its sites instead, for calls XLA
      partitions when the program is compiled (`partitioning.per_device_calls`).
  """
  seen: dict[BoundArguments, None] = {}
  for marker in dict.fromkeys(markers.find_markers(text)):
    local = (per_device or {}).get(marker)
    for ba in local or (BoundArguments.from_json(json.loads(marker)),):
      seen[ba] = None
  return list(seen)


def get_bound_args(f: Callable[..., Any] | jax.stages.Traced | jax.stages.Lowered, /, *args,
                   **kwargs) -> list[BoundArguments]:
  """Returns the unique `BoundArguments` of every stellarax op in `f`.

  Args:
    f: a callable (plain, jitted, or a closure taking no arguments, e.g.
      `jax.grad(loss)` bound with `functools.partial`), or a `jax.stages.Traced` or
      `jax.stages.Lowered` (`jax.jit(f).trace(x)`, `.lower(x)`).
    *args, **kwargs: the arguments to lower `f` with (arrays or
      `jax.ShapeDtypeStruct`s).

  Returns:
    One `BoundArguments` per unique op call, forward and VJP ops alike, in
    program order. A kernel's call on arrays split across devices is the call each
    device runs (with Auto mesh axes, `f` is compiled to find it).

  Raises:
    TypeError: when `f` is neither callable nor traced or lowered (a `Compiled` holds
      no program text), or is traced or lowered and also given arguments.
  """
  lowered = _lowered(f, args, kwargs)
  text = lowered.as_text()
  # Kernels on arrays split over Auto mesh axes: what each device runs is known once
  # XLA partitions the program, so it is compiled for that.
  per_device = None
  if partitioning.PARTITIONED_CALL in text:
    with miss_policy_scope("heuristics"):
      per_device = partitioning.per_device_calls(lowered, text)
  return bound_args_from_text(text, per_device)


def bound_args_to_json(bound_args: Iterable[BoundArguments], path: str | os.PathLike | None = None) -> str:
  """Serialises bound arguments (a JSON list); writes it to `path` if given.

  Args:
    bound_args: BoundArguments (e.g. from `get_bound_args` or `SomeOp.bind`).
    path: a file to write the text to, or None.

  Returns:
    The JSON text.

  Raises:
    TypeError: for an item that is not a BoundArguments (a single BoundArguments
      must be given in a list).
  """
  if isinstance(bound_args, BoundArguments):
    raise TypeError("bound_args_to_json takes a sequence of BoundArguments; got one: pass [ba].")
  bound_args = list(bound_args)
  for i, ba in enumerate(bound_args):
    if not isinstance(ba, BoundArguments):
      raise TypeError(f"bound_args_to_json: item {i} is a {type(ba).__name__} ({ba!r:.80}), not a "
                      "BoundArguments (from get_bound_args or SomeOp.bind).")
  text = json.dumps([ba.to_json() for ba in bound_args], indent=1, sort_keys=True) + "\n"
  if path is not None:
    Path(path).write_text(text, encoding="utf-8")
  return text


def bound_args_from_json(path_or_json: str | os.PathLike) -> list[BoundArguments]:
  """Reads bound arguments from a path or a JSON string.

  Accepts the output of `bound_args_to_json` (a list) and of
  `xplane_to_bound_args` (an object whose "calls" hold a "bound_args" field
  each, with counts and times).

  Args:
    path_or_json: a file's path, or the JSON text itself.

  Returns:
    The calls, in the order they are listed, each a `BoundArguments` of its op.

  Raises:
    FileNotFoundError: for a path that does not exist.
    ValueError: for text that is not such JSON, naming the source.
  """
  return calls_and_weights_from_json(path_or_json)[0]


def call_weights_from_json(path_or_json: str | os.PathLike) -> dict[BoundArguments, float]:
  """The device time of each call in `xplane_to_bound_args` output: what it cost in the
  profiled run, so what its tuning is worth.

  Args:
    path_or_json: as for `bound_args_from_json`.

  Returns:
    call (without config) -> seconds of device time in the profile, summed over the
    records of one call; empty for JSON without times (`bound_args_to_json`'s list).

  Raises:
    As `bound_args_from_json`; also ValueError for a "device_time_s" that is not a
    number >= 0.
  """
  return calls_and_weights_from_json(path_or_json)[1]


def calls_and_weights_from_json(path_or_json: str | os.PathLike
                                ) -> tuple[list[BoundArguments], dict[BoundArguments, float]]:
  """`bound_args_from_json` and `call_weights_from_json` from one read of the file, so that
  both describe the same contents.

  Args:
    path_or_json: as for `bound_args_from_json`.

  Returns:
    (calls, weights): what each of the two functions returns.

  Raises:
    As `call_weights_from_json`.
  """
  records = _records(path_or_json)
  weights: dict[BoundArguments, float] = {}
  for ba, seconds in records:
    if seconds is not None:
      ba = ba.with_config(None)
      weights[ba] = weights.get(ba, 0.0) + seconds
  return [ba for ba, _ in records], weights


def _records(path_or_json: str | os.PathLike) -> list[tuple[BoundArguments, float | None]]:
  """(bound arguments, device_time_s or None) per item of bound-argument JSON."""
  text, source = _read_text(path_or_json)
  try:
    data = json.loads(text)
  except (json.JSONDecodeError, RecursionError) as e:
    raise ValueError(f"{source}: not valid JSON ({type(e).__name__}: {e}).") from None
  if isinstance(data, dict) and "calls" in data:  # xplane_to_bound_args output
    if not isinstance(data["calls"], list):
      raise ValueError(f"{source}: its 'calls' must be a JSON list of op calls (as "
                       f"xplane_to_bound_args writes), got {_json_type(data['calls'])}.")
    data = data["calls"]
  if not isinstance(data, list):
    what = ("an autotuning result (it has 'entries'), which is applied, not tuned: "
            "`with stellarax.AutotuningResult.load(path):` in Python, `stellarax report` "
            "or `stellarax cache add` on the command line"
            if isinstance(data, dict) and "entries" in data else _json_type(data))
    raise ValueError(f"{source}: expected a JSON list of bound arguments (from "
                     f"bound_args_to_json or xplane_to_bound_args), got {what}.")
  out = []
  for i, item in enumerate(data):
    seconds = None
    if isinstance(item, dict) and "bound_args" in item:
      seconds = item.get("device_time_s")
      if seconds is not None and not (isinstance(seconds, (int, float))
                                      and not isinstance(seconds, bool)
                                      and math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{source}: item {i}: device_time_s={seconds!r} must be a finite "
                         "number of seconds >= 0 (xplane_to_bound_args writes one per call).")
      item = item["bound_args"]
    try:
      out.append((BoundArguments.from_json(item), None if seconds is None else float(seconds)))
    except Exception as e:  # noqa: BLE001 (whatever the op's checks raise, the item is bad)
      if isinstance(e, KeyError) and e.args:  # its str() quotes the message again
        why = e.args[0]
      elif isinstance(e, (KeyError, ValueError)):
        why = str(e)
      else:
        why = f"{type(e).__name__}: {e}"
      raise ValueError(f"{source}: item {i}: {why}") from None
  return out


def _json_type(value: Any) -> str:
  """What a parsed JSON value is, in JSON's words: "a JSON object", "null", ..."""
  names = {dict: "a JSON object", list: "a JSON list", str: "a JSON string",
           bool: "a JSON boolean", int: "a JSON number", float: "a JSON number"}
  return "null" if value is None else names.get(type(value), type(value).__name__)


def _read_text(path_or_json: str | os.PathLike) -> tuple[str, str]:
  """(the JSON text, what to name in errors) of a path or a JSON string."""
  if not isinstance(path_or_json, (str, os.PathLike)):
    raise TypeError(f"Expected a path or a JSON string, got {type(path_or_json).__name__}.")
  if isinstance(path_or_json, str) and path_or_json.lstrip().startswith(("[", "{")):
    return path_or_json, "<json string>"
  source = os.fspath(path_or_json)
  try:
    return Path(path_or_json).read_text(encoding="utf-8"), source
  except UnicodeDecodeError as exc:
    raise ValueError(f"{source}: not a text file (byte {exc.start} is not UTF-8); expected "
                     "JSON of bound arguments (from bound_args_to_json or "
                     "xplane_to_bound_args).") from None


def unique(bound_args: Sequence[BoundArguments]) -> list[BoundArguments]:
  """Drops duplicates, keeping the first occurrence's order."""
  return list(dict.fromkeys(bound_args))


