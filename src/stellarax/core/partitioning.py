"""Running an op's kernel on each device's shard of its arrays.

XLA partitions its own operations across the devices of a mesh, but a Pallas kernel is
an opaque custom call to it. Given arrays sharded over a mesh whose axes are Auto, XLA
gathers them whole onto every device and each device computes the whole call; over
Explicit axes (`jax.make_mesh`'s default) a kernel does not even trace, as its refs
would be sharded. An op that says how its arrays line up (`Op._partitioning` returns a
`ShardingLayout`) runs on each device's shard instead:

- A `ShardingLayout` names every dimension of every array argument and output with
  factors; dimensions that share a factor are one and the same (attention's batch in
  the query, the keys, the output and the log-sum-exp). A dimension may be several
  factors, major first: GQA's query heads are "(h group)", the key heads times the
  group each serves, and splitting h splits both into matching contiguous blocks (a
  minor factor is never split). Factors in `free` may be split across devices; the
  others are gathered. An output that lacks a split factor of the inputs is a sum over
  it (the bias gradient over the batch, a norm's scale gradient over the rows, the lhs
  gradient of a matmul over its split columns): each device's partial sum is added to
  the others' (`psum`).
- Which mesh axes split a factor follows the arguments' shardings: the first argument
  dimension with that factor and sharded axes gives them, where they divide the
  factor's size and no other factor took them. If the kernel does not take the
  resulting per-device shapes (`_check_supported`), every device runs the whole call.
- Per shard the call is bound anew to the shard's shapes, marked so (`markers`), and
  its config resolved for them: tuned results and heuristics apply to what each device
  runs, and capture finds those calls (`per_device_calls` for Auto axes), so
  `autotune` tunes them.

Two ways in, one per kind of mesh axis:

- Explicit axes: the arrays' types carry their shardings, so the call is wrapped in
  `jax.shard_map` when it is traced. Its outputs leave split like the arguments their
  factors come from (a gradient must have its argument's sharding). XLA
  implementations run per shard here too (`Op._array_layout`), as some XLA operations
  refuse split arrays (`jax.lax.ragged_dot`; a contraction over a split dimension).
- Auto axes: the shardings are known only when XLA partitions the program, so the call
  is wrapped in `custom_partitioning`, whose partition callback places it then (its
  Shardy rule, built from the same layout, guides propagation).

With a single device nothing is wrapped. Under `jax.vmap` every vmap level is one
more free factor in front of the batched arrays and of every output.

Inside a user's own `jax.shard_map` the arrays are already one device's, and with
`check_vma=True` (its default) JAX types each by the manual mesh axes it varies over.
So that one such type serves all of a call's inputs and outputs, the inputs are first
cast to vary over the union of their axes (`vary_alike`): JAX then adds up the
gradient of an input that does not vary across those devices, as for any computation
that broadcasts it. A Pallas kernel's outputs must have that type spelled out:
`pallas_common.out_struct` copies it from the kernel's inputs, and `vary_like` casts
what `plgpu.kernel` returns (it types its outputs with the check off). This module's
own `shard_map` is checked there too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax._src import config as _jax_config
from jax._src import core as _jax_core
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from stellarax.core import markers
from stellarax.core import resolution
from stellarax.core.bound_args import BoundArguments

Labels = tuple[tuple[str, ...], ...]  # each dimension's factors, major first


@dataclasses.dataclass(frozen=True)
class ShardingLayout:
  """How one op call's arrays line up, for running it per shard.

  Attributes:
    arguments: argument name -> the factors of its dimensions, one space-separated
      string per array ("b t h d"), or a pytree of such strings for a pytree argument
      (residuals); arguments that are None or hold no array may be left out. A
      dimension that is several factors, major first, is written in parentheses:
      GQA's query heads are "(kv_heads group)", each key head serving a group of
      query heads; only its major factor may be split (into contiguous blocks).
    outputs: the implementation's output as a pytree of such strings (None where
      it returns None).
    free: the factors that may be split across devices.
    sizes: the sizes of factors that stand only inside parentheses.
  """

  arguments: Mapping[str, Any]
  outputs: Any
  free: frozenset[str]
  sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)

  def without_residuals(self) -> ShardingLayout:
    """This layout of a forward op, `outputs` being (out, residuals), for an
    implementation that returns (out, None): a family's layout names its kernels'
    residuals, which an XLA implementation (its VJP recomputes) does not return.

    Raises:
      ValueError: when `outputs` is not an (out, residuals) pair.
    """
    if not isinstance(self.outputs, tuple) or len(self.outputs) != 2:
      raise ValueError(f"without_residuals needs outputs (out, residuals), got {self.outputs!r}.")
    return dataclasses.replace(self, outputs=(self.outputs[0], None))


def target_device() -> Any:
  """The device a call traced now is for: the abstract mesh's device where one is set
  (lowering for another machine, e.g. `jax.sharding.use_abstract_mesh` of an H200's from
  a CPU host, as `jax.export` and deviceless compiles do: a `jax.sharding.AbstractDevice`,
  with `device_kind` and `platform`), else the default backend's first device. That
  device too where the abstract one is of its kind and platform (a concrete mesh's,
  `jax.set_mesh`, has one), so that what the device states, its compute capability,
  is read rather than taken from its kind."""
  default = jax.devices()[0]
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  if abstract is None or (abstract.platform, abstract.device_kind) == (
      default.platform, default.device_kind):
    return default
  return abstract


def _dims(labels: str) -> Labels:
  """"b (k g) d" -> (("b",), ("k", "g"), ("d",))."""
  return tuple(tuple(token.strip("()").split()) for token in re.findall(r"\([^)]*\)|\S+", labels))


def _text(labels: Labels) -> str:
  return " ".join(f"({' '.join(d)})" if len(d) > 1 else d[0] for d in labels)


def broadcast_labels(shape: Sequence[int], labels: str, name: str) -> str:
  """The labels of an array that broadcasts against `labels` (aligned on the right):
  its dimensions of size 1 get factors of their own (`<name>_<dim>`), as a broadcast
  dimension is not split with the one it broadcasts against.

  Args:
    shape: the array's shape (rank at most that of `labels`).
    labels: the factors of the shape it broadcasts to (`ShardingLayout`'s form).
    name: the argument's name, for the factors of its size-1 dimensions.

  Returns:
    The factors of `shape`'s dimensions, in the same form.
  """
  full = _dims(labels)[len(_dims(labels)) - len(shape):]
  return _text(tuple((f"{name}_{i}",) if size == 1 else dim
                     for i, (size, dim) in enumerate(zip(shape, full))))


def _varying_axes(x: Any) -> frozenset[str]:
  """The manual mesh axes `x` varies over, inside a `shard_map` that checks them."""
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(getattr(mat, "varying", ()) or ())


def vary_like(outputs: Any, operands: Sequence[Any]) -> Any:
  """`outputs` (a pytree of arrays) typed as varying over every manual mesh axis any of
  `operands` varies over, inside a `jax.shard_map` that checks them; elsewhere, and
  where no operand varies, `outputs` as they are. For what computes each device's own
  values but types them as varying over fewer axes: a `plgpu.kernel`, which types its
  outputs with the check off.

  Args:
    outputs: the arrays to type.
    operands: the arrays they were computed from.

  Returns:
    `outputs`, each cast where it varies over fewer of those axes.
  """
  if not _jax_config._check_vma.value:
    return outputs
  axes = frozenset().union(*(_varying_axes(x) for x in operands))

  def cast(x):
    missing = tuple(sorted(axes - _varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, outputs) if axes else outputs


def vary_alike(arrays: Sequence[Any]) -> list[Any]:
  """Inside `jax.shard_map(check_vma=True)`, `arrays` cast to vary over the union of
  the manual mesh axes any of them varies over (the module docstring says why);
  elsewhere, and where none varies, `arrays` as they are.

  Args:
    arrays: a call's array leaves.

  Returns:
    The arrays, each of the same type as to the mesh axes it varies over.
  """
  return list(vary_like(list(arrays), arrays))


def per_shard(ba: BoundArguments, run_for: Callable[[BoundArguments], Callable[..., Any]]
              ) -> Callable[..., Any]:
  """The call `ba` as a function of its (batched) array leaves, marked
  (`markers.mark`), and run per shard where its op has a layout and there are devices
  to shard over (the module docstring).

  Args:
    ba: the call (its vmap levels included).
    run_for: bound arguments -> fn(*array leaves) running that call; called with
      `ba` and with the per-shard calls.

  Returns:
    fn(*array leaves) -> the implementation's output.
  """
  def call(*arrays):
    # The whole call's config is resolved only where the whole call may run (a miss
    # policy of "error" or "autotune" must not fire for a call no device runs), and a
    # layout is built only where there are devices to split over.
    mesh = _explicit_mesh(arrays)
    if mesh is not None:
      layout = _layout(ba, kernels_only=False)
      if layout is not None:
        return _shard_mapped(ba, _Plan.of(ba, layout), run_for, mesh, arrays)
    elif jax.device_count() > 1 and _per_shard.value:
      layout = _layout(ba, kernels_only=True)
      if layout is not None:
        return _custom_partitioned(ba, _Plan.of(ba, layout), run_for)(*arrays)
    return markers.mark(ba, run_for(ba))(*arrays)

  return call


def _layout(ba: BoundArguments, *, kernels_only: bool) -> ShardingLayout | None:
  """The layout `ba` runs per shard by. Over Auto axes only kernels have one
  (`_partitioning`: XLA partitions its own operations); over Explicit ones every op
  that has a layout (`_array_layout`) runs per shard: kernels do not trace on split
  arrays, and some XLA operations refuse them too (`jax.lax.ragged_dot`)."""
  layout = ba.op._partitioning(ba.arguments)
  if layout is None and not kernels_only:
    layout = ba.op._array_layout(ba.arguments)
  return layout


# Part of JAX's trace context, so that a trace made with it on is not reused with it off.
_per_shard = _jax_config.bool_state(
    name="stellarax_per_shard", default=True, include_in_trace_context=True,
    include_in_jit_key=True,
    help="Run Pallas kernels per shard on arrays split over Auto mesh axes "
         "(stellarax/core/partitioning.py); STELLARAX_PER_SHARD=0 turns it off.")


@contextlib.contextmanager
def per_shard_scope(enabled: bool) -> Iterator[None]:
  """Turns running kernels per shard over Auto mesh axes on or off inside a `with`
  block (default: on, unless the environment sets STELLARAX_PER_SHARD=0).

  Off, a kernel's call on arrays split over Auto axes runs whole on every device, on
  arrays XLA gathers for it, as it did before stellarax split calls: what
  `jax.export` needs, as it cannot serialize the partitioner's Python callback. Over
  Explicit axes kernels run per shard always: they do not trace on split arrays.

  Args:
    enabled: whether to run per shard.

  Raises:
    TypeError: for a value other than a bool.
  """
  if not isinstance(enabled, bool):
    raise TypeError(f"enabled={enabled!r} must be True or False.")
  with _per_shard(enabled):
    yield


@dataclasses.dataclass(frozen=True)
class _Plan:
  """A layout flattened to the call's array leaves, vmap factors in front: each
  array's dimensions, each dimension's factors (major first)."""

  inputs: tuple[Labels, ...]
  outputs: tuple[Labels, ...]
  output_tree: Any  # the outputs' pytree structure
  splittable: frozenset[str]  # free factors that are nowhere a minor one
  sizes: Mapping[str, int]  # every factor's size in the whole call
  # For each output, the input it is the gradient of (a VJP op's outputs are keyed by
  # argument name, as the arguments are), or None.
  twins: tuple[int | None, ...]

  @classmethod
  def of(cls, ba: BoundArguments, layout: ShardingLayout) -> _Plan:
    levels = len(ba.vmap_axes)
    inputs = []
    arguments, paths = _argument_labels(ba, layout)
    for i, labels in enumerate(arguments):
      # Batched leaves have the vmapped dimensions in front, outermost level first.
      front = tuple((f"vmap{j}",) for j in reversed(range(levels)) if ba.vmap_axes[j][1][i])
      inputs.append(front + labels)
    every_level = tuple((f"vmap{j}",) for j in reversed(range(levels)))
    outputs = tuple(every_level + _dims(s) for s in jax.tree.leaves(layout.outputs))
    minor = {f for labels in inputs + list(outputs) for dim in labels for f in dim[1:]}
    splittable = (frozenset(layout.free) | {d[0] for d in every_level}) - minor
    sizes = _factor_sizes(ba, inputs, [s.shape for s in ba.batched_array_specs()],
                          dict(layout.sizes))
    output_paths = [jax.tree_util.keystr(p)
                    for p, _ in jax.tree_util.tree_flatten_with_path(layout.outputs)[0]]
    twins = tuple(paths.index(p) if p in paths else None for p in output_paths)
    return cls(tuple(inputs), outputs, jax.tree.structure(layout.outputs), splittable, sizes,
               twins)

  def check_outputs(self, ba: BoundArguments, input_shapes: Sequence[Sequence[int]],
                    output_shapes: Sequence[Sequence[int]]) -> None:
    """The outputs are as many as the layout names, of its ranks, and each dimension
    has the size of its factors in the arguments of these shapes.

    Raises:
      ValueError: saying which output does not fit, and that the layout needs a fix.
    """
    fix = "fix the op's `_partitioning`."
    if len(output_shapes) != len(self.outputs):
      raise ValueError(f"{ba.op.name} returned {len(output_shapes)} arrays, but its partitioning "
                       f"layout names {len(self.outputs)}; {fix}")
    minor_sizes = {f: self.sizes[f] for labels in self.inputs for d in labels for f in d[1:]}
    sizes = _factor_sizes(ba, self.inputs, input_shapes, minor_sizes)
    for shape, labels in zip(output_shapes, self.outputs):
      if len(shape) != len(labels) or any(
          all(f in sizes for f in dim) and math.prod(sizes[f] for f in dim) != size
          for dim, size in zip(labels, shape)):
        raise ValueError(f"{ba.op.name}'s partitioning layout names an output of shape "
                         f"{tuple(shape)} ({_text(labels)}), which does not fit its "
                         f"arguments' factors {sizes}; {fix}")

  def assign(self, specs_: Sequence[PartitionSpec | None],
             axis_sizes: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
    """Mesh axes for each free factor that the arguments' shardings (`specs_`) split
    (see the module docstring); factors left out are not split. A dimension's axes go
    to its major factor."""
    taken: set[str] = set()
    out: dict[str, tuple[str, ...]] = {}
    for labels, spec in zip(self.inputs, specs_):
      for dim, entry in zip(labels, _entries(spec, len(labels))):
        factor = dim[0]
        if entry is None or factor not in self.splittable or factor in out:
          continue
        axes = _axes(entry)
        if taken & set(axes) or self.sizes[factor] % math.prod(axis_sizes[a] for a in axes):
          continue
        out[factor] = axes
        taken |= set(axes)
    return out

  def spec(self, labels: Labels, assignment: Mapping[str, tuple[str, ...]]) -> PartitionSpec:
    def entry(dim):
      axes = assignment.get(dim[0])
      return None if axes is None else axes[0] if len(axes) == 1 else axes
    return PartitionSpec(*(entry(dim) for dim in labels))

  def local_call(self, ba: BoundArguments, shapes: Sequence[Sequence[int]], assignment,
                 axis_sizes: Mapping[str, int]) -> BoundArguments:
    """One device's part of the call `ba` on arrays of `shapes`, split by `assignment`."""
    return ba.with_array_shapes([
        tuple(size // math.prod(axis_sizes[a] for a in assignment.get(dim[0], ()))
              for dim, size in zip(labels, shape))
        for labels, shape in zip(self.inputs, shapes)])

  def natural_spec(self, labels: Labels, specs_: Sequence[PartitionSpec]) -> PartitionSpec:
    """How an array of `labels` is split where each factor keeps the mesh axes of its
    first split dimension among the arguments (`specs_`, as given): a gradient comes
    out split like its argument."""
    first: dict[str, Any] = {}
    # The arguments most like the output first (attention's out: the query's batch,
    # not the keys').
    shared = lambda i: -len({f for d in self.inputs[i] for f in d} & {f for d in labels for f in d})
    for i in sorted(range(len(self.inputs)), key=shared):
      arg_labels, spec = self.inputs[i], specs_[i]
      for dim, entry in zip(arg_labels, _entries(spec, len(arg_labels))):
        if entry is not None:
          first.setdefault(dim[0], entry)
    used: set[str] = set()
    out = []
    for dim in labels:
      entry = first.get(dim[0])
      axes = _axes(entry)
      out.append(None if not axes or used & set(axes) else entry)
      used |= set(axes)
    return PartitionSpec(*out)

  def summed_axes(self, assignment: Mapping[str, tuple[str, ...]]) -> list[tuple[str, ...]]:
    """For each output, the mesh axes of the split factors it is a sum over."""
    split = {f for labels in self.inputs for dim in labels for f in dim if f in assignment}
    return [tuple(a for f in sorted(split - {f for dim in labels for f in dim})
                  for a in assignment[f]) for labels in self.outputs]

  def local_body(self, ba: BoundArguments, run_for, assignment) -> Callable[..., Any]:
    """fn(*local array leaves) -> output: the call rebound to the shard's shapes and
    marked so, its partial sums added across the devices that hold the other parts."""
    summed = self.summed_axes(assignment)

    def body(*arrays):
      local = ba.with_array_shapes([x.shape for x in arrays])
      leaves, tree = jax.tree.flatten(markers.mark(local, run_for(local))(*arrays))
      self.check_outputs(ba, [x.shape for x in arrays], [x.shape for x in leaves])
      return tree.unflatten([jax.lax.psum(x, axes) if axes else x for x, axes in zip(leaves, summed)])

    return body

  def output_shardings(self, make: Callable[[PartitionSpec], Any], assignment) -> Any:
    """`make(spec)` of each output, in the outputs' structure."""
    return self.output_tree.unflatten([make(self.spec(labels, assignment)) for labels in self.outputs])

  def sharding_rule(self) -> tuple[str, tuple[str, ...], dict[str, int]]:
    """The Shardy rule ("b t, b -> b t"), the factors it must not split, and the sizes
    of the factors that stand only inside parentheses."""
    def side(groups):
      return ", ".join(_text(labels) for labels in groups)
    # Shardy numbers factors in order of appearance and wants the special ones in it.
    factors = dict.fromkeys(f for labels in self.inputs + self.outputs for dim in labels for f in dim)
    whole = {dim[0] for labels in self.inputs + self.outputs for dim in labels if len(dim) == 1}
    return (f"{side(self.inputs)} -> {side(self.outputs)}",
            tuple(f for f in factors if f not in self.splittable),
            {f: self.sizes[f] for f in factors if f not in whole})


def _axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, an axis name or a tuple of them)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entries(spec: PartitionSpec | None, rank: int) -> tuple[Any, ...]:
  """A PartitionSpec's entries, padded with None to `rank`."""
  entries = tuple(spec or ())
  return entries + (None,) * (rank - len(entries))


