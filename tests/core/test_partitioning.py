"""Ops on arrays sharded across devices (core/partitioning.py).

The multi-device checks run in a subprocess with four CPU devices (this file, run as a
script, once per kind of mesh axis): the kernels in interpret mode, each result compared
with the XLA implementation on the same inputs unsharded, its shardings read back, and
the compiled program searched for the gathers that a kernel run whole on every device
needs. The rest runs here, on one device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellarax
from stellarax.core import partitioning
from stellarax.core import resolution
from stellarax.core import registry

_DEVICES = 4


# --- a user's op that opts in ---------------------------------------------------------


@stellarax.config_dataclass
class _Config:
  unroll: int = 1


_SEEN: list[tuple[str, tuple[int, ...]]] = []  # (op, x's shape) of every traced call
_CONFIGS: list[tuple[tuple[int, ...], int]] = []  # (x's shape, unroll) of forward calls


class _Tunable:
  config_cls = _Config

  def _get_heuristics_config(self, ba):
    return _Config()

  def _partitioning(self, arguments):
    return self._array_layout(arguments)

  def _check_supported(self, arguments):
    # A kernel with a minimum: fewer than 4 rows per call, and the call is not taken.
    if arguments["x"].shape[0] < 4:
      raise NotImplementedError(f"{arguments['x'].shape[0]} rows; the kernel needs 4")


class ScaleRowsVjpBase(stellarax.Op):
  def _fwd(self, residuals, out, dout, x, params, *, config):
    raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleRowsVjp(_Tunable, ScaleRowsVjpBase, name="test_partitioning.scale_rows_vjp"):
  def _fwd(self, residuals, out, dout, x, params, *, config):
    _SEEN.append((self.name, tuple(x.shape)))
    return {"x": dout * params["w"][None], "params": {"w": (dout * residuals["x"]).sum(0)}}

  def _array_layout(self, arguments):
    # d w sums over the rows: split, each device adds its part.
    return stellarax.ShardingLayout(
        {"x": "r c", "params": {"w": "c"}, "residuals": {"x": "r c"}, "out": "r c", "dout": "r c"},
        {"x": "r c", "params": {"w": "c"}}, frozenset({"r"}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleRows(_Tunable, stellarax.Op, name="test_partitioning.scale_rows"):
  """x * w (w along the columns): a kernel-like op with pytree arguments and residuals."""

  vjp_cls = ScaleRowsVjp

  def _fwd(self, x, params, *, config):
    _SEEN.append((self.name, tuple(x.shape)))
    _CONFIGS.append((tuple(x.shape), config.unroll))
    return x * params["w"][None], {"x": x}

  def _get_autotuning_configs(self, ba):
    return {_Config(unroll=1), _Config(unroll=2)}

  def _reference(self, x, params):
    return x * params["w"][None]

  def _array_layout(self, arguments):
    return stellarax.ShardingLayout({"x": "r c", "params": {"w": "c"}}, ("r c", {"x": "r c"}),
                                    frozenset({"r"}))


# --- the subprocess -------------------------------------------------------------------


def _cases():
  """name -> (ours, XLA's, inputs, their PartitionSpecs)."""
  P = jax.sharding.PartitionSpec
  keys = iter(jax.random.split(jax.random.key(0), 64))
  normal = lambda shape, scale=1.0: scale * jax.random.normal(next(keys), shape)
  grad = lambda f, n: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=tuple(range(n)))
  cases = {}

  def attention(impl, **kw):
    return lambda q, k, v, *bias: stellarax.dot_product_attention(
        q, k, v, *bias, is_causal=True, implementation=impl, **kw)

  triton = stellarax.PallasTritonAttention(interpret=True)
  q, k, v = (normal((4, 64, 4, 64)) for _ in range(3))
  cases["attention batch"] = (attention(triton), attention("xla"), (q, k, v), [P("data")] * 3)
  cases["attention heads"] = (attention(triton), attention("xla"), (q, k, v),
                              [P(None, None, "data")] * 3)
  cases["attention grad batch"] = (grad(attention(triton), 3), grad(attention("xla"), 3),
                                   (q, k, v), [P("data")] * 3)
  # GQA: 8 query heads on 4 key heads; splitting the key heads splits both alike.
  gqa = (normal((4, 64, 8, 64)), normal((4, 64, 4, 64)), normal((4, 64, 4, 64)))
  cases["attention gqa grad heads"] = (grad(attention(triton), 3), grad(attention("xla"), 3),
                                       gqa, [P(None, None, "data")] * 3)
  # A bias broadcast over the batch: its gradient sums over the split batch.
  bias = normal((1, 4, 64, 64), 0.5)
  cases["attention grad bias"] = (grad(attention(triton), 4), grad(attention("xla"), 4),
                                  (q, k, v, bias), [P("data")] * 3 + [P()])

  def rms(impl):
    return lambda x, s: stellarax.rms_norm(x, s, implementation=impl)

  norm = stellarax.PallasTritonLayerNorm(interpret=True)

  def glu(impl):
    return lambda x, w: stellarax.gated_linear_unit(x, w, implementation=impl)

  glu_triton = stellarax.PallasTritonGatedLinearUnit(interpret=True)
  x, w = normal((64, 32)), normal((32, 2, 64), 0.2)
  cases["glu grad rows"] = (grad(glu(glu_triton), 2), grad(glu("xla"), 2), (x, w),
                            [P("data"), P()])
  cases["glu grad columns"] = (grad(glu(glu_triton), 2), grad(glu("xla"), 2), (x, w),
                               [P(), P(None, None, "data")])
  xs = normal((4, 16, 32))
  cases["glu vmap"] = (jax.vmap(glu(glu_triton), in_axes=(0, None)),
                       jax.vmap(glu("xla"), in_axes=(0, None)), (xs, w), [P("data"), P()])

  cases["rms_norm grad rows"] = (grad(rms(norm), 2), grad(rms("xla"), 2),
                                 (x, 1 + normal((32,), 0.2)), [P("data"), P()])
  # Gradients leave split like their arguments: a bias kept whole while the heads split,
  # a norm's scale kept whole while x's columns split (gathered for the kernel).
  cases["attention grad heads bias"] = (grad(attention(triton), 4), grad(attention("xla"), 4),
                                        (q, k, v, normal((1, 4, 64, 64), 0.5)),
                                        [P(None, None, "data")] * 3 + [P()])
  cases["rms_norm grad columns"] = (grad(rms(norm), 2), grad(rms("xla"), 2),
                                    (x, 1 + normal((32,), 0.2)), [P(None, "data"), P()])

  def ragged(impl):
    return lambda l, r, gs: stellarax.ragged_dot(l, r, gs, implementation=impl)

  def ragged_grad(impl):
    return lambda l, r, gs: grad(lambda a, b: ragged(impl)(a, b, gs), 2)(l, r)

  ragged_triton = stellarax.PallasTritonRaggedDot(interpret=True)
  sizes = jnp.array([20, 0, 30], jnp.int32)  # an empty group; 14 rows in none
  cases["ragged_dot grad columns"] = (ragged_grad(ragged_triton), ragged_grad("xla"),
                                      (x, normal((3, 32, 64), 0.2), sizes),
                                      [P(), P(None, None, "data"), P()])

  # XLA's own: jax.lax.ragged_dot refuses rows split over Explicit axes, and the GLU's
  # gradient a contraction over them; per shard (Explicit) or as XLA does (Auto).
  lhs, rhs = normal((64, 32)), normal((3, 32, 64), 0.2)
  cases["xla ragged_dot rows"] = (ragged("xla"), ragged("xla"), (lhs, rhs, sizes),
                                  [P("data"), P(), P()])
  cases["xla glu grad rows"] = (grad(glu("xla"), 2), grad(glu("xla"), 2), (x, w),
                                [P("data"), P()])
  # Split as plain JAX keeps them (Auto) or per shard (Explicit), checked against plain
  # JAX: the GLU's weights split on N, and ragged_dot's rows.
  def plain_glu(x, w):
    dot = lambda w: jnp.dot(x, w, preferred_element_type=jnp.float32)
    return (jax.nn.silu(dot(w[:, 0])) * dot(w[:, 1])).astype(x.dtype)

  plain_ragged = lambda l, r, gs: jax.lax.ragged_dot(l, r, gs)
  cases["xla glu columns"] = (glu("xla"), plain_glu, (x, w), [P(), P(None, None, "data")])
  cases["xla glu grad columns"] = (grad(glu("xla"), 2), grad(plain_glu, 2), (x, w),
                                   [P(), P(None, None, "data")])
  cases["xla ragged_dot grad rows"] = (ragged_grad("xla"),
                                       lambda l, r, gs: grad(lambda a, b: plain_ragged(a, b, gs), 2)(l, r),
                                       (lhs, rhs, sizes), [P("data"), P(), P()])
  # XLA's attention and norms return no residuals where the kernels do (their layouts
  # say so: `ShardingLayout.without_residuals`).
  cases["xla attention grad batch"] = (grad(attention("xla"), 3), grad(attention("xla"), 3),
                                       (q, k, v), [P("data")] * 3)
  cases["xla chunked attention heads"] = (attention("xla_chunked"), attention("xla_chunked"),
                                          (q, k, v), [P(None, None, "data")] * 3)
  layer = lambda impl: lambda x, s, o: stellarax.layer_norm(x, s, o, implementation=impl)
  cases["xla layer_norm grad rows"] = (grad(layer("xla"), 3), grad(layer("xla"), 3),
                                       (x, 1 + normal((32,), 0.2), normal((32,))),
                                       [P("data"), P(), P()])
  cases["xla rms_norm rows"] = (rms("xla"), rms("xla"), (x, 1 + normal((32,), 0.2)),
                                [P("data"), P()])

  params = {"w": normal((32,))}
  user = lambda x, p: ScaleRows()(x, p)
  plain = lambda x, p: x * p["w"][None]
  cases["user op grad rows"] = (grad(user, 2), grad(plain, 2), (x, params), [P("data"), P()])
  # 8 rows: 2 per device, fewer than the op takes: every device runs the whole call.
  cases["user op too few rows"] = (user, plain, (x[:8], params), [P("data"), P()])
  return cases


