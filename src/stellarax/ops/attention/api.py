"""`stellarax.dot_product_attention`: the public function and its dispatch."""

from __future__ import annotations

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
    query: (B, T, N, H).
    key, value: (B, S, K, H), N a multiple of K (GQA/MQA).
    bias: optional, broadcastable to (B, N, T, S), added to the scaled logits.
    mask: optional bool, broadcastable to (B, N, T, S); True keeps a position.
    scale: logit scale (default 1/sqrt(H)).
    is_causal: keep only keys s <= t.
    query_seq_lengths, key_value_seq_lengths: optional (B,) int lengths.
    local_window_size: None, w or (left, right).
    implementation: None (best available), a name ("xla", "xla_chunked",
      "pallas_triton", ...), an Op instance, or a sequence tried in order.

  Returns:
    (B, T, N, H) in query's dtype.

  Raises:
    ValueError: for operands that do not fit together.
    NotImplementedError: when no requested implementation supports the input.
  """
  return dispatch.call_family(
      "attention", PREFERENCE, implementation, (query, key, value, bias, mask),
      dict(scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
           key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size))
