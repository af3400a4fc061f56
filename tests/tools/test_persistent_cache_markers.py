"""Markers survive a hit in JAX's persistent compilation cache: a second
process that loads the compiled program from the cache still shows the op
calls in its profile."""

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import stellarax
    from stellarax.autotuning.profile import read_op_calls
    lhs = jnp.ones((32, 16)); rhs = jnp.ones((2, 16, 8)); gs = jnp.array([12, 20], jnp.int32)
    f = jax.jit(lambda l, r: jnp.sum(jnp.sin(stellarax.ragged_dot(l, r, gs))))
    with jax.profiler.trace(sys.argv[2]):
      jax.block_until_ready(f(lhs, rhs))
    print(json.dumps([json.loads(c.marker)["op"]["name"] for c in read_op_calls(sys.argv[2])]))
""")


def test_markers_survive_a_persistent_cache_hit(tmp_path):
  cache = tmp_path / "cache"
  runs = []
  for i in range(2):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(cache), str(tmp_path / f"trace{i}")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
  assert any(cache.iterdir())  # the second run could load from the cache
  assert runs[0] == runs[1] == ["ragged_dot.xla"]
