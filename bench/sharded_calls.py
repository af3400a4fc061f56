"""Kernels on arrays sharded across devices: per shard (core/partitioning.py) against
the whole call on every device, which is what XLA does with a kernel it cannot
partition (its inputs gathered first).

    python bench/sharded_calls.py [--devices 4] [--out results.json]

On a CPU it forces `--devices` host devices and runs the Pallas Triton kernels in
interpret mode (the speed of the interpreter, not a GPU's: what counts is the work and
the collectives each device does); on GPUs it uses the real kernels and every GPU.
Each workload runs in a fresh process per way (Auto mesh axes; the whole-call way
turns the ops' `_partitioning` off), and prints: the median wall time of the jitted
call (5 runs after a warm-up, each to block_until_ready), the all-gathers and
all-reduces in the compiled program, and the largest error against the same call with
the XLA implementations on one device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKLOADS = ("attention fwd+bwd", "rms_norm fwd+bwd", "gated_linear_unit fwd+bwd")


def _measure(workload: str, whole: bool) -> dict:
  """Runs in the child process: one workload, one way."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import stellarax
  from stellarax.ops import pallas_common

  if whole:  # what a kernel gets without a layout: gathered inputs, the whole call
    pallas_common.PallasTritonOp._partitioning = lambda self, arguments: None
  on_gpu = jax.devices()[0].platform == "gpu"
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rows = jax.NamedSharding(mesh, jax.P("data"))
  keys = iter(jax.random.split(jax.random.key(0), 8))
  normal = lambda shape, scale=1.0: scale * jax.random.normal(next(keys), shape)
  loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))

  if workload.startswith("attention"):
    impl = stellarax.PallasTritonAttention(interpret=not on_gpu)
    shape = (2 * n, 1024, 8, 128) if on_gpu else (2 * n, 128, 4, 64)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    args = tuple(normal(shape).astype(dtype) for _ in range(3))
    specs = (rows,) * 3
    f = lambda i: loss(lambda q, k, v: stellarax.dot_product_attention(
        q, k, v, is_causal=True, implementation=i))
  elif workload.startswith("rms_norm"):
    impl = stellarax.PallasTritonLayerNorm(interpret=not on_gpu)
    args = (normal((1024 * n, 1024)), 1 + normal((1024,), 0.1))
    specs = (rows, jax.NamedSharding(mesh, jax.P()))
    f = lambda i: loss(lambda x, s: stellarax.rms_norm(x, s, implementation=i))
  else:
    impl = stellarax.PallasTritonGatedLinearUnit(interpret=not on_gpu)
    args = (normal((256 * n, 256)), normal((256, 2, 256), 0.05))
    specs = (rows, jax.NamedSharding(mesh, jax.P()))
    f = lambda i: loss(lambda x, w: stellarax.gated_linear_unit(x, w, implementation=i))
  grad = jax.jit(jax.grad(f(impl), argnums=tuple(range(len(args)))))
  sharded = [jax.device_put(a, s) for a, s in zip(args, specs)]
  text = grad.lower(*sharded).compile().as_text()
  jax.block_until_ready(grad(*sharded))
  times = []
  for _ in range(5):
    start = time.perf_counter()
    got = jax.block_until_ready(grad(*sharded))
    times.append(time.perf_counter() - start)
  want = jax.jit(jax.grad(f("xla"), argnums=tuple(range(len(args)))))(*args)
  error = max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
              for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  return {"workload": workload, "way": "whole call" if whole else "per shard",
          "devices": n, "platform": jax.devices()[0].platform, "jax": jax.__version__,
          "median_s": statistics.median(times), "all_gathers": text.count("all-gather-start")
          + text.count(" all-gather("), "all_reduces": text.count("all-reduce-start")
          + text.count(" all-reduce("), "max_abs_error": error,
          "shapes": [list(a.shape) for a in args]}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--devices", type=int, default=4, help="host devices on a CPU")
  parser.add_argument("--out", default="", help="write the rows as JSON here")
  parser.add_argument("--child", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    workload, way = args.child.split("|")
    print(json.dumps(_measure(workload, way == "whole")))
    return 0
  flags = os.environ.get("XLA_FLAGS", "")
  env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()}
  rows = []
  for workload in WORKLOADS:
    for way in ("whole", "per shard"):
      proc = subprocess.run([sys.executable, __file__, "--child", f"{workload}|{way}"], env=env,
                            capture_output=True, text=True, check=False)
      if proc.returncode:
        print(proc.stderr[-2000:], file=sys.stderr)
        return proc.returncode
      rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
      r = rows[-1]
      print(f"{r['workload']:28} {r['way']:11} {r['devices']} {r['platform']} "
            f"{r['median_s'] * 1e3:9.1f} ms  all-gathers {r['all_gathers']:2}  "
            f"all-reduces {r['all_reduces']:2}  max error {r['max_abs_error']:.1e}", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