def _factor_sizes(ba: BoundArguments, inputs: Sequence[Labels], shapes: Sequence[Sequence[int]],
                  known: dict[str, int]) -> dict[str, int]:
  """Every factor's size in arrays of `shapes`, from its whole dimensions, and from
  parenthesised ones given the sizes of their other factors (`known`).

  Raises:
    ValueError: for a rank the labels do not match, a factor of two sizes, or one
      whose size nothing gives.
  """
  fix = "fix the op's `_partitioning`."
  sizes = dict(known)

  def record(factor, size):
    if sizes.setdefault(factor, size) != size:
      raise ValueError(f"{ba.op.name}'s partitioning layout gives factor {factor!r} the "
                       f"sizes {sizes[factor]} and {size}; {fix}")

  pending = []
  for labels, shape in zip(inputs, shapes, strict=True):
    if len(labels) != len(shape):
      raise ValueError(f"{ba.op.name}'s partitioning layout names {len(labels)} dimensions "
                       f"({_text(labels)}) of an array of shape {tuple(shape)}; {fix}")
    for dim, size in zip(labels, shape):
      (record(dim[0], size) if len(dim) == 1 else pending.append((dim, size)))
  for dim, size in pending:
    unknown = [f for f in dim if f not in sizes]
    if len(unknown) > 1:
      raise ValueError(f"{ba.op.name}'s partitioning layout gives no size for {unknown} of "
                       f"({' '.join(dim)}); name them in `sizes`; {fix}")
    rest = math.prod(sizes[f] for f in dim if f not in unknown)
    if unknown:
      record(unknown[0], size // rest if rest else 0)
    if math.prod(sizes[f] for f in dim) != size:
      raise ValueError(f"{ba.op.name}'s partitioning layout's ({' '.join(dim)}) has "
                       f"{math.prod(sizes[f] for f in dim)} elements, its dimension {size}; {fix}")
  return sizes


def _argument_labels(ba: BoundArguments, layout: ShardingLayout) -> tuple[list[Labels], list[str]]:
  """The labels of each array leaf of the arguments, in their flattening order, and
  each leaf's path (`jax.tree_util.keystr` of {name: argument})."""
  out, paths = [], []
  for name in sorted(ba.arguments):  # jax.tree flattens dicts in key order
    value = ba.arguments[name]
    leaves = ba.array_specs_of(name)
    if not leaves:
      continue
    given = jax.tree_util.tree_flatten_with_path({name: layout.arguments.get(name)})[0]
    if len(given) != len(leaves):
      raise ValueError(f"{ba.op.name}'s partitioning layout names {len(given)} arrays for "
                       f"argument {name!r}, which holds {len(leaves)} ({value!r}); fix the "
                       "op's `_partitioning`.")
    out += [_dims(s) for _, s in given]
    paths += [jax.tree_util.keystr(p) for p, _ in given]
  return out, paths


def _supported(ba: BoundArguments, plan: _Plan, assignment: dict[str, tuple[str, ...]],
               shapes: Sequence[Sequence[int]], axis_sizes: Mapping[str, int]
               ) -> dict[str, tuple[str, ...]]:
  """`assignment`, or none where the op does not take the shard's shapes (a kernel
  whose tiles need a multiple of 128 columns, given 64): then every device runs the
  whole call."""
  if not assignment:
    return assignment
  try:
    ba.op._check_supported(dict(plan.local_call(ba, shapes, assignment, axis_sizes).arguments))
  except NotImplementedError:
    return {}
  return assignment


def _explicit_mesh(arrays: Sequence[Any]) -> Any:
  """The mesh of the first array whose type carries a sharding over Explicit axes (of
  more than one device) that a `shard_map` here may go manual over."""
  for x in arrays:
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or mesh.size == 1:
      continue
    if _explicit_axes(mesh):
      return mesh
  return None


def _explicit_axes(mesh: Any) -> set[str]:
  """The mesh's Explicit axes but those a `vmap` around this call splits its batch over:
  jax's shard_map does not go manual over those (since jax 0.12.1 it raises "all mesh
  axes are already manual" where none is left), and the vmap has split the work over
  them already."""
  vmapped = _jax_core.get_axis_env().explicit_mesh_axis_names
  return {n for n, t in zip(mesh.axis_names, mesh.axis_types)
          if t == jax.sharding.AxisType.Explicit and n not in vmapped}


def _shard_mapped(ba: BoundArguments, plan: _Plan, run_for, mesh, arrays) -> Any:
  """The call per shard under `jax.shard_map` (Explicit axes: shardings in the types)."""
  specs_ = [jax.typeof(x).sharding.spec for x in arrays]
  shapes, axis_sizes = [x.shape for x in arrays], dict(mesh.shape)
  assignment = _supported(ba, plan, plan.assign(specs_, axis_sizes), shapes, axis_sizes)
  in_specs = tuple(plan.spec(labels, assignment) for labels in plan.inputs)
  # Dimensions of factors that are not split are gathered first.
  arrays = [_resharded(x, mesh, s) for x, s in zip(arrays, in_specs)]
  # Manual over the Explicit axes only (a user's shard_map may have made others manual).
  explicit = _explicit_axes(mesh)
  some_axes = {} if explicit == set(mesh.axis_names) else {"axis_names": explicit}
  # Checked as the code around it is: inside a user's checked shard_map over other axes,
  # an unchecked map would type its values as varying over none of those (and JAX's
  # derivatives inside then refuse cotangents that do).
  out = jax.shard_map(plan.local_body(ba, run_for, assignment), mesh=mesh, in_specs=in_specs,
                      out_specs=plan.output_shardings(lambda s: s, assignment),
                      check_vma=_jax_config._check_vma.value, **some_axes)(*arrays)
  # Types carry shardings here, and a gradient must have its argument's (custom_vjp
  # checks); other outputs leave split as their factors come in.
  leaves, tree = jax.tree.flatten(out)
  wanted = [specs_[twin] if twin is not None and len(plan.inputs[twin]) == len(labels)
            else plan.natural_spec(labels, specs_) for labels, twin in zip(plan.outputs, plan.twins)]
  return tree.unflatten([_resharded(x, mesh, s) for x, s in zip(leaves, wanted)])


def _resharded(x: Any, mesh: Any, spec: PartitionSpec) -> Any:
  """`x` split by `spec` over `mesh` (Explicit axes: in its type), moved only if not so."""
  if jax.typeof(x).sharding.spec == spec:
    return x
  return jax.sharding.reshard(x, NamedSharding(mesh, spec))


# Whole call's marker -> the calls one device runs where XLA's partitioner placed it, one
# per placement (insertion-ordered, no repeats): one whole call can sit at several sites
# of a program, split differently at each or not at all.
_PER_DEVICE: dict[str, dict[BoundArguments, None]] = {}

PARTITIONED_CALL = "CustomSPMDPartitioning"
"""The custom call that stands for a kernel XLA partitions (Auto axes) in lowered text."""


def per_device_calls(lowered: Any, text: str | None = None) -> dict[str, BoundArguments]:
  """The calls each device runs in a program whose kernels XLA partitions when it
  compiles it (Auto axes), by the marker of the whole call.

  Args:
    lowered: the program, a `jax.stages.Lowered`.
    text: `lowered.as_text()`, where the caller has it (a large program's takes long).

  Returns:
    marker JSON of a whole call -> the `BoundArguments` one device runs at its sites, in
    the order XLA placed them: its part where a site is split, the whole call where a
    site is not. A call XLA does not partition (a program for one device) is not in it.
  """
  text = lowered.as_text() if text is None else text
  digest = hashlib.sha256(text.encode()).hexdigest()
  if digest in _ANALYSED:  # (compiled again, the program would hit JAX's caches)
    return dict(_ANALYSED[digest])
  # Compiled here, so that the partition callbacks record the per-device calls. Every
  # cache whose hit skips the partitioner is passed by: the persistent one (off), the
  # executable a `Lowered` keeps from its first compile and JAX's in-memory one, keyed
  # by the compiler options too (an option set to its default value). After the user
  # had compiled the program, they recorded nothing, and the whole calls were tuned.
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    markers_in = set(markers.find_markers(text))
    for marker in markers_in:
      _PER_DEVICE.pop(marker, None)
    lowered.compile(compiler_options=_OWN_COMPILE)
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
  found = {m: tuple(_PER_DEVICE.pop(m)) for m in markers_in if m in _PER_DEVICE}
  if len(_ANALYSED) >= _ANALYSED_LIMIT:
    _ANALYSED.pop(next(iter(_ANALYSED)))
  _ANALYSED[digest] = found
  return dict(found)


# A compiler option at its default value: it keys `per_device_calls`' compiles apart from
# the user's in JAX's in-memory cache.
_OWN_COMPILE = {"xla_embed_ir_in_executable": False}
# Programs analysed by `per_device_calls` (SHA-256 of the lowered text -> its result),
# oldest first: the same text is partitioned the same way.
_ANALYSED: dict[str, dict[str, tuple[BoundArguments, ...]]] = {}
_ANALYSED_LIMIT = 64


def _tuned_calls_of(results: tuple[Any, ...], op: Any) -> tuple[Any, ...]:
  """What the active results hold for `op`'s calls of any shapes: (call, config)."""
  return tuple((e.bound_args, e.best_config) for r in results if isinstance(r, Iterable)
               for e in r if e.bound_args.op == op)


def _custom_partitioned(ba: BoundArguments, plan: _Plan, run_for) -> Callable[..., Any]:
  """The call under `custom_partitioning` (Auto axes: placed when XLA partitions), marked
  as the whole call."""
  # The per-device calls are resolved when XLA partitions the program, after this trace:
  # JAX's caches must know that this trace depends on what the active results hold for
  # the op (whatever the shapes), and resolution then must see the results active now.
  resolution.ask_active_results(_tuned_calls_of, ba.op.replace(config=None))
  context = resolution.snapshot()
  rule, replicated, factor_sizes = plan.sharding_rule()

  def placement(mesh, arg_shapes):
    shardings = [s.sharding for s in arg_shapes]
    if not all(isinstance(s, NamedSharding) for s in shardings):
      return {}  # no mesh to name axes by: the whole call on every device
    shapes, axis_sizes = [s.shape for s in arg_shapes], dict(mesh.shape)
    return _supported(ba, plan, plan.assign([s.spec for s in shardings], axis_sizes),
                      shapes, axis_sizes)

  def partition(mesh, arg_shapes, result_shape):
    assignment = placement(mesh, arg_shapes)
    # What each device runs at this site, for capture (`per_device_calls`).
    if len(_PER_DEVICE) > 4096:  # a long-lived process compiling ever new calls
      _PER_DEVICE.clear()
    local = (plan.local_call(ba, [s.shape for s in arg_shapes], assignment, dict(mesh.shape))
             if assignment else ba)
    _PER_DEVICE.setdefault(ba.to_marker(), {})[local] = None
    results = plan.output_shardings(lambda s: NamedSharding(mesh, s), assignment)
    args = tuple(NamedSharding(mesh, plan.spec(labels, assignment)) for labels in plan.inputs)
    # Marked as the device's call: the compiled program's instructions (what profiles
    # name) carry it; the lowered program has the whole call's marker, outside.
    body = plan.local_body(ba, run_for, assignment)

    def lower(*local):
      with resolution.restored(context):
        return body(*local)

    return mesh, lower, results, args

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return plan.output_shardings(lambda s: NamedSharding(mesh, s), placement(mesh, arg_shapes))

  def call(*arrays):
    # The body for a program compiled for one device (JAX inlines it then). Whether the
    # call is split is known only when the program is lowered: a missing config must
    # fire the miss policy only where the whole call runs, so the body is resolved then.
    fn = custom_partitioning(_resolved_when_lowered(ba, run_for, context))
    fn.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=replicated, **factor_sizes)
    return markers.mark(ba, fn)(*arrays)

  return call