def _checked_shard_map(mesh, **map_options) -> dict[str, float]:
  """Gradients inside a user's `shard_map(check_vma=True)` (its default), where JAX types
  arrays by the axes they vary over; an input kept whole (a norm's scale, ragged_dot's
  lhs, a bias) gets its gradient summed over the devices. XLA's implementations: JAX's
  Pallas interpreter does not run under that check (the kernels are lowered for H200s
  instead, `test_kernels_lower_in_a_checked_shard_map_for_four_h200s`)."""
  P = jax.sharding.PartitionSpec
  keys = iter(jax.random.split(jax.random.key(5), 8))
  normal = lambda shape: jax.random.normal(next(keys), shape)
  sizes = jnp.array([20, 0, 30], jnp.int32)
  cases = {
      "rms_norm": (lambda x, s: stellarax.rms_norm(x, s, implementation="xla"),
                   (normal((64, 32)), 1 + 0.1 * normal((32,))), (P("data"), P()), P("data")),
      "attention bias": (lambda q, b: stellarax.dot_product_attention(q, q, q, b, implementation="xla"),
                         (normal((4, 16, 2, 8)), normal((1, 2, 16, 16))), (P("data"), P()), P("data")),
      "ragged_dot": (lambda a, b: stellarax.ragged_dot(a, b, sizes, implementation="xla"),
                     (normal((64, 32)), normal((3, 32, 64))), (P(), P(None, None, "data")),
                     P(None, "data")),
      "glu": (lambda x, w: stellarax.gated_linear_unit(x, w, implementation="xla"),
              (normal((64, 32)), 0.2 * normal((32, 2, 64))), (P("data"), P()), P("data")),
  }
  errors = {}
  for name, (f, args, in_specs, out_specs) in cases.items():
    mapped = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **map_options)
    grad = lambda fn: jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=tuple(range(len(args))))
    placed = [jax.device_put(a, jax.NamedSharding(mesh, spec)) for a, spec in zip(args, in_specs)]
    try:
      got, want = jax.jit(grad(mapped))(*placed), grad(f)(*args)
      errors[name] = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, want))
    except Exception:  # reported, and failed by the test that reads it
      errors[name] = traceback.format_exc()[-2000:]
  return errors


