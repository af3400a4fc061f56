"""Running an op's kernel on each device's shard of its arrays.

XLA partitions its own operations across the devices of a mesh, but a Pallas kernel is
an opaque custom call to it. Given arrays sharded over a mesh whose axes are Auto, XLA
gathers them whole onto every device and each device computes the whole call; over
Explicit axes (`jax.make_mesh`'s default) a kernel does not even trace, as its refs
would be sharded. An op that says how its arrays line up (`Op._partitioning` returns a
`ShardingLayout`) runs on each device's shard instead:

- A `ShardingLayout` names every dimension of every array argument and output with a factor;
  dimensions that share a factor are one and the same (attention's batch in the query,
  the keys, the output and the log-sum-exp). Factors in `free` may be split across
  devices; the others are gathered. An output that lacks a free factor of the inputs
  is a sum over it (the bias gradient over the batch, a norm's scale gradient over the
  rows, the lhs gradient of a matmul over its split columns): each device's partial
  sum is added to the others' (`psum`).
- Which mesh axes split a factor follows the arguments' shardings: the first argument
  dimension with that factor and sharded axes gives them, where they divide the
  factor's size and no other factor took them.
- Per shard the call is bound anew to the shard's shapes, and its config is resolved
  for them: tuned results and heuristics apply per shard shape, which is what each
  device runs (tune with per-device shapes).

Two ways in, one per kind of mesh axis:

- Explicit axes: the arrays' types carry their shardings, so the call is wrapped in
  `jax.shard_map` when it is traced.
- Auto axes: the shardings are known only when XLA partitions the program, so the call
  is wrapped in `custom_partitioning`, whose partition callback places it then (its
  Shardy rule, built from the same layout, guides propagation).

With a single device nothing is wrapped. Under `jax.vmap` every vmap level is one
more free factor in front of the batched arrays and of every output.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from stellarax.core import markers
from stellarax.core.bound_args import BoundArguments

Labels = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ShardingLayout:
  """How one op call's arrays line up, for running it per shard.

  Attributes:
    arguments: argument name -> the factor names of its dimensions, one
      space-separated string per array ("b t h d"), or a pytree of such strings for
      a pytree argument (residuals); arguments that are None or hold no array may be
      left out.
    outputs: the implementation's output as a pytree of such strings (None where
      it returns None).
    free: the factors that may be split across devices.
  """

  arguments: Mapping[str, Any]
  outputs: Any
  free: frozenset[str]


def broadcast_labels(shape: Sequence[int], labels: str, name: str) -> str:
  """The labels of an array that broadcasts against `labels` (aligned on the right):
  its dimensions of size 1 get factors of their own (`<name>_<dim>`), as a broadcast
  dimension is not split with the one it broadcasts against.

  Args:
    shape: the array's shape (rank at most that of `labels`).
    labels: the space-separated factors of the shape it broadcasts to.
    name: the argument's name, for the factors of its size-1 dimensions.

  Returns:
    Space-separated factors, one per dimension of `shape`.
  """
  full = labels.split()[len(labels.split()) - len(shape):]
  return " ".join(f"{name}_{i}" if size == 1 else factor for i, (size, factor) in enumerate(zip(shape, full)))


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
  whole = markers.mark(ba, run_for(ba))
  layout = ba.op._partitioning(ba.arguments)
  if layout is None:
    return whole

  def call(*arrays):
    mesh = _explicit_mesh(arrays)
    if mesh is not None:
      return _shard_mapped(ba, _Plan.of(ba, layout), run_for, mesh, arrays)
    if jax.device_count() > 1:
      return markers.mark(ba, _custom_partitioned(ba, _Plan.of(ba, layout), run_for))(*arrays)
    return whole(*arrays)

  return call


@dataclasses.dataclass(frozen=True)
class _Plan:
  """A layout flattened to the call's array leaves, vmap factors in front."""

  inputs: tuple[Labels, ...]
  outputs: tuple[Labels, ...]
  output_tree: Any  # the outputs' pytree structure
  free: frozenset[str]

  @classmethod
  def of(cls, ba: BoundArguments, layout: ShardingLayout) -> _Plan:
    levels = len(ba.vmap_axes)
    inputs = []
    for i, labels in enumerate(_argument_labels(ba, layout)):
      # Batched leaves have the vmapped dimensions in front, outermost level first.
      front = tuple(f"vmap{j}" for j in reversed(range(levels)) if ba.vmap_axes[j][1][i])
      inputs.append(front + labels)
    every_level = tuple(f"vmap{j}" for j in reversed(range(levels)))
    outputs = tuple(every_level + tuple(s.split()) for s in jax.tree.leaves(layout.outputs))
    free = frozenset(layout.free) | set(every_level)
    plan = cls(tuple(inputs), outputs, jax.tree.structure(layout.outputs), free)
    plan._check_sizes(ba.batched_array_specs(), ba)
    return plan

  def _check_sizes(self, specs_: Sequence[Any], ba: BoundArguments) -> None:
    """Every input's labels match its rank, and a factor has one size."""
    sizes: dict[str, int] = {}
    for labels, spec in zip(self.inputs, specs_, strict=True):
      if len(labels) != len(spec.shape):
        raise ValueError(f"{ba.op.name}'s partitioning layout names {len(labels)} dimensions "
                         f"({' '.join(labels)}) of an array of shape {spec.shape}; fix the "
                         "op's `_partitioning`.")
      for label, size in zip(labels, spec.shape):
        if sizes.setdefault(label, size) != size:
          raise ValueError(f"{ba.op.name}'s partitioning layout gives factor {label!r} the "
                           f"sizes {sizes[label]} and {size}; fix the op's `_partitioning`.")

  def check_outputs(self, ba: BoundArguments, input_shapes: Sequence[Sequence[int]],
                    output_shapes: Sequence[Sequence[int]]) -> None:
    """The outputs are as many as the layout names, of its ranks, and each dimension of
    a factor of the inputs has that factor's size.

    Raises:
      ValueError: saying which output does not fit, and that the layout needs a fix.
    """
    fix = "fix the op's `_partitioning`."
    if len(output_shapes) != len(self.outputs):
      raise ValueError(f"{ba.op.name} returned {len(output_shapes)} arrays, but its partitioning "
                       f"layout names {len(self.outputs)}; {fix}")
    sizes = {label: size for labels, shape in zip(self.inputs, input_shapes)
             for label, size in zip(labels, shape)}
    for shape, labels in zip(output_shapes, self.outputs):
      if len(shape) != len(labels) or any(sizes.get(label, size) != size
                                          for label, size in zip(labels, shape)):
        raise ValueError(f"{ba.op.name}'s partitioning layout names an output of shape "
                         f"{tuple(shape)} ({' '.join(labels)}), which does not fit its "
                         f"arguments' factors {sizes}; {fix}")

  def assign(self, shapes: Sequence[Sequence[int]], specs_: Sequence[PartitionSpec | None],
             axis_sizes: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
    """Mesh axes for each free factor that the arguments' shardings split (see the
    module docstring); factors left out are not split."""
    taken: set[str] = set()
    out: dict[str, tuple[str, ...]] = {}
    for labels, shape, spec in zip(self.inputs, shapes, specs_):
      entries = tuple(spec or ()) + (None,) * (len(labels) - len(tuple(spec or ())))
      for label, size, entry in zip(labels, shape, entries):
        if entry is None or label not in self.free or label in out:
          continue
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        if taken & set(axes) or size % math.prod(axis_sizes[a] for a in axes):
          continue
        out[label] = axes
        taken |= set(axes)
    return out

  def spec(self, labels: Labels, assignment: Mapping[str, tuple[str, ...]]) -> PartitionSpec:
    def entry(label):
      axes = assignment.get(label)
      return None if axes is None else axes[0] if len(axes) == 1 else axes
    return PartitionSpec(*(entry(label) for label in labels))

  def natural_spec(self, labels: Labels, specs_: Sequence[PartitionSpec]) -> PartitionSpec:
    """How an array of `labels` is split where each factor keeps the mesh axes of its
    first split dimension among the arguments (`specs_`, as given): a gradient comes
    out split like its argument."""
    first: dict[str, Any] = {}
    for arg_labels, spec in zip(self.inputs, specs_):
      for label, entry in zip(arg_labels, tuple(spec) + (None,) * len(arg_labels)):
        if entry is not None:
          first.setdefault(label, entry)
    used: set[str] = set()
    out = []
    for label in labels:
      entry = first.get(label)
      axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
      out.append(None if not axes or used & set(axes) else entry)
      used |= set(axes)
    return PartitionSpec(*out)

  def summed_axes(self, assignment: Mapping[str, tuple[str, ...]]) -> list[tuple[str, ...]]:
    """For each output, the mesh axes of the split factors it is a sum over."""
    split_inputs = {label for labels in self.inputs for label in labels if label in assignment}
    return [tuple(a for label in sorted(split_inputs - set(labels)) for a in assignment[label])
            for labels in self.outputs]

  def local_body(self, ba: BoundArguments, run_for, assignment, *, mark: bool) -> Callable[..., Any]:
    """fn(*local array leaves) -> output: the call rebound to the shard's shapes (and
    marked so, with `mark`), its partial sums added across the devices that hold the
    other parts."""
    summed = self.summed_axes(assignment)

    def body(*arrays):
      local = ba.with_array_shapes([x.shape for x in arrays])
      run = run_for(local)
      if mark:  # the shard's own call, as tuning should see it
        run = markers.mark(local, run)
      leaves, tree = jax.tree.flatten(run(*arrays))
      self.check_outputs(ba, [x.shape for x in arrays], [x.shape for x in leaves])
      return tree.unflatten([jax.lax.psum(x, axes) if axes else x for x, axes in zip(leaves, summed)])

    return body

  def output_shardings(self, make: Callable[[PartitionSpec], Any], assignment) -> Any:
    """`make(spec)` of each output, in the outputs' structure."""
    return self.output_tree.unflatten([make(self.spec(labels, assignment)) for labels in self.outputs])

  def sharding_rule(self) -> tuple[str, tuple[str, ...]]:
    """The Shardy rule ("b t, b -> b t") and the factors it must not split."""
    def side(groups):
      return ", ".join(" ".join(labels) for labels in groups)
    # Shardy numbers factors in order of appearance and wants the special ones in it.
    factors = dict.fromkeys(label for labels in self.inputs + self.outputs for label in labels)
    return (f"{side(self.inputs)} -> {side(self.outputs)}",
            tuple(f for f in factors if f not in self.free))


def _argument_labels(ba: BoundArguments, layout: ShardingLayout) -> list[Labels]:
  """The labels of each array leaf of the arguments, in their flattening order."""
  out = []
  for name in sorted(ba.arguments):  # jax.tree flattens dicts in key order
    value = ba.arguments[name]
    leaves = ba.array_specs_of(name)
    if not leaves:
      continue
    given = layout.arguments.get(name)
    labels = [tuple(s.split()) for s in jax.tree.leaves(given)]
    if len(labels) != len(leaves):
      raise ValueError(f"{ba.op.name}'s partitioning layout names {len(labels)} arrays for "
                       f"argument {name!r}, which holds {len(leaves)} ({value!r}); fix the "
                       "op's `_partitioning`.")
    out += labels
  return out


def _supported(ba: BoundArguments, plan: _Plan, assignment: dict[str, tuple[str, ...]],
               shapes: Sequence[Sequence[int]], axis_sizes: Mapping[str, int]
               ) -> dict[str, tuple[str, ...]]:
  """`assignment`, or none where the op does not take the shard's shapes (a kernel
  whose tiles need a multiple of 128 columns, given 64): then every device runs the
  whole call."""
  if not assignment:
    return assignment
  local = []
  for labels, shape in zip(plan.inputs, shapes):
    local.append(tuple(size // math.prod(axis_sizes[a] for a in assignment.get(label, ()))
                       for label, size in zip(labels, shape)))
  try:
    ba.op._check_supported(dict(ba.with_array_shapes(local).arguments))
  except NotImplementedError:
    return {}
  return assignment


def _explicit_mesh(arrays: Sequence[Any]) -> Any:
  """The mesh of the first array whose type carries a sharding over Explicit axes (of
  more than one device)."""
  for x in arrays:
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or mesh.size == 1:
      continue
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
      return mesh
  return None


def _shard_mapped(ba: BoundArguments, plan: _Plan, run_for, mesh, arrays) -> Any:
  """The call per shard under `jax.shard_map` (Explicit axes: shardings in the types)."""
  specs_ = [jax.typeof(x).sharding.spec for x in arrays]
  shapes, axis_sizes = [x.shape for x in arrays], dict(mesh.shape)
  assignment = _supported(ba, plan, plan.assign(shapes, specs_, axis_sizes), shapes, axis_sizes)
  in_specs = tuple(plan.spec(labels, assignment) for labels in plan.inputs)
  # Dimensions of factors that are not split are gathered first.
  arrays = [x if jax.typeof(x).sharding.spec == s else jax.sharding.reshard(x, NamedSharding(mesh, s))
            for x, s in zip(arrays, in_specs)]
  out = jax.shard_map(plan.local_body(ba, run_for, assignment, mark=True), mesh=mesh, in_specs=in_specs,
                      out_specs=plan.output_shardings(lambda s: s, assignment),
                      check_vma=False)(*arrays)
  # Types carry shardings here, and a gradient must have its argument's (custom_vjp
  # checks): each output leaves split as its factors come in.
  leaves, tree = jax.tree.flatten(out)
  wanted = [plan.natural_spec(labels, specs_) for labels in plan.outputs]
  leaves = [x if jax.typeof(x).sharding.spec == s else jax.sharding.reshard(x, NamedSharding(mesh, s))
            for x, s in zip(leaves, wanted)]
  return tree.unflatten(leaves)


def _custom_partitioned(ba: BoundArguments, plan: _Plan, run_for) -> Callable[..., Any]:
  """The call under `custom_partitioning` (Auto axes: placed when XLA partitions)."""
  fn = custom_partitioning(run_for(ba))
  rule, replicated = plan.sharding_rule()

  def placement(mesh, arg_shapes):
    shardings = [s.sharding for s in arg_shapes]
    if not all(isinstance(s, NamedSharding) for s in shardings):
      return {}  # no mesh to name axes by: the whole call on every device
    shapes, axis_sizes = [s.shape for s in arg_shapes], dict(mesh.shape)
    return _supported(ba, plan, plan.assign(shapes, [s.spec for s in shardings], axis_sizes),
                      shapes, axis_sizes)

  def partition(mesh, arg_shapes, result_shape):
    assignment = placement(mesh, arg_shapes)
    results = plan.output_shardings(lambda s: NamedSharding(mesh, s), assignment)
    args = tuple(NamedSharding(mesh, plan.spec(labels, assignment)) for labels in plan.inputs)
    # Unmarked: what XLA partitions is past the lowered program that capture reads
    # (it finds the whole call's marker, outside).
    return mesh, plan.local_body(ba, run_for, assignment, mark=False), results, args

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return plan.output_shardings(lambda s: NamedSharding(mesh, s), placement(mesh, arg_shapes))

  fn.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                   need_replication_factors=replicated)
  return fn
