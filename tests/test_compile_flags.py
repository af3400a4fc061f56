"""The tests' XLA:CPU compile flags (tests/conftest.py): cheap compiles, the user's
choice kept."""

import os

import conftest  # tests/ is on sys.path


def test_tests_compile_at_level_one_unless_told_otherwise():
  assert "--xla_backend_optimization_level=1" in os.environ["XLA_FLAGS"]
  assert conftest._cheap_cpu_compiles("") == (
      "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true")
  kept = "--xla_force_host_platform_device_count=2"
  assert conftest._cheap_cpu_compiles(kept).startswith(kept + " --xla_backend_optimization_level=1")
  chosen = "--xla_backend_optimization_level=3"
  assert conftest._cheap_cpu_compiles(chosen) == chosen


def test_the_tests_share_one_persistent_compilation_cache():
  import jax
  folder = os.environ["JAX_COMPILATION_CACHE_DIR"]
  assert os.path.basename(folder).startswith("stellarax-test-jax-cache-")
  assert jax.config.jax_compilation_cache_dir == folder
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
