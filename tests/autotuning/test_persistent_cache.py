"""Capture, profiles and measurement with JAX's persistent compilation cache: each test
runs a script in two processes that share a cache folder, the second one loading what
the first compiled. A program loaded from the cache keeps its markers, but XLA:CPU's
events of it carry the program_id it had in the process that compiled it."""

import json
import subprocess
import sys
import textwrap

import pytest

# Each script starts so: argv[1] is the cache folder; every program is cached.
_WITH_A_CACHE = """
import sys, warnings
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import stellarax
"""


def _run_twice(tmp_path, script: str, *args: str) -> tuple[str, str]:
  """Runs `script` (after _WITH_A_CACHE) in two processes that share one cache, with
  argv[2] "first" and "second", then `args`; returns what each printed."""
  cache = tmp_path / "cache"
  out = []
  for run in ("first", "second"):
    proc = subprocess.run([sys.executable, "-c", _WITH_A_CACHE + textwrap.dedent(script),
                           str(cache), run, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out.append(proc.stdout)
  assert any(cache.iterdir())  # the second run could load from the cache
  return out[0], out[1]


def test_markers_survive_a_persistent_cache_hit(tmp_path):
  runs = _run_twice(tmp_path, """
      from stellarax.autotuning.profile import read_op_calls
      lhs = jnp.ones((32, 16)); rhs = jnp.ones((2, 16, 8)); gs = jnp.array([12, 20], jnp.int32)
      f = jax.jit(lambda l, r: jnp.sum(jnp.sin(stellarax.ragged_dot(l, r, gs))))
      with jax.profiler.trace(sys.argv[3] + sys.argv[2]):
        jax.block_until_ready(f(lhs, rhs))
      import json
      print(json.dumps([json.loads(c.marker)["op"]["name"] for c in read_op_calls(sys.argv[3] + sys.argv[2])]))
  """, str(tmp_path / "trace-"))
  assert [json.loads(out.splitlines()[-1]) for out in runs] == [["ragged_dot.xla"]] * 2


_PROFILE_LOADED_PROGRAMS = """
    from stellarax.autotuning.profile import read_op_calls
    if sys.argv[2] == "second":  # other programs first: other ids than the first run's
      for n in range(3):
        jax.jit(lambda x, n=n: x + n)(jnp.ones(3)).block_until_ready()
    step = jax.jit(lambda x: jnp.sum(jnp.sin(stellarax.rms_norm(x, None))))
    inputs = [jnp.ones(shape) for shape in eval(sys.argv[4])]
    for x in inputs:  # compiled (first run) or loaded (second) before the trace
      step(x).block_until_ready()
    with jax.profiler.trace(sys.argv[3] + sys.argv[2]):
      for x in inputs:
        step(x).block_until_ready()
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      try:
        print(sorted(call.count for call in read_op_calls(sys.argv[3] + sys.argv[2])))
      except Exception as e:
        print(type(e).__name__, e)
    print("\\n".join(str(w.message) for w in caught))
"""


@pytest.mark.parametrize("shapes", [[(8, 16)], [(8, 16), (8, 32)]])
def test_a_profile_of_programs_loaded_from_the_cache(tmp_path, shapes):
  # The loaded programs' events carry ids that name no program of the profile, or
  # another one: they are found by module name, where that tells.
  first, second = _run_twice(tmp_path, _PROFILE_LOADED_PROGRAMS, str(tmp_path / "trace-"),
                             repr(shapes))
  counts = str([1] * len(shapes))
  assert first.splitlines()[0] == counts, first  # compiled here: told apart by ids
  if len(shapes) == 1:  # one program of its name: found by it
    assert second.splitlines()[0] == counts, second
  else:  # one function at two shapes: no telling which ran; the error says why
    assert second.startswith("ProfileError"), second
    assert "events were left out" in second and "persistent compilation cache" in second
    assert "jax_enable_compilation_cache" in second, second


def test_profiled_candidates_are_found_by_their_programs_names(tmp_path):
  # Two candidates of one function name: the profile tells them apart by the names
  # measure_candidates compiles them under, not by the ids of the first run.
  runs = _run_twice(tmp_path, """
      from stellarax.autotuning.measure import MeasureOptions, measure_candidates
      if sys.argv[2] == "second":  # other programs first: other ids than the first run's
        for n in range(3):
          jax.jit(lambda y, n=n: y + n)(jnp.ones(3)).block_until_ready()
      fns = {"sin": lambda x: jnp.sin(x) @ x, "cos": lambda x: jnp.cos(x) @ x}
      options = MeasureOptions(profile=True, rounds=2, leader_rounds=0, warmup_s=0.0,
                               max_total_s=0.3, loop_calls=0)
      found = measure_candidates(fns, (jnp.ones((128, 128)),), options=options)
      print(sorted((name, (m.profiled_s or 0) > 0) for name, m in found.items()))
  """)
  assert [out.strip() for out in runs] == ["[('cos', True), ('sin', True)]"] * 2


def test_profiled_programs_are_found_by_their_names(tmp_path):
  # One function at two shapes, each profiled on its own (as check_in_program and a
  # total budget profile a program): found by the names device_time_per_call compiles
  # them under, in the process that loads them from the cache too.
  runs = _run_twice(tmp_path, """
      import json
      from stellarax.autotuning.profile import device_time_per_call
      if sys.argv[2] == "second":  # other programs first: other ids than the first run's
        for n in range(3):
          jax.jit(lambda y, n=n: y + n)(jnp.ones(3)).block_until_ready()
      step = lambda x: jnp.sum(jnp.sin(stellarax.rms_norm(x, None)))
      found = [device_time_per_call(step, jnp.ones(shape)) for shape in [(8, 16), (8, 32)]]
      print([[(json.loads(op)["name"], t > 0) for (op, _), t in times.items()] for times in found])
  """)
  assert [out.strip() for out in runs] == ["[[('layer_norm.xla', True)], [('layer_norm.xla', True)]]"] * 2
