"""How an op call runs: config resolution, marker, custom_vmap, custom_vjp.

The structure of one call, from the outside in:

    custom_vjp                     backward pass = the op's VJP op
      custom_vjp                   where no VJP op differentiates (an op without one,
                                   second derivatives): JAX differentiates the marked
                                   implementation, which custom_vmap would not let it
        custom_vmap                jax.vmap re-enters with the vmap level recorded
          marker                   a call op tagged with the bound arguments (JSON)
            op._fwd(config=...)    the implementation

Under `jax.vmap` the custom_vmap rule re-binds the call one level further out
(so `BoundArguments.vmap_axes` records it), resolves the config for that key,
and runs the implementation under `jax.vmap`. The marker is attached with
`ad_metadata="drop"` so the backward pass carries only the VJP op's marker.

Three calls take shorter ways: a trivial one (`Op._is_trivial`: its output is zeros
whatever its inputs) returns zeros of its reference's shape with none of the above; one
vmapped over an empty batch returns empty outputs without a kernel; and a backward whose VJP op refuses the call (a backward kernel with narrower limits
than its forward) runs the family's XLA VJP op instead, with a
`BackwardFallbackWarning`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import contextvars
from typing import Any

import jax
import jax.numpy as jnp

try:  # BatchTracer has no public name (`_mapped_by_vmap`, `vmap_levels`)
  from jax._src import core as _jax_core
  from jax._src.interpreters import batching
except ImportError:  # a JAX that moved it: every trace is resolved
  _jax_core = batching = None

from stellarax.core import markers
from stellarax.core import partitioning
from stellarax.core import registry
from stellarax.core import specs
from stellarax.core.bound_args import BoundArguments, as_recorded
from stellarax.core.resolution import resolve_config
from stellarax.core.warn import warn


def _batch_one_level(fn: Callable[..., Any], batched: tuple[bool, ...]) -> Callable[..., Any]:
  """`jax.vmap(fn)` over the leading axis of the batched arguments; where the
  implementation has no batching rule (e.g. `lax.ragged_dot` over lhs), a
  sequential `lax.map` over the batch instead."""

  def batched_fn(*arrays):
    try:
      return jax.vmap(fn, in_axes=tuple(0 if b else None for b in batched))(*arrays)
    except NotImplementedError:
      def one(xs):
        it = iter(xs)
        return fn(*(next(it) if b else a for a, b in zip(arrays, batched)))
      return jax.lax.map(one, [a for a, b in zip(arrays, batched) if b])

  return batched_fn


def _vmapped_impl(ba: BoundArguments, impl: Callable[..., Any]) -> Callable[..., Any]:
  fn = impl
  for _, batched in ba.vmap_axes:
    fn = _batch_one_level(fn, batched)
  return fn


# `custom_vmap` traces its function for the arguments' unbatched shapes before
# `jax.vmap`'s rule replaces that trace with its own (jax/_src/custom_batching.py,
# `custom_vmap.__call__`). Such a trace never runs: resolving its config would apply the
# miss policy to a call no program makes ("error" raised for a tuned vmapped call, and
# "autotune" tuned the unbatched call too). It takes the heuristic config instead.
# Where a jit, checkpoint, scan or cond lies between the vmap and the call, the call is
# traced for unbatched shapes inside that transformation's own trace, one a program
# could run as it is: nothing tells it apart, so it is resolved (README: miss policy).
_UNRUN_TRACE = contextvars.ContextVar("stellarax_unrun_trace", default=False)


def _mapped_by_vmap(arrays: Sequence[Any]) -> bool:
  """Whether some `jax.vmap` maps one of `arrays` (then its rule, not the function
  traced for the unbatched shapes, makes the call). False where this JAX's batching
  tracer cannot be recognised: every trace is then resolved, as before."""
  tracer = getattr(batching, "BatchTracer", None)
  unmapped = getattr(batching, "not_mapped", None)
  return tracer is not None and any(
      isinstance(a, tracer) and getattr(a, "batch_dim", unmapped) is not unmapped
      for a in arrays)


def vmap_levels(arrays: Sequence[Any]) -> tuple[tuple[int, tuple[bool, ...]], ...] | None:
  """The `jax.vmap` levels over a call's array leaves, as `BoundArguments.vmap_axes`
  holds them (innermost first: size, and which leaves it maps), read from the batching
  traces the call is traced under; () outside any. A `jit` or other trace between a
  vmap and the call hides the vmap (its rule adds the level later). None where this
  JAX's batching traces cannot be read."""
  try:
    trace = _jax_core.trace_ctx.trace
    tracer, unmapped = batching.BatchTracer, getattr(batching, "not_mapped", None)
    levels, values = [], list(arrays)
    while isinstance(trace, batching.BatchTrace):
      ours = [isinstance(v, tracer) and v._trace.tag is trace.tag for v in values]
      batched = tuple(o and v.batch_dim is not unmapped for o, v in zip(ours, values))
      if any(batched):  # (a level that maps none of them never reaches the call's rule)
        levels.append((int(trace.axis_data.size), batched))
      values = [v.val if o else v for o, v in zip(ours, values)]
      trace = trace.parent_trace
    return tuple(levels)
  except AttributeError:  # (a JAX without these internals: `batching` is None too)
    return None