def _spec_of(x) -> list:
  """A result's PartitionSpec as a list, without trailing Nones."""
  spec = [list(e) if isinstance(e, tuple) else e for e in x.sharding.spec]
  while spec and spec[-1] is None:
    spec.pop()
  return spec


def _collectives(text: str) -> list[list[str]]:
  """The collectives of a compiled program's text, each as [kind, its result's shapes]
  ("all-reduce", "f32[64,32]"), once each, sorted."""
  found = re.findall(r"= (\([^)]*\)|\S+) (all-gather|all-reduce|all-to-all|reduce-scatter|"
                     r"collective-permute)(?:-start)?\(", text)
  return sorted({(kind, " ".join(re.findall(r"\w+\[[\d,]*\]", shapes))) for shapes, kind in found})


def _run_cases(explicit: bool) -> dict:
  axis_type = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  mesh = jax.make_mesh((_DEVICES,), ("data",), axis_types=(axis_type,))
  report = {}
  for name, (ours, xla, inputs, specs) in _cases().items():
    tree = jax.tree.structure(inputs)
    # One PartitionSpec per array leaf of the inputs.
    leaves = [jax.device_put(x, jax.NamedSharding(mesh, s))
              for x, s in zip(jax.tree.leaves(inputs), specs, strict=True)]
    sharded = jax.tree.unflatten(tree, leaves)
    _SEEN.clear()
    try:
      got = jax.jit(ours)(*sharded)
      text = jax.jit(ours).lower(*sharded).compile().as_text()
      want = jax.jit(xla)(*inputs)
      errors = [float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)))
                      / (float(np.max(np.abs(np.asarray(b, np.float32)))) or 1.0))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
      report[name] = {"specs": [_spec_of(x) for x in jax.tree.leaves(got)], "errors": errors,
                      "gathers": "all-gather" in text, "sums": "all-reduce" in text,
                      "collectives": _collectives(text), "seen": sorted(set(_SEEN))}
    except Exception:  # reported, and failed by the test that reads it
      report[name] = {"crash": traceback.format_exc()[-3000:]}
  # What tuning sees: the per-device calls where the types carry the shardings.
  q = jax.device_put(jnp.ones((4, 64, 4, 64)), jax.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  f = lambda q: stellarax.dot_product_attention(
      q, q, q, implementation=stellarax.PallasTritonAttention(interpret=True))
  report["captured"] = [list(ba.arguments["query"].shape)
                        for ba in stellarax.autotuning.get_bound_args(f, q)]
  # One whole call at three sites: split over the batch, over the heads, and not at all
  # (replicated). With Auto axes the three have one marker; each device call is captured.
  placed = (lambda x, spec: jax.sharding.reshard(x, jax.NamedSharding(mesh, spec))) if explicit \
      else (lambda x, spec: jax.lax.with_sharding_constraint(x, jax.NamedSharding(mesh, spec)))
  sites = lambda q: sum(placed(f(placed(q + i, spec)), jax.P()) for i, spec in enumerate(
      (jax.P("data"), jax.P(None, None, "data"), jax.P())))
  report["captured at three sites"] = sorted(
      list(ba.arguments["query"].shape) for ba in stellarax.autotuning.get_bound_args(sites, q))
  # From a program the user compiled first, and twice from one Traced: JAX's caches of
  # the executable skipped the partitioner, and the whole calls were captured.
  lowered = jax.jit(lambda q: f(q) + 1).lower(q)
  lowered.compile()
  traced = jax.jit(lambda q: f(q) + 2).trace(q)
  report["captured after a compile"] = [
      [list(ba.arguments["query"].shape) for ba in stellarax.autotuning.get_bound_args(program)]
      for program in (lowered, lowered, traced, traced)]
  # Inside a user's shard_map over one axis of two, the kernel splits over the other.
  mesh2 = jax.make_mesh((2, 2), ("data", "model"), axis_types=(axis_type, axis_type))
  x = jax.random.normal(jax.random.key(1), (64, 32))
  norm = stellarax.PallasTritonLayerNorm(interpret=True)
  inner = jax.jit(jax.shard_map(lambda x: stellarax.rms_norm(x, None, implementation=norm),
                                mesh=mesh2, in_specs=jax.P("data"), out_specs=jax.P("data"),
                                axis_names={"data"}, check_vma=False))
  _SEEN.clear()
  got = inner(jax.device_put(x, jax.NamedSharding(mesh2, jax.P(("data", "model")))))
  want = stellarax.rms_norm(x, None, implementation="xla")
  report["user shard_map"] = {"spec": _spec_of(got),
                              "error": float(np.max(np.abs(np.asarray(got) - np.asarray(want))))}
  report["user shard_map checked"] = _checked_shard_map(mesh)
  # Manual over "data" only: stellarax's own shard_map over "model" (Explicit) runs inside.
  report["user shard_map checked, 2-D"] = _checked_shard_map(mesh2, axis_names={"data"})
  # Off (Auto axes only): the whole call on every device, which jax.export can serialize.
  if not explicit:
    x = jax.device_put(jax.random.normal(jax.random.key(2), (64, 32)), jax.NamedSharding(mesh, jax.P("data")))
    w = 0.2 * jax.random.normal(jax.random.key(3), (32, 2, 64))
    glu = jax.jit(lambda x, w: stellarax.gated_linear_unit(
        x, w, implementation=stellarax.PallasTritonGatedLinearUnit(interpret=True)))
    with stellarax.per_shard_scope(False):
      whole = "CustomSPMDPartitioning" not in glu.lower(x, w).as_text()
      exported = jax.export.export(glu)(x, w)
      error = float(jnp.max(jnp.abs(exported.call(x, w) - glu(x, w))))
    report["per_shard off"] = {"whole": whole, "error": error,
                               "on again": "CustomSPMDPartitioning" in glu.lower(x, w).as_text()}
  # Tuned, then run with the result: each device's call runs the config tuned for it.
  x = jax.device_put(jnp.ones((64, 32)), jax.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  params = {"w": jnp.ones(32)}
  step = jax.jit(lambda x, p: ScaleRows()(x, p))
  result = stellarax.Autotuner(budget_s=1, progress=False).autotune(step, x, params)
  (entry,) = list(result)
  # Not the heuristic (unroll=1), whatever the measurement found.
  result = result.with_entry(dataclasses.replace(entry, best_config=_Config(unroll=2)))
  jax.block_until_ready(step(x, params))  # traced and compiled without the result first
  ran = []
  # Then with it; then a new function under the "error" miss policy, which the whole
  # call (never run, never tuned) must not fire.
  fresh = jax.jit(lambda x, p: ScaleRows()(x, p))
  for fn, policy in ((step, "heuristics"), (fresh, "error")):
    _CONFIGS.clear()
    with stellarax.autotuning.miss_policy_scope(policy), result:
      jax.block_until_ready(fn(x, params))
    ran.append(sorted({unroll for shape, unroll in _CONFIGS if shape == (16, 32)}))
  report["tuned"] = {"shape": list(entry.bound_args.arguments["x"].shape),
                     "best": result.entry(entry.bound_args).best_config.unroll, "ran": ran}
  # A program lowered inside transfer_scope and compiled after it: over Auto axes the
  # per-device calls are resolved when it compiles, and took the switch of then. Each
  # device runs (8, 32), whose nearest tuned call is the (16, 32) above (unroll=2).
  small = jax.device_put(jnp.ones((32, 32)), jax.NamedSharding(mesh, jax.P("data")))
  at_lowering = []
  for transfer in (True, False):
    _CONFIGS.clear()
    program = jax.jit(lambda x, p: ScaleRows()(x, p) * 1.0)
    with result:
      with stellarax.autotuning.transfer_scope(transfer):
        lowered = program.lower(small, params)
      lowered.compile()
    at_lowering.append(sorted({unroll for shape, unroll in _CONFIGS if shape == (8, 32)}))
  report["scopes at lowering"] = at_lowering
  # A program for one device on this four-device host: its kernel call is the whole
  # call, so the miss policy fires for it (JAX inlines custom_partitioning's body, whose
  # trace had the policy set aside: "error" raised nothing and "autotune" tuned nothing).
  plain = jnp.ones((12, 32))
  policies = {}
  for policy in ("error", "autotune"):
    asked = []
    resolution.set_autotune_on_miss(lambda ba: (asked.append(ba), ba.heuristics_config)[1])
    try:
      with stellarax.autotuning.miss_policy_scope(policy):
        jax.block_until_ready(jax.jit(lambda x, p: ScaleRows()(x, p) + 0.0)(plain, params))
      policies[policy] = f"ran; {len(asked)} tuned"
    except stellarax.autotuning.ConfigMissError:
      policies[policy] = "raised"
  report["one-device program"] = policies
  return report


@pytest.fixture(scope="module", params=["auto", "explicit"])
def sharded_run(request, tmp_path_factory):
  """The report of `_run_cases` in a subprocess with four CPU devices."""
  out = tmp_path_factory.mktemp("partitioning") / "report.json"
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_DEVICES}"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip()}
  proc = subprocess.run([sys.executable, __file__, request.param, str(out)], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return request.param, json.loads(out.read_text())


_EXPECTED_SPECS = {
    "attention batch": [["data"]],
    "attention heads": [[None, None, "data"]],
    "attention grad batch": [["data"]] * 3,
    "attention grad bias": [["data"]] * 3 + [[]],
    "attention gqa grad heads": [[None, None, "data"]] * 3,
    # Over Auto axes XLA chooses how results leave; over Explicit ones, as the argument.
    "attention grad heads bias": {"explicit": [[None, None, "data"]] * 3 + [[]],
                                  "auto": [[None, None, "data"]] * 3 + [[None, "data"]]},
    "rms_norm grad columns": {"explicit": [[None, "data"], []], "auto": [[None, "data"], ["data"]]},
    "glu grad rows": [["data"], []],
    "glu grad columns": [[], [None, None, "data"]],
    "glu vmap": [["data"]],
    "rms_norm grad rows": [["data"], []],
    "ragged_dot grad columns": [[], [None, None, "data"]],
    "user op grad rows": [["data"], []],
    "xla ragged_dot rows": [["data"]],
    "xla ragged_dot grad rows": [["data"], []],
    "xla glu columns": [[None, "data"]],
    "xla glu grad columns": [[], [None, None, "data"]],
    "xla glu grad rows": {"explicit": [["data"], []], "auto": None},
    "xla attention grad batch": {"explicit": [["data"]] * 3, "auto": None},
    "xla chunked attention heads": {"explicit": [[None, None, "data"]], "auto": None},
    "xla layer_norm grad rows": {"explicit": [["data"], [], []], "auto": None},
    "xla rms_norm rows": {"explicit": [["data"]], "auto": None},
}


@pytest.mark.slow  # a four-device run in a subprocess: CI's slow stage
def test_sharded_calls_compute_what_xla_does_on_each_shard(sharded_run):
  mode, report = sharded_run
  for name, expected in _EXPECTED_SPECS.items():
    row = report[name]
    assert "crash" not in row, f"{mode} {name}:\n{row.get('crash')}"
    assert max(row["errors"]) < 1e-4, (mode, name, row["errors"])
    expected = expected[mode] if isinstance(expected, dict) else expected
    assert expected is None or row["specs"] == expected, (mode, name, row["specs"])


@pytest.mark.slow  # a four-device run in a subprocess: CI's slow stage
def test_split_factors_are_not_gathered_and_partial_sums_are_added(sharded_run):
  mode, report = sharded_run
  for name in ("attention batch", "attention heads", "attention grad batch", "glu vmap",
               "attention gqa grad heads"):
    assert not report[name]["gathers"], (mode, name)
  # Gradients that sum over a split factor: the bias over the batch, the norm's scale
  # and the GLU's weights over the rows, ragged_dot's d lhs over the columns.
  for name in ("attention grad bias", "rms_norm grad rows", "glu grad rows",
               "ragged_dot grad columns", "user op grad rows"):
    assert report[name]["sums"], (mode, name)


@pytest.mark.slow  # a four-device run in a subprocess: CI's slow stage
def test_xla_implementations_move_no_more_than_plain_jax(sharded_run):
  mode, report = sharded_run
  # The GLU's weights split on N are never gathered: the output stays split, and the
  # gradient adds the devices' partial sums of d x (over N) and nothing else.
  def only_sums_of(name, shape):
    found = report[name]["collectives"]
    assert found and all(kind == "all-reduce" and set(shapes.split()) == {shape}
                         for kind, shapes in found), (mode, name, found)

  assert report["xla glu columns"]["collectives"] == [], (mode, report["xla glu columns"])
  only_sums_of("xla glu grad columns", "f32[64,32]")
  if mode == "auto":  # over Explicit axes ragged_dot's rows are gathered (its layout)
    # Rows split as jax.lax.ragged_dot keeps them: no output summed or gathered, only
    # d rhs's partial sums over the rows added.
    assert report["xla ragged_dot rows"]["collectives"] == [], report["xla ragged_dot rows"]
    only_sums_of("xla ragged_dot grad rows", "f32[3,32,64]")


@pytest.mark.slow  # a four-device run in a subprocess: CI's slow stage
def test_each_device_runs_its_shard_unless_the_op_refuses_it(sharded_run):
  mode, report = sharded_run
  # (custom_partitioning traces the whole call too, for one device; it runs the shards.)
  seen = report["user op grad rows"]["seen"]
  assert ["test_partitioning.scale_rows", [16, 32]] in seen
  assert ["test_partitioning.scale_rows_vjp", [16, 32]] in seen
  assert (["test_partitioning.scale_rows", [64, 32]] in seen) == (mode == "auto")
  too_few = report["user op too few rows"]
  assert "crash" not in too_few and max(too_few["errors"]) == 0
  assert too_few["seen"] == [["test_partitioning.scale_rows", [8, 32]]]
  # Tuning sees the per-device calls: in the lowered program where the shardings are in
  # the types; from the partitioner, compiling the program, with Auto axes.
  assert report["captured"] == [[1, 64, 4, 64]]
  assert report["captured at three sites"] == [[1, 64, 4, 64], [4, 64, 1, 64], [4, 64, 4, 64]]
  assert report["captured after a compile"] == [[[1, 64, 4, 64]]] * 4
  assert report["user shard_map"] == {"spec": [["data", "model"]], "error": 0.0}
  for case in ("user shard_map checked", "user shard_map checked, 2-D"):
    for name, error in report[case].items():
      assert isinstance(error, float) and error < 1e-5, (mode, case, name, error)
  if mode == "auto":
    assert report["per_shard off"] == {"whole": True, "error": 0.0, "on again": True}
  tuned = report["tuned"]
  assert tuned == {"shape": [16, 32], "best": 2, "ran": [[2], [2]]}, tuned
  assert report["scopes at lowering"] == [[2], [1]]  # transferred; the heuristic
  assert report["one-device program"] == {"error": "raised", "autotune": "ran; 1 tuned"}


# --- one device -----------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["PallasMosaicGpuAttention", "PallasTritonAttention"])
def test_kernels_lower_per_device_for_four_h200s(impl):
  # Mosaic GPU's interpreter does not run several CPU devices' kernels at once (its
  # simulated barriers are left allocated), so the Mosaic kernels' sharded calls are
  # checked by lowering for four abstract H200s: the kernel runs on each device's two
  # of the eight batch rows, forward and backward.
  from h200 import H200
  explicit = (jax.sharding.AxisType.Explicit,)
  mesh = jax.sharding.AbstractMesh((4,), ("data",), axis_types=explicit, abstract_device=H200)
  q = jax.ShapeDtypeStruct((8, 256, 4, 128), jnp.bfloat16,
                           sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  op = getattr(stellarax, impl)()
  f = lambda q: stellarax.dot_product_attention(q, q, q, is_causal=True, implementation=op)
  loss = jax.grad(lambda q: jnp.sum(f(q).astype(jnp.float32)))
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(loss).trace(q).lower(lowering_platforms=("cuda",)).as_text()
  # Each kernel's signature: (operand types) -> results.
  kernels = [line.rsplit(": (", 1)[1] for line in text.splitlines()
             if re.search(r"stablehlo.custom_call @(mosaic_gpu|__gpu)", line)]
  assert len(kernels) >= 2, text  # the forward and the backward
  assert all(k.startswith("tensor<2x256x4x128xbf16>") for k in kernels), kernels
  assert not any("8x256x4x128" in k for k in kernels), kernels



@pytest.mark.parametrize("family", ["attention", "layer_norm", "ragged_dot", "gated_linear_unit"])
@pytest.mark.parametrize("partial", [False, True], ids=["all axes manual", "one of two"])
def test_kernels_lower_in_a_checked_shard_map_for_four_h200s(family, partial):
  # Inside a user's shard_map(check_vma=True), JAX wants each kernel output's varying
  # axes stated (`pallas_common.out_struct`, `partitioning.vary_like`) and the gradients
  # typed like their inputs; lowered, forward and backward, for every kernel of the
  # family. Manual over one axis of two, the kernel splits over the other too (its own
  # shard_map, checked as well), and runs on a quarter of the arrays.
  from h200 import H200
  P = jax.sharding.PartitionSpec
  names = ("d", "m") if partial else ("d",)
  mesh = jax.sharding.AbstractMesh((2, 2) if partial else (4,), names,
                                   axis_types=(jax.sharding.AxisType.Explicit,) * len(names),
                                   abstract_device=H200)
  split = names if partial else "d"  # how the arrays come in: over both axes
  arg = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                                 sharding=jax.sharding.NamedSharding(mesh, spec))
  sizes = jnp.array([64, 0, 100], jnp.int32)
  calls = {  # family -> (fn(impl), args, in_specs, out_specs, per-device operand shape)
      "attention": (lambda i: lambda q: stellarax.dot_product_attention(q, q, q, is_causal=True,
                                                                        implementation=i),
                    [arg((8, 256, 4, 128), P(split))], (P("d"),), P("d"), "2x256x4x128"),
      "layer_norm": (lambda i: lambda x, s: stellarax.rms_norm(x, s, implementation=i),
                     [arg((256, 1024), P(split)), arg((1024,), P())], (P("d"), P()), P("d"),
                     "64x1024"),
      "ragged_dot": (lambda i: lambda a, b: stellarax.ragged_dot(a, b, sizes, implementation=i),
                     [arg((256, 256), P()), arg((3, 256, 512), P(None, None, split))],
                     (P(), P(None, None, "d")), P(None, "d"), "256x128"),
      "gated_linear_unit": (lambda i: lambda x, w: stellarax.gated_linear_unit(x, w, implementation=i),
                            [arg((256, 256), P(split)), arg((256, 2, 256), P())], (P("d"), P()),
                            P("d"), "64x256"),
  }
  make, args, in_specs, out_specs, local = calls[family]
  impls = [n.partition(".")[2] for n in registry.names(family)
           if n.partition(".")[2].startswith("pallas_") and not n.endswith("_vjp")]
  assert impls, family
  for impl in impls:
    mapped = jax.shard_map(make(impl), mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                           axis_names={"d"})
    loss = jax.grad(lambda *a: jnp.sum(mapped(*a).astype(jnp.float32)), argnums=tuple(range(len(args))))
    with jax.sharding.use_abstract_mesh(mesh):
      text = jax.jit(loss).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    kernels = [line.rsplit(": (", 1)[1] for line in text.splitlines()
               if re.search(r"stablehlo.custom_call @(mosaic_gpu|__gpu)", line)]
    assert len(kernels) >= 2, (impl, text[-2000:])  # forward and backward
    assert any(f"tensor<{local}xbf16>" in k for k in kernels), (impl, kernels)


def test_a_layout_without_residuals_keeps_the_output_only():
  layout = partitioning.ShardingLayout({"x": "r c"}, ("r c", ("r",)), frozenset({"r"}))
  assert layout.without_residuals().outputs == ("r c", None)
  assert layout.without_residuals().arguments == layout.arguments
  with pytest.raises(ValueError, match="needs outputs \\(out, residuals\\)"):
    partitioning.ShardingLayout({"x": "r c"}, {"x": "r c"}, frozenset()).without_residuals()


def test_vary_alike_leaves_arrays_alone_outside_a_checked_shard_map():
  x, y = jnp.ones((2, 3)), jnp.zeros(3)
  got = partitioning.vary_alike([x, y])
  assert got[0] is x and got[1] is y
  assert partitioning.vary_like({"a": x}, [y]) == {"a": x}


def test_bound_arguments_take_a_shards_shapes_vmap_levels_included():
  x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
  params = {"w": jax.ShapeDtypeStruct((32,), jnp.float32)}
  ba = ScaleRows.bind(x, params).with_outer_vmap(6, (False, True)).with_outer_vmap(8, (True, False))
  # Leaves in name order (params.w, x): x batched at the inner level, params.w at the outer.
  assert [s.shape for s in ba.batched_array_specs()] == [(8, 32), (6, 64, 32)]
  local = ba.with_array_shapes([(2, 32), (3, 16, 32)])
  assert [s.shape for s in local.array_specs()] == [(32,), (16, 32)]
  assert local.vmap_axes == ((3, (False, True)), (2, (True, False)))
  assert local.op == ba.op and local.arguments.keys() == ba.arguments.keys()
  with pytest.raises(ValueError, match="1 shapes given for the 2 array leaves"):
    ba.with_array_shapes([(32,)])
  with pytest.raises(ValueError, match="give a vmap level of .* two sizes"):
    ba.with_outer_vmap(5, (True, True)).with_array_shapes([(2, 3, 32), (1, 2, 16, 32)])


def test_broadcast_dimensions_get_factors_of_their_own():
  assert partitioning.broadcast_labels((1, 4, 64, 64), "b h t s", "bias") == "bias_0 h t s"
  assert partitioning.broadcast_labels((64, 1), "b h t s", "mask") == "t mask_1"


def test_a_layout_that_does_not_fit_the_call_says_so():
  ba = ScaleRows.bind(jax.ShapeDtypeStruct((64, 32), jnp.float32),
                      {"w": jax.ShapeDtypeStruct((32,), jnp.float32)})
  wrong_rank = stellarax.ShardingLayout({"x": "r", "params": {"w": "c"}}, ("r c", None), frozenset("r"))
  with pytest.raises(ValueError, match=r"names 1 dimensions \(r\) of an array of shape \(64, 32\)"):
    partitioning._Plan.of(ba, wrong_rank)
  two_sizes = stellarax.ShardingLayout({"x": "r c", "params": {"w": "r"}}, ("r c", None), frozenset("r"))
  with pytest.raises(ValueError, match="gives factor 'r' the sizes 32 and 64"):
    partitioning._Plan.of(ba, two_sizes)
  missing = stellarax.ShardingLayout({"x": "r c"}, ("r c", None), frozenset("r"))
  with pytest.raises(ValueError, match="names 0 arrays for argument 'params', which holds 1"):
    partitioning._Plan.of(ba, missing)


def test_the_shardy_rule_names_every_dimension_and_replicates_the_rest():
  ba = ScaleRows.bind(jax.ShapeDtypeStruct((64, 32), jnp.float32),
                      {"w": jax.ShapeDtypeStruct((32,), jnp.float32)})
  plan = partitioning._Plan.of(ba, ScaleRows()._array_layout(ba.arguments))
  assert plan.sharding_rule() == ("c, r c -> r c, r c", ("c",), {})
  P = jax.sharding.PartitionSpec
  # The rows split by the first argument that splits them, where the axes divide them.
  assert plan.assign([P(), P("x")], {"x": 4}) == {"r": ("x",)}
  assert plan.assign([P("x"), P(None, "x")], {"x": 4}) == {}  # c is not free
  uneven = ScaleRows.bind(jax.ShapeDtypeStruct((66, 32), jnp.float32),
                          {"w": jax.ShapeDtypeStruct((32,), jnp.float32)})
  uneven_plan = partitioning._Plan.of(uneven, ScaleRows()._array_layout(uneven.arguments))
  assert uneven_plan.assign([P(), P("x")], {"x": 4}) == {}  # 66 rows do not split 4 ways
  assert plan.summed_axes({"r": ("x",)}) == [(), ()]


def test_gqa_query_heads_split_with_the_key_heads_they_use():
  S = jax.ShapeDtypeStruct
  op = stellarax.PallasTritonAttention()
  ba = op.bind(S((2, 16, 8, 64), jnp.bfloat16), S((2, 16, 4, 64), jnp.bfloat16),
               S((2, 16, 4, 64), jnp.bfloat16), bias=S((1, 8, 16, 16), jnp.bfloat16))
  plan = partitioning._Plan.of(ba, op._partitioning(ba.arguments))
  rule, replicated, sizes = plan.sharding_rule()
  # Arguments in name order: bias, key, query, value; then out and the log-sum-exp.
  assert rule == ("bias_0 (h group) t s, b s h d, b t (h group) d, b s h e -> "
                  "b t (h group) e, b (h group) t")
  assert sizes == {"group": 2} and "group" in replicated and "h" not in replicated
  P = jax.sharding.PartitionSpec
  specs = [P(None, "x"), P(None, None, "x"), P(None, None, "x"), P(None, None, "x")]
  shapes = [s.shape for s in ba.batched_array_specs()]
  assignment = plan.assign(specs, {"x": 4})
  assert assignment == {"h": ("x",)}
  local = plan.local_call(ba, shapes, assignment, {"x": 4})
  assert [s.shape for s in local.batched_array_specs()] == [
      (1, 2, 16, 16), (2, 16, 1, 64), (2, 16, 2, 64), (2, 16, 1, 64)]
  assert plan.assign(specs, {"x": 8}) == {}  # 4 key heads do not split 8 ways
  with pytest.raises(ValueError, match=r"gives no size for \['r', 'q'\]"):
    partitioning._Plan.of(ScaleRows.bind(S((64, 32), jnp.float32), {"w": S((32,), jnp.float32)}),
                          stellarax.ShardingLayout({"x": "(r q) c", "params": {"w": "c"}},
                                                   ("(r q) c", None), frozenset("r")))


def test_per_shard_scope_takes_a_bool():
  with pytest.raises(TypeError, match="enabled=0 must be True or False"):
    with stellarax.per_shard_scope(0):
      pass


def test_one_device_runs_the_call_as_it_is():
  # Nothing to split: no shard_map, no custom_partitioning in the program.
  x = jnp.ones((8, 4))
  text = jax.jit(lambda x: ScaleRows()(x, {"w": jnp.ones(4)})).lower(x).as_text()
  assert "CustomSPMDPartitioning" not in text and "shard_map" not in text


if __name__ == "__main__":
  mode, path = sys.argv[1], sys.argv[2]
  with open(path, "w") as f:
    json.dump(_run_cases(explicit=mode == "explicit"), f)


_VMAPPED_RAGGED_DOT = """
import jax, jax.numpy as jnp, stellarax
sizes = jnp.array([20, 0, 30], jnp.int32)
l = jax.random.normal(jax.random.key(0), (4, 50, 32))
r = jax.random.normal(jax.random.key(1), (4, 3, 32, 64))
loss = lambda l, r: jnp.sum(jnp.sin(jax.vmap(
    lambda l, r: stellarax.ragged_dot(l, r, sizes, implementation="xla"))(l, r)))
g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
want = g(l, r)
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
got = g(*(jax.device_put(a, jax.NamedSharding(mesh, jax.P("data"))) for a in (l, r)))
print(max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))))
# A kernel's call per shard, inside a vmap whose batch the mesh splits.
from stellarax.ops.normalization.pallas_triton import PallasTritonLayerNorm
s = jnp.linspace(0.5, 1.5, 32)
norm = lambda x: jnp.sum(jax.vmap(lambda x: stellarax.rms_norm(
    x, s, implementation=PallasTritonLayerNorm(interpret=True)))(x) ** 2)
g = jax.jit(jax.value_and_grad(norm))
want = g(l)
got = g(jax.device_put(l, jax.NamedSharding(mesh, jax.P("data"))))
print(max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, want)))
"""


def test_ops_under_vmap_on_an_explicit_mesh():
  # The per-example call keeps the mesh in its types and nothing splits it: JAX's
  # ragged_dot infers no output sharding there and raised NotImplementedError. From jax
  # 0.12.1 on, a vmap over an Explicit axis makes shard_map leave that axis alone, and
  # the per-shard call of any op raised "all mesh axes are already manual".
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip()}
  proc = subprocess.run([sys.executable, "-c", _VMAPPED_RAGGED_DOT], env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  ragged_dot_error, norm_error = map(float, proc.stdout.split()[-2:])
  assert ragged_dot_error < 1e-4 and norm_error < 1e-5
