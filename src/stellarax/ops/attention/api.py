"""`stellarax.dot_product_attention`: the public function and its dispatch."""

from __future__ import annotations

import jax.numpy as jnp

from stellarax.core import dispatch

# Tried in this order when `implementation=None` and no implementation of the
# call was measured (measurements in the active results or caches pick the
# fastest instead). On an H200 (bench/gpu_check.sh, 2026-12-04, BENCHMARKS.md) both
# Pallas kernels were correct, and Mosaic GPU ran causal T=8192 as fast as cuDNN
# (forward 0.90 ms, 12x our XLA one; forward and backward 3.75 ms, 80x our XLA one,
# which materialises the scores); a device without Mosaic GPU takes Triton, a CPU XLA.
PREFERENCE = ("pallas_mosaic_gpu", "pallas_triton", "xla_chunked", "xla")


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                          implementation=None):
  """Scaled dot-product attention, as `jax.nn.dot_product_attention` (BTNH).

  Args:
    query: (B, T, N, H), or (T, N, H) unbatched.
    key, value: (B, S, K, H), or (S, K, H) unbatched; N a multiple of K (GQA/MQA).
    bias: optional, broadcastable to (B, N, T, S) as numpy broadcasts (e.g. (T, S) or
      (N, T, S)), added to the scaled logits. The Pallas kernels raise biased logits
      below about -9.1e4 to that floor, so a row a huge bias masks whole (-1e9,
      finfo.min, -inf) averages V, as jax's rounding makes -1e9 do (jax gives NaN for
      -inf), and its gradients are jax's (flash_blocks.BIASED_LOGIT_FLOOR). An integer
      or bool bias is added as float32, as jax adds it (its gradient is float0). The
      Mosaic GPU kernels take a bias that varies over the queries in the inputs' dtype
      (rounded to bfloat16, a bias of magnitude 20 moves logits by up to 0.0625; one
      the same for every query stays float32), as cuDNN does.
    mask: optional bool, broadcastable to (B, N, T, S) as the bias; True keeps a
      position. A removed position is ignored whatever its key holds (NaN, inf), as
      are keys the sequence lengths and windows remove.
    scale: logit scale (default 1/sqrt(H)).
    is_causal: keep only keys s <= t.
    query_seq_lengths, key_value_seq_lengths: optional (B,) int lengths ((1,) unbatched).
    local_window_size: None, w or (left, right).
    implementation: None (best available), a name ("xla", "xla_chunked",
      "pallas_triton", ...), an Op instance, or a sequence tried in order.

  Returns:
    query's shape, (B, T, N, H) or (T, N, H), in query's dtype.

  Raises:
    ValueError: for operands that do not fit together (a query, key or value not of rank
      3 or 4, a bias or mask that does not broadcast to (B, N, T, S), ...), naming them.
    NotImplementedError: when no requested implementation supports the input (a list
      passes by the kernels that do not run on the device traced for, saying why).
    ValueError: from JAX, for a Pallas kernel named alone where it cannot be lowered (a
      CPU, without `interpret=True`); called eagerly, a note says how to run it.
  """
  unbatched = _rank(query) == 3
  _check_batch_dims(query, key, value)
  query, key, value = (_batched(name, x) for name, x in
                       (("query", query), ("key", key), ("value", value)))
  if bias is not None and hasattr(bias, "dtype") and not jnp.issubdtype(bias.dtype,
                                                                         jnp.floating):
    bias = jnp.asarray(bias, jnp.float32)  # the kernels add floats: jax promotes it so
  if _rank(query) == 4 and _rank(key) == 4:
    # What every implementation's kernels see: (B, N, T, S), as jax pads it.
    full = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    bias, mask = _as_4d("bias", bias, full), _as_4d("mask", mask, full)
  out = dispatch.call_family(
      "attention", PREFERENCE, implementation, (query, key, value, bias, mask),
      dict(scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
           key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size))
  return out[0] if unbatched else out


def _rank(x) -> int | None:
  """The rank of an array, or None for anything else (the op says what it needs)."""
  return len(x.shape) if hasattr(x, "shape") else None


def _check_batch_dims(query, key, value) -> None:
  """Raises ValueError when some of query, key and value have a batch dimension of
  more than one and others none (as jax does; a batch of one broadcasts, as there).
  The op would say the batches differ, of arrays the caller did not give."""
  named = {"query": query, "key": key, "value": value}
  ranks = {name: _rank(x) for name, x in named.items()}
  unbatched = [name for name, rank in ranks.items() if rank == 3]
  batched = {name: named[name].shape[0] for name, rank in ranks.items() if rank == 4}
  if unbatched and any(b != 1 for b in batched.values()):
    shapes = ", ".join(f"{name}.shape={tuple(x.shape)}" for name, x in named.items())
    verb = lambda names: "has" if len(names) == 1 else "have"
    raise ValueError(f"{' and '.join(unbatched)} {verb(unbatched)} no batch dimension while "
                     f"{' and '.join(batched)} {verb(batched)} a batch of "
                     f"{max(batched.values())} ({shapes}). Give all three a batch dimension "
                     "(B, ., ., H), or none.")


def _batched(name: str, x):
  """Returns `x` (B, ., ., H), giving an unbatched rank-3 one a batch of one.

  Raises:
    ValueError: for an array of another rank than 3 or 4.
  """
  rank = _rank(x)
  if rank == 3:
    return jnp.expand_dims(x, 0)
  if rank not in (4, None):
    layout = "(B, T, N, H) or (T, N, H)" if name == "query" else "(B, S, K, H) or (S, K, H)"
    raise ValueError(f"{name}.shape={tuple(x.shape)} must be {layout}; got {rank} dimensions. "
                     "Give it that layout, or a batch dimension of its own.")
  return x


def _as_4d(name: str, x, full: tuple[int, ...]):
  """Returns a bias or mask with leading unit dimensions up to rank 4.

  Args:
    name: "bias" or "mask", for the error.
    x: None, an array of rank <= 4, or anything else (left for the op to refuse).
    full: (B, N, T, S) of the call.

  Returns:
    None, `x` expanded to 4-D (differentiable: a gradient takes `x`'s shape), or `x`
    itself when it is 4-D or no array.

  Raises:
    ValueError: when `x` does not broadcast to `full` as numpy broadcasts.
  """
  rank = _rank(x)
  if rank is None:
    return x
  shape = tuple(x.shape)
  # numpy's rule: dimensions align from the right, each 1 or the full size.
  if rank > 4 or any(d not in (1, f) for d, f in zip(shape[::-1], full[::-1])):
    raise ValueError(
        f"{name}.shape={shape} does not broadcast to (B, N, T, S)={full}: it needs at most 4 "
        f"dimensions which, aligned from the right, are each 1 or the full size (e.g. "
        f"(T, S)={full[2:]} or (N, T, S)={full[1:]}). Reshape it to one of those.")
  return x if rank == 4 else jnp.expand_dims(x, tuple(range(4 - rank)))