def _vmappable(ba: BoundArguments, make_impl: Callable[[Any], Callable[..., Any]]) -> Callable[..., Any]:
  """The marked implementation, re-bound under every vmap level it meets."""

  def run_for(call_ba: BoundArguments) -> Callable[..., Any]:
    # `ba`, or one shard's part of it (`partitioning.per_shard`), with its own config.
    unrun = _UNRUN_TRACE.get()
    pinned = call_ba.op.config
    config = ((pinned if pinned is not None else call_ba.heuristics_config) if unrun
              else resolve_config(call_ba).config)
    return _vmapped_impl(call_ba, make_impl(config))

  @jax.custom_batching.custom_vmap
  def call(*arrays):
    return partitioning.per_shard(ba, run_for)(*arrays)

  @call.def_vmap
  def rule(axis_size, in_batched, *arrays):
    if axis_size == 0:  # an empty batch: empty outputs, and no kernel to run on none
      return _empty_batch(call, in_batched, arrays)
    outer = ba.with_outer_vmap(axis_size, tuple(in_batched))
    out = _vmappable(outer, make_impl)(*arrays)
    return out, jax.tree.map(lambda _: True, out)

  def entered(*arrays):
    token = _UNRUN_TRACE.set(_mapped_by_vmap(arrays))  # the rule, nested, sets its own
    try:
      return call(*arrays)
    finally:
      _UNRUN_TRACE.reset(token)

  return entered


def _empty_batch(call: Callable[..., Any], in_batched: Sequence[bool], arrays: Sequence[Any]):
  """A call vmapped over a batch of size 0: zeros of its outputs' per-example shapes
  (found abstractly, from one example's shapes) with a leading batch of 0."""
  example = [jax.ShapeDtypeStruct(a.shape[1:] if b else a.shape, a.dtype)
             for a, b in zip(arrays, in_batched)]
  token = _UNRUN_TRACE.set(True)  # shapes only: no call is made
  try:
    shapes = jax.eval_shape(call, *example)
  finally:
    _UNRUN_TRACE.reset(token)
  out = jax.tree.map(lambda s: jnp.zeros((0, *s.shape), s.dtype), shapes)
  return out, jax.tree.map(lambda _: True, out)


def call_op(op, values: dict[str, Any]) -> Any:
  """Runs `op` on bound argument `values` (see the module docstring).

  Args:
    op: an `Op` instance.
    values: canonicalised argument values by name (arrays and statics).

  Returns:
    The op's output (forward ops: without residuals).

  Raises:
    ImplementationUnavailableError: when `op` cannot run with the installed JAX.
  """
  values = as_recorded(values)  # what tuning runs the op with, so the same here
  arrays, rebuild = specs.split_arrays(values)
  op.require_available()
  if op.fwd_cls is None and op._is_trivial(values):
    return _zeros_of_reference(op, arrays, rebuild)
  ba = BoundArguments.from_values(op, values)
  arrays = partitioning.vary_alike(arrays)  # inside a user's shard_map that checks

  def make_impl(config):
    def impl(*arrs):
      return op._fwd(**rebuild(arrs), config=config)
    return impl

  vcall = _differentiated_by_jax(op, ba, _vmappable(ba, make_impl), make_impl)
  if op.vjp_cls is None and getattr(op, "vjp", None) is None:
    out = vcall(*arrays)
    # A VJP op returns its gradients; a forward op with no VJP op of its own
    # (JAX differentiates its implementation) returns (out, residuals).
    return out if op.fwd_cls is not None else out[0]

  @jax.custom_vjp
  def primal(*arrs):
    return vcall(*arrs)[0]

  def primal_fwd(*arrs):
    out, residuals = vcall(*arrs)
    return out, (arrs, out, residuals)

  def primal_bwd(saved, dout):
    arrs, out, residuals = saved
    grads = _backward(op, dict(residuals=residuals, out=out, dout=dout, **rebuild(arrs)))
    return _grads_for_leaves(values, grads)

  primal.defvjp(primal_fwd, primal_bwd)
  return primal(*arrays)


