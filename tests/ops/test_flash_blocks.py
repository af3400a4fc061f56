"""The block arithmetic the flash-attention kernels share, checked by enumeration."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stellarax.ops.attention import flash_blocks
from stellarax.ops.attention import reference


@dataclasses.dataclass(frozen=True)
class Masking(flash_blocks.BlockMasking):
  s: int
  causal: bool
  window: tuple[int, int] | None
  t: int = 100
  has_q_len: bool = False
  has_kv_len: bool = False
  has_mask: bool = False


def _kept(m: Masking, i: int, j: int, t_eff: int, s_eff: int) -> bool:
  return (i < t_eff and j < s_eff and (not m.causal or j <= i)
          and (m.window is None or i - m.window[0] <= j <= i + m.window[1]))


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


# (causal, window, key length, query length); spans are 1 or 2 blocks (a Mosaic CTA of
# two warpgroups asks for the union of its warpgroups' ranges).
CASES = [(True, None, None, None), (False, (7, 3), None, None), (True, (40, 9), 61, None),
         (False, None, 33, None), (True, None, None, 70), (False, (10, 30), 50, 45),
         (True, (0, 0), 0, None)]


def _check_range(ranges, block: int, rows, keys, m: Masking, t: int, t_eff: int,
                 s_eff: int) -> bool:
  """Checks one block against a range answer; returns whether the block is visited.

  A block holding a kept pair is visited; a block run without a positional mask keeps
  every pair (rows past T aside; rows past the query length are dropped by their lse).
  """
  lo, full_lo, full_hi, hi = map(int, ranges)
  assert lo <= full_lo <= full_hi <= hi
  visited = lo <= block < hi
  assert visited or not any(_kept(m, i, j, t_eff, s_eff) for i in rows for j in keys)
  if full_lo <= block < full_hi:
    assert all(_kept(m, i, j, t, s_eff) for i in rows if i < t for j in keys)
  return visited


@pytest.mark.parametrize("span", [1, 2])
@pytest.mark.parametrize("causal,window,kv_len,q_len", CASES)
def test_block_ranges_cover_kept_pairs_and_skip_masked_blocks(causal, window, kv_len, q_len,
                                                              span):
  t, s, bq, bk = 100, 90, 32, 16
  m = Masking(s=s, causal=causal, window=window, has_q_len=q_len is not None,
              has_kv_len=kv_len is not None)
  t_eff, s_eff = (t if q_len is None else q_len), (s if kv_len is None else kv_len)
  rows_per, keys_per = bq * span, bk * span  # rows (or keys) asked about at once
  for q0, kb in itertools.product(range(0, t, rows_per), range(_cdiv(s, bk))):
    ranges = flash_blocks.key_block_range(m, q0, rows_per, bk, t_eff, s_eff)
    rows, keys = range(q0, q0 + rows_per), range(kb * bk, kb * bk + bk)
    visited = _check_range(ranges, kb, rows, keys, m, t, t_eff, s_eff)
    if causal and kb * bk > q0 + rows_per - 1:
      assert not visited, (q0, kb)  # Blocks above the diagonal are skipped.
  for k0, qb in itertools.product(range(0, s, keys_per), range(_cdiv(t, bq))):
    ranges = flash_blocks.query_block_range(m, k0, bq, keys_per, t_eff, s_eff)
    keys = [j for j in range(k0, k0 + keys_per) if j < s]
    _check_range(ranges, qb, range(qb * bq, qb * bq + bq), keys, m, t, t_eff, s_eff)


def test_positional_ok_matches_enumeration():
  m = Masking(s=40, causal=True, window=(5, 2), has_kv_len=True)
  q_pos, k_pos = np.arange(30)[:, None], np.arange(40)[None, :]
  ok = np.asarray(flash_blocks.positional_ok(m, jnp.asarray(q_pos), jnp.asarray(k_pos), 33))
  expected = np.array([[_kept(m, i, j, 30, 33) for j in range(40)] for i in range(30)])
  np.testing.assert_array_equal(ok, expected)


def test_masking_properties():
  assert Masking(s=64, causal=True, window=None).right_reach == 0
  assert Masking(s=64, causal=True, window=(3, 5)).right_reach == 0
  assert Masking(s=64, causal=False, window=(3, 5)).right_reach == 5
  assert Masking(s=64, causal=False, window=None).left_reach is None
  assert not Masking(s=64, causal=True, window=None).may_fully_mask  # key 0 is kept
  assert Masking(s=64, causal=True, window=None, has_mask=True).may_fully_mask
  assert not Masking(s=64, causal=False, window=None).positional(32)
  assert Masking(s=64, causal=False, window=None).positional(48)  # a tail block


def test_rows_with_no_key_match_jax():
  """dead_rows and fully_masked_dv against the reference's lse and its dV (a batch
  element whose keys are all masked averages V with weights 1/S)."""
  keys = jax.random.split(jax.random.key(0), 4)
  b, t, s, n, k, h = 2, 8, 6, 4, 2, 16
  q = jax.random.normal(keys[0], (b, t, n, h))
  kk = jax.random.normal(keys[1], (b, s, k, h))
  v = jax.random.normal(keys[2], (b, s, k, h))
  dout = jax.random.normal(keys[3], (b, t, n, h))
  kv_len, q_len = jnp.array([0, 6], jnp.int32), jnp.array([5, 8], jnp.int32)
  options = dict(key_value_seq_lengths=kv_len, query_seq_lengths=q_len)
  _, lse = reference.attention_reference_with_lse(q, kk, v, **options)
  dead = np.asarray(flash_blocks.dead_rows(lse, q_len))
  assert dead[0].all() and not dead[1].any()
  assert np.asarray(flash_blocks.dead_rows(lse, None))[0].all()
  _, vjp = jax.vjp(lambda v: reference.attention_reference(q, kk, v, **options), v)
  (dv,) = vjp(dout)
  term = flash_blocks.fully_masked_dv(lse, dout, q_len, num_kv_heads=k, s=s)
  # Batch 0 keeps no key: its dV is only this term, on every key row; batch 1 has none.
  np.testing.assert_allclose(dv[0], jnp.broadcast_to(term[0][None], (s, k, h)), rtol=1e-5,
                             atol=1e-6)
  assert not np.any(np.asarray(term[1]))


@pytest.mark.parametrize("window,expected", [(None, None), (3, (3, 3)), ((2, 0), (2, 0))])
def test_normalize_window(window, expected):
  assert flash_blocks.normalize_window(window) == expected


@pytest.mark.parametrize("window", [(-1, 2), (1, 2, 3), 1.5, (True, 1)])
def test_normalize_window_rejects(window):
  with pytest.raises(ValueError, match="local_window_size"):
    flash_blocks.normalize_window(window)


def test_windows_the_kernels_take():
  flash_blocks.require_window_the_kernels_take(None)
  flash_blocks.require_window_the_kernels_take((0, 4))
  with pytest.raises(NotImplementedError, match="negative side"):
    flash_blocks.require_window_the_kernels_take((3, -1))


def test_effective_lengths_clip_to_the_sequences():
  m = Masking(s=90, causal=False, window=None, t=100)
  assert flash_blocks.effective_lengths(m, None, None) == (100, 90)
  t_eff, s_eff = flash_blocks.effective_lengths(m, jnp.int32(120), jnp.int32(-3))
  assert (int(t_eff), int(s_eff)) == (100, 0)
  t_eff, s_eff = flash_blocks.effective_lengths(m, jnp.int32(7), None)
  assert (int(t_eff), s_eff) == (7, 90)


def test_check_seq_lengths():
  flash_blocks.check_seq_lengths("q", None, 2)
  flash_blocks.check_seq_lengths("q", jnp.zeros((2,), jnp.int32), 2)
  with pytest.raises(ValueError, match=r"q has shape \(3,\) and dtype int32; expected \(2,\)"):
    flash_blocks.check_seq_lengths("q", jnp.zeros((3,), jnp.int32), 2)
