"""Records the TPU trace that tests/data/busy_time/ keeps (run on the TPU machine).

    cd /tmp && python3 <repo>/bench/record_tpu_trace.py --out $OUT

(from /tmp: the repository's .python-version selects a Python that the TPU image's jax
was not built for). It needs jax alone, not stellarax. Two programs run three times
each inside one `jax.profiler.trace` with its default options, as a user records one:
a bf16 product and the same product in a 16-trip loop. It writes
profile.xplane.pb.gz and busy.json: the device, the jax version, and each program's
device time as the trace's own events give it (the summed durations of the device
plane's "XLA Modules" events, which do not overlap), for `busy_time_by_program` to be
checked against on a machine without a TPU.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re
import sys
import tempfile


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  import jax
  import jax.numpy as jnp
  from jax import profiler

  def tpu_fixture_product(a, b):
    return a @ b

  def tpu_fixture_looped(a, b):
    def step(_, x):
      return jnp.tanh(x @ b)
    return jax.lax.fori_loop(0, 16, step, a)

  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (1024, 2048), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(kb, (2048, 2048), jnp.float32).astype(jnp.bfloat16) / 45
  programs = [jax.jit(f).lower(a, b).compile() for f in (tpu_fixture_product, tpu_fixture_looped)]
  for program in programs:
    jax.block_until_ready(program(a, b))
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
      for program in programs:
        for _ in range(3):
          jax.block_until_ready(program(a, b))
    (path,) = pathlib.Path(folder).rglob("*.xplane.pb")
    data = path.read_bytes()
  busy, runs = collections.defaultdict(float), collections.Counter()
  for plane in profiler.ProfileData.from_serialized_xspace(data).planes:
    if not plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      if line.name == "XLA Modules":
        for event in line.events:
          name = re.sub(r"\(\d+\)$", "", event.name)
          busy[name] += event.duration_ns * 1e-9
          runs[name] += 1
  (out / "profile.xplane.pb.gz").write_bytes(gzip.compress(data, mtime=0))
  record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "busy_s": dict(busy), "runs": dict(runs)}
  (out / "busy.json").write_text(json.dumps(record, indent=1) + "\n")
  print(json.dumps(record, indent=1))
  print(f"profile: {len(data)} bytes")
  return 0


if __name__ == "__main__":
  sys.exit(main())