def _differentiated_by_jax(op, ba: BoundArguments, vcall: Callable[..., Any],
                           make_impl: Callable[[Any], Callable[..., Any]]) -> Callable[..., Any]:
  """`vcall` (the marked implementation), made differentiable in reverse mode by JAX.

  `custom_vmap`, which records the vmap axes, has no transpose rule, so JAX cannot
  differentiate `vcall` in reverse mode. That matters where no VJP op does it: an op
  without one (a user's op, or a VJP op whose gradients are differentiated again), and
  the forward pass of an op with one under a second derivative. There the forward pass
  runs the implementation with its resolved config, marked, but without `custom_vmap`:
  under `jax.vmap` JAX batches it, and the marker and config are the unbatched call's.
  JAX differentiates it and keeps its residuals for the backward pass, as for any JAX
  code. Integer and boolean inputs get float0 (no) gradients.
  """

  @jax.custom_vjp
  def call(*arrs):
    return vcall(*arrs)

  def call_fwd(*arrs):
    marked = markers.mark(ba, make_impl(resolve_config(ba).config), derived_too=True)
    try:
      return jax.vjp(marked, *arrs)
    except Exception as exc:  # noqa: BLE001 (re-raised, saying which op and what to do)
      raise NotImplementedError(_not_differentiable(op, exc)) from exc

  def call_bwd(pullback, dout):
    return pullback(dout)

  call.defvjp(call_fwd, call_bwd)
  return call


def _not_differentiable(op, exc: Exception) -> str:
  """Why JAX had to differentiate `op`'s implementation, what failed, and the way out."""
  detail = (str(exc).strip().splitlines() or ["no message"])[0].rstrip(".")
  second = ("For a second derivative, choose an implementation JAX can differentiate "
            "(`implementation=\"xla\"`).")
  if op.fwd_cls is not None:
    why, fix = "a second derivative differentiates the backward pass", second
  elif op.vjp_cls is not None or getattr(op, "vjp", None) is not None:
    why, fix = "a second derivative differentiates the forward pass too", second
  else:
    why, fix = "it has no VJP op", "Give the op a VJP op of its own (`vjp_cls`)."
  return (f"JAX could not differentiate the implementation of {type(op).__name__} "
          f"({op.name}), which it must where no VJP op does ({why}): "
          f"{type(exc).__name__}: {detail}. {fix}")


class BackwardFallbackWarning(UserWarning):
  """A call's backward kernel does not take a call its forward kernel took; the op
  family's XLA backward computes the gradients instead."""


def _backward(op, arguments: dict[str, Any]) -> dict[str, Any]:
  """The gradients from `op`'s VJP op; where that refuses a call the forward took (a
  backward kernel with narrower limits, e.g. Mosaic GPU ragged_dot's K), from the
  family's XLA VJP op (`<family>.xla_vjp`, which needs no residuals), with a warning."""
  vjp = op.vjp_op()
  try:
    values = vjp._bind_values(**arguments)
  except NotImplementedError as exc:
    family = op.name.partition(".")[0]
    fallback_name = f"{family}.xla_vjp"
    if fallback_name == vjp.name or fallback_name not in registry.names(family):
      raise
    why = str(exc).rstrip(".")
    warn(f"{vjp.name} does not take this call ({why}); its gradients come from "
         f"{fallback_name} instead. For one implementation in both passes, choose a "
         "forward whose backward takes the call.", BackwardFallbackWarning)
    vjp = registry.lookup(fallback_name)()
    values = vjp._bind_values(**arguments)
  return call_op(vjp, values)


def _zeros_of_reference(op, arrays: list[Any], rebuild: Callable[[list[Any]], dict[str, Any]]) -> Any:
  """Zeros shaped like the op's reference output for these arguments (`Op._is_trivial`);
  they depend on no input, so their gradients are zeros too."""
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays]
  shapes = jax.eval_shape(lambda *a: op._reference(**rebuild(list(a))), *avals)
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _grads_for_leaves(values: dict[str, Any], grads: dict[str, Any]) -> tuple[Any, ...]:
  """Orders the VJP op's per-argument grads like the array leaves (None = 0, for a whole
  argument or for any leaf of it, as in `jax.custom_vjp`)."""
  out = []
  for name in sorted(values):  # jax.tree.flatten sorts dict keys
    leaves, structure = jax.tree.flatten(values[name])
    g = grads.get(name)
    try:
      # None may stand for a whole subtree too, as in jax.custom_vjp: a tree of Nones.
      g = jax.tree.map(lambda gx, v: jax.tree.map(lambda _: None, v) if gx is None else gx,
                       g, values[name], is_leaf=lambda x: x is None)
      g_leaves = structure.flatten_up_to(g)
    except (ValueError, TypeError) as exc:
      raise ValueError(
          f"The VJP op's gradient for {name!r} is not of the argument's structure "
          f"{structure} ({exc}). Return one of that structure, with None for a leaf (or "
          "the whole argument) whose gradient is zero.") from None
    for x, gx in zip(leaves, g_leaves):
      if specs.is_array_value(x):
        out.append(gx)
  return tuple(out)