class _Deferred:
  """A whole call whose config is resolved when it is lowered (`_whole_call_p`): the
  call, how to run it, the context of its trace (`resolution.snapshot`), and its output
  avals and effects. Hashed and compared by identity, as a primitive's parameter."""

  __slots__ = ("ba", "run_for", "context", "out_avals", "effects")

  def __init__(self, ba, run_for, context, out_avals, effects):
    self.ba, self.run_for, self.context = ba, run_for, context
    self.out_avals, self.effects = out_avals, effects


_whole_call_p = _jax_core.Primitive("stellarax_whole_call")
_whole_call_p.multiple_results = True
_whole_call_p.def_effectful_abstract_eval(
    lambda *avals, deferred: (deferred.out_avals, deferred.effects))


def _lower_whole_call(ctx, *values, deferred: _Deferred):
  # Traced again under the results and settings of the call's trace, the miss policy
  # included: "error" raises and "autotune" tunes, as for a call of a one-device process.
  with resolution.restored(deferred.context):
    flat = lambda *arrays: jax.tree.leaves(deferred.run_for(deferred.ba)(*arrays))
    return mlir.lower_fun(flat, multiple_results=True)(ctx, *values)


mlir.register_lowering(_whole_call_p, _lower_whole_call)


def _resolved_when_lowered(ba: BoundArguments, run_for, context) -> Callable[..., Any]:
  """`run_for(ba)` as one primitive that runs it, resolved when the program is lowered
  (custom_partitioning's body for one device: JAX lowers it only where it inlines it)."""
  def body(*arrays):
    # The types (and effects) of its outputs, from a trace under the "heuristics" policy.
    with resolution.miss_policy_scope("heuristics"):
      jaxpr, shapes = jax.make_jaxpr(run_for(ba), return_shape=True)(*arrays)
    deferred = _Deferred(ba, run_for, context, tuple(jaxpr.out_avals), jaxpr.effects)
    outs = _whole_call_p.bind(*arrays, deferred=deferred)
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)

  return body
