"""Transfer of tuned configs to untuned shapes, and heuristics fitted to recorded sweeps.

Most tests build results by hand (made-up times, nothing measured), so they are fast and
say exactly which neighbour should win. The recorded-sweep tests read the CPU sweeps of
`bench/record_sweeps.py` in tests/data/sweeps/cpu/.
"""

import contextlib
import dataclasses
import importlib
import warnings
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellarax
from stellarax import autotuning
from stellarax.autotuning import cache as cache_lib
from stellarax.autotuning import transfer
from stellarax.autotuning.measure import Measurement
from stellarax.core import resolution
from stellarax.core.config import check_power_of_two, config_dataclass
from stellarax.core.op import Op
from stellarax.ops.attention.base import XlaChunkedAttentionConfig
from stellarax.ops.ragged_dot.base import XlaRaggedDotConfig
from stellarax.ops.ragged_dot.reference import ragged_dot_reference

SWEEPS = Path(__file__).resolve().parent.parent / "data" / "sweeps" / "cpu"
F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32


@config_dataclass
class ToyConfig:
  """Config of the toy op: a block size no larger than the array allows."""

  block: int = 16

  def __post_init__(self):
    check_power_of_two("block", self.block, minimum=16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyOp(Op, name="test_transfer.toy"):
  """A toy op with an identity field, for op-identity and feature-hook tests."""

  config_cls = ToyConfig
  mode: str = "a"

  def _fwd(self, x, *, config):
    return x * 2, None

  def _get_heuristics_config(self, ba):
    return ToyConfig(block=16)

  def _get_autotuning_configs(self, ba):
    n = ba.arguments["x"].shape[0]
    return {ToyConfig(block=b) for b in (16, 32, 64, 128, 256, 512) if b <= max(16, n)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyOpByColumns(ToyOp, name="test_transfer.toy_by_columns"):
  """The toy op with a transfer hook that looks at columns only."""

  def _transfer_features(self, ba):
    return {"columns": float(ba.arguments["x"].shape[1])}


def _spec(*shape, dtype=F32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _ragged(m, g=4, k=64, n=32, dtype=F32):
  return stellarax.XlaRaggedDot.bind(_spec(m, k, dtype=dtype), _spec(g, k, n, dtype=dtype),
                                     _spec(g, dtype=I32))


def _tiled(t):
  return XlaRaggedDotConfig(strategy="tiled", tile_m=t)


def _entry(ba, best, slower=2.0):
  """An entry in which `best` took 1 ms and every other config `slower` ms."""
  ms = lambda t: Measurement(status="ok", median_s=t * 1e-3, ci_low_s=t * 1e-3, ci_high_s=t * 1e-3,
                             num_samples=3)
  measurements = tuple((c, ms(1.0 if c == best else slower)) for c in ba.autotuning_configs)
  return autotuning.Entry(bound_args=ba, best_config=best, heuristic_config=ba.heuristics_config,
                          measurements=measurements)


def _result(*entries, device_kind=None):
  result = autotuning.AutotuningResult(device_kind or cache_lib.current_device_kind())
  for e in entries:
    result = result.with_entry(e)
  return result


@pytest.fixture(autouse=True)
def _empty_user_cache(user_cache_dir):
  """Every test sees an empty user cache (transfer reads caches)."""
  return user_cache_dir


def test_the_nearest_key_wins():
  result = _result(_entry(_ragged(256), _tiled(32)), _entry(_ragged(4096), _tiled(256)))
  with result:
    near_small = resolution.resolve_config(_ragged(512))
    near_large = resolution.resolve_config(_ragged(2048))
  assert near_small.config == _tiled(32) and near_large.config == _tiled(256)
  assert near_small.source == "transfer:1.00"
  assert near_small.distance == 1.0 and near_small.confidence == 0.5
  assert near_small.where == "active result" and near_small.neighbour == _ragged(256)


def test_at_equal_distance_the_innermost_result_wins():
  """Transfer looks in the active results innermost first, as resolution does: between
  two neighbours at the same distance, the inner `with` block's is taken."""
  outer = _result(_entry(_ragged(256), _tiled(32)))
  inner = _result(_entry(_ragged(256), _tiled(256)))
  with outer, inner:
    assert resolution.resolve_config(_ragged(512)).config == _tiled(256)
  with inner, outer:
    assert resolution.resolve_config(_ragged(512)).config == _tiled(32)


def test_an_entry_that_measured_only_its_heuristic_is_passed_over():
  # A budget too small to search records the heuristic alone (Entry.starved); its
  # config is its own shape's heuristic, and was handed to every neighbour instead of
  # theirs. The next neighbour that searched is taken; with none, the call's heuristic.
  small = _ragged(16)
  h = small.heuristics_config
  starved = autotuning.Entry(bound_args=small, best_config=h, heuristic_config=h,
                             measurements=((h, _entry(small, h).measurements[0][1]),))
  assert starved.starved()
  big = _ragged(256)
  assert h != big.heuristics_config  # (else passing it over would not show)
  with _result(starved):
    assert resolution.resolve_config(big).config == big.heuristics_config
    assert transfer.transfer_config(big) is None
    explained = autotuning.explain(big)  # says why nothing within reach transferred
    assert explained.untransferred == pytest.approx(4.0) and explained.too_far is None
    assert "measured only their heuristic config" in str(explained)
  searched = _entry(_ragged(4096), _tiled(128))
  with _result(starved, searched):
    assert transfer.transfer_config(big).neighbour == _ragged(4096)


def test_distance_counts_doublings_and_differing_options():
  assert transfer.transfer_distance(_ragged(256), _ragged(1024)) == pytest.approx(2.0)
  # K is a dimension of lhs and rhs: doubling it moves two features.
  assert transfer.transfer_distance(_ragged(256, k=64), _ragged(256, k=128)) == pytest.approx(math.sqrt(2))
  other_precision = stellarax.XlaRaggedDot.bind(_spec(256, 64), _spec(4, 64, 32), _spec(4, dtype=I32),
                                                preferred_element_type=jnp.float32)
  assert transfer.transfer_distance(_ragged(256), other_precision) == pytest.approx(1.0)
  assert transfer.transfer_distance(_ragged(256), _ragged(256, dtype=BF16)) is None


def test_transfer_never_returns_a_config_invalid_for_the_shape():
  # Large tiles are best on the large shapes; the small calls cannot take them.
  rng = np.random.default_rng(0)
  entries = [_entry(_ragged(m), _tiled(512)) for m in (1024, 2048, 4096)]
  entries.append(_entry(_ragged(2048, g=8), _tiled(16)))
  result = _result(*entries)
  with result:
    for m in [1, 3, 17, 40, 64, 100, 200, 255] + rng.integers(1, 9000, size=12).tolist():
      ba = _ragged(int(m))
      resolved = resolution.resolve_config(ba)
      assert resolved.config in ba.autotuning_configs, (m, resolved)
      if resolved.config == _tiled(512):
        assert 2 * m >= 512 and resolved.source.startswith("transfer:")
  # 512 rows allow tile 512 only from M = 256 on; below, the next nearest (M=2048, G=8).
  with result:
    assert resolution.resolve_config(_ragged(200)).config == _tiled(16)


def test_nothing_valid_falls_back_to_the_heuristic():
  ba = _ragged(20)
  with _result(_entry(_ragged(4096), _tiled(512))):
    resolved = resolution.resolve_config(ba)
  assert resolved == resolution.Resolution(ba.heuristics_config, "heuristics")


@pytest.mark.parametrize("mismatch", ["dtype", "device_kind", "op_fields", "op_name", "structure"])
def test_mismatches_never_transfer(mismatch):
  x = _spec(256, 8)
  tuned, query, device_kind = ToyOp.bind(x), ToyOp.bind(_spec(512, 8)), None
  if mismatch == "dtype":
    query = ToyOp.bind(_spec(512, 8, dtype=BF16))
  elif mismatch == "device_kind":
    device_kind = "NVIDIA H200"
  elif mismatch == "op_fields":
    query = ToyOp(mode="b").bind(_spec(512, 8))
  elif mismatch == "op_name":
    tuned = ToyOpByColumns.bind(x)
  else:
    query = ToyOp.bind(_spec(512, 8, 2))
  other_device = pytest.warns(autotuning.OtherDeviceWarning) if device_kind else contextlib.nullcontext()
  with other_device, _result(_entry(tuned, ToyConfig(block=128)), device_kind=device_kind):
    resolved = resolution.resolve_config(query)
  assert resolved.source == "heuristics" and resolved.config == ToyConfig(block=16)


def test_an_op_hook_chooses_the_features():
  # By columns, (16, 9) is nearer to (512, 8) than to (16, 64); by the default, not.
  result = _result(_entry(ToyOpByColumns.bind(_spec(512, 8)), ToyConfig(block=16)),
                   _entry(ToyOpByColumns.bind(_spec(16, 64)), ToyConfig(block=32)))
  with result:
    resolved = resolution.resolve_config(ToyOpByColumns.bind(_spec(32, 9)))
  assert resolved.config == ToyConfig(block=16)
  assert resolved.distance == pytest.approx(1.0)  # the hook's feature: 9 columns against 8
  assert transfer.features_of(ToyOp.bind(_spec(32, 9))) == {"log2 x.shape[0]": 5.0,
                                                            "log2 x.shape[1]": math.log2(9)}


def test_the_user_cache_is_searched(user_cache_dir):
  cache_lib.USER_CACHE.write(_result(_entry(_ragged(256), _tiled(32))))
  resolved = transfer.transfer_config(_ragged(300))
  assert resolved.config == _tiled(32) and resolved.where == "user_cache"
  assert resolution.resolve_config(_ragged(300)).source.startswith("transfer:")


def test_the_off_switch(monkeypatch):
  result = _result(_entry(_ragged(256), _tiled(32)))
  ba = _ragged(512)
  with result:
    assert resolution.resolve_config(ba).config == _tiled(32)
    with autotuning.transfer_scope(False):
      assert resolution.resolve_config(ba).source == "heuristics"
    monkeypatch.setenv("STELLARAX_TRANSFER", "0")
    assert resolution.resolve_config(ba).source == "heuristics"
    with autotuning.transfer_scope(True):
      assert resolution.resolve_config(ba).config == _tiled(32)
    monkeypatch.setenv("STELLARAX_TRANSFER", "maybe")
    with pytest.raises(ValueError, match="STELLARAX_TRANSFER='maybe' must be 1"):
      resolution.resolve_config(ba)
  with pytest.raises(TypeError, match="True or False"):
    with autotuning.transfer_scope("no"):
      pass


def test_other_miss_policies_are_not_preempted():
  with _result(_entry(_ragged(256), _tiled(32))):
    with autotuning.miss_policy_scope("error"):
      with pytest.raises(autotuning.ConfigMissError):
        resolution.resolve_config(_ragged(512))


def test_code_traced_with_transfer_on_is_traced_again_with_it_off():
  # A jitted function traced with transfer on kept running the transferred config inside
  # transfer_scope(False), while explain said heuristic.
  traces = []

  def run(lhs, rhs, group_sizes):
    traces.append(1)
    return stellarax.ragged_dot(lhs, rhs, group_sizes, implementation="xla")

  f = jax.jit(run)
  keys = jax.random.split(jax.random.key(5), 2)
  args = (jax.random.normal(keys[0], (512, 64)), jax.random.normal(keys[1], (4, 64, 32)),
          jnp.array([100, 0, 300, 50], I32))
  with _result(_entry(_ragged(256), _tiled(32))):
    f(*args)
    with transfer.transfer_scope(False):
      f(*args)
    f(*args)
  assert len(traces) == 2  # on, off; on again reuses the first


def test_explain_reports_the_transfer():
  with _result(_entry(_ragged(256), _tiled(32))):
    explanation = autotuning.explain(_ragged(512))
    plain = autotuning.explain(_ragged(512, dtype=BF16))
  assert explanation.source == "transfer:1.00" and explanation.confidence == 0.5
  assert explanation.config == _tiled(32)
  text = str(explanation)
  assert "transferred with confidence 0.50 from the nearest tuned call (active result)" in text
  assert "from transfer (key distance 1.00)" in text.splitlines()[0], text
  assert "lhs: float32[512, 64] != float32[256, 64]" in text
  assert plain.source == "heuristics" and plain.confidence is None


def test_nothing_transfers_from_beyond_the_limit_and_explain_says_why():
  # A config tuned at one size went to a call any number of times larger (attention's
  # unchunked config from T=256 to T=16384: 16 GiB of scores).
  with _result(_entry(_ragged(256), _tiled(32))):
    at_limit = autotuning.explain(_ragged(256 * 16))  # one dimension 16x: distance 4
    beyond = autotuning.explain(_ragged(256 * 32))
    with transfer.transfer_scope(False):
      heuristic = autotuning.explain(_ragged(256 * 32)).config
    assert transfer.nearest_distance(_ragged(256 * 32)) == 5.0
  assert at_limit.source == "transfer:4.00" and at_limit.config == _tiled(32)
  assert beyond.source == "heuristics" and beyond.config == heuristic != _tiled(32)
  assert beyond.too_far == 5.0
  assert "nearest comparable tuned call is at key distance 5.00, beyond 4" in str(beyond)
  assert at_limit.too_far is None
  # A call with one config has nothing to transfer or tune: no advice to tune it.
  norm = lambda rows: stellarax.XlaLayerNorm.bind(_spec(rows, 64), None, None)
  with _result(_entry(norm(8), norm(8).heuristics_config)):
    one = autotuning.explain(norm(8 * 1024))
  assert one.too_far is None and "beyond" not in str(one)


def test_explain_names_a_difference_of_type_alone():
  # 3 and 3.0 are two keys, yet the list of differences came out empty.
  explain_lib = importlib.import_module("stellarax.autotuning.explain")  # (the name is a function)
  assert explain_lib._diff({"factor": 3, "n": 2}, {"factor": 3.0, "n": 2}) == [
      "factor: 3 (int) != 3.0 (float)"]
  assert explain_lib._diff([True], [1]) == ["[0]: True (bool) != 1 (int)"]


def test_explain_under_the_error_policy_reports_the_miss_a_traced_call_raises():
  # Transfer answers only under the "heuristics" policy; explain said "transfer" where
  # the call itself raised ConfigMissError.
  with _result(_entry(_ragged(256), _tiled(32))):
    with autotuning.miss_policy_scope("error"):
      explanation = autotuning.explain(_ragged(512))
    with autotuning.miss_policy_scope("heuristics"), transfer.transfer_scope(False):
      heuristic = autotuning.explain(_ragged(512)).config
  assert explanation.source == "miss:error" and explanation.confidence is None
  assert explanation.config == heuristic
  assert "lhs: float32[512, 64] != float32[256, 64]" in str(explanation)


def test_explain_says_when_the_entry_transferred_from_is_stale():
  entry = _entry(_ragged(256), _tiled(32))
  old = dataclasses.replace(entry, versions={**entry.versions, "jax": "0.0.1"})
  with _result(old):
    explanation = autotuning.explain(_ragged(512))
  assert explanation.source.startswith("transfer:") and "jax 0.0.1 (running " in explanation.stale
  assert "transferred from a stale entry" in str(explanation)
  with _result(entry):
    assert autotuning.explain(_ragged(512)).stale is None


def test_explain_names_the_devices_a_miss_was_tuned_on(user_cache_dir):
  h200 = _result(_entry(_ragged(256), _tiled(32)), device_kind="NVIDIA H200")
  cache_lib.USER_CACHE.write(h200)
  explanation = autotuning.explain(_ragged(512))
  assert explanation.source == "heuristics" and explanation.other_device_kinds == ("NVIDIA_H200",)
  assert "tuned on other devices (NVIDIA_H200), which are not used here" in str(explanation)
  # This device's own entries: the nearest one is named, not the other devices.
  cache_lib.USER_CACHE.write(_result(_entry(_ragged(256, dtype=BF16), _tiled(32))))
  assert autotuning.explain(_ragged(512)).other_device_kinds == ()


def test_a_transferred_config_runs_and_is_right():
  k = jax.random.split(jax.random.key(5), 2)
  lhs = jax.random.normal(k[0], (200, 64), F32)
  rhs = jax.random.normal(k[1], (4, 64, 32), F32)
  gs = jnp.array([70, 0, 100, 17], I32)  # empty group, sum < M
  with _result(_entry(_ragged(256), _tiled(32))):
    assert autotuning.explain(stellarax.XlaRaggedDot.bind(lhs, rhs, gs)).config == _tiled(32)
    out = jax.jit(stellarax.ragged_dot)(lhs, rhs, gs)
  np.testing.assert_allclose(out, ragged_dot_reference(lhs, rhs, gs), rtol=2e-5, atol=2e-5)


# ---- fit_heuristics -----------------------------------------------------------------------


def _synthetic_sweeps():
  """Best tile 16 up to 256 rows, 128 above; the heuristic (tile 64 below 1024 rows with
  8 groups, else 128) is wrong up to 512 rows."""
  entries = [_entry(_ragged(m, g=8), _tiled(16 if m <= 256 else 128), slower=1.5)
             for m in (32, 64, 128, 256, 512, 1024, 2048, 4096)]
  return _result(*entries)


def test_fit_heuristics_learns_a_threshold_rule():
  fit = autotuning.fit_heuristics(_synthetic_sweeps(), "ragged_dot.xla")
  assert fit.num_keys == 8 and fit.rule.num_leaves == 2
  assert fit.rule.predict(_ragged(100, g=8)) == _tiled(16)
  assert fit.rule.predict(_ragged(3000, g=8)) == _tiled(128)
  assert "if lhs.shape[0] <= 362:" in fit.rule.text()  # between 256 and 512
  # Held out, 512 rows falls below the threshold fitted between 256 and 1024 rows.
  assert fit.rule_regret.geomean == pytest.approx(1.5 ** (1 / 8))
  assert fit.heuristic_regret.geomean == pytest.approx(1.5 ** (5 / 8))
  assert fit.heuristic_regret.worst == pytest.approx(1.5)
  assert "fixed heuristic" in str(fit) and fit.transfer_regret.num_keys == 8


def test_fit_heuristics_splits_off_the_fewest_keys_a_leaf_may_hold():
  """A rule for the two largest of eight keys (min_leaf=2): the split at the last
  position a leaf allows."""
  entries = [_entry(_ragged(m, g=8), _tiled(128 if m >= 2048 else 16), slower=1.5)
             for m in (32, 64, 128, 256, 512, 1024, 2048, 4096)]
  fit = autotuning.fit_heuristics(_result(*entries), "ragged_dot.xla", min_leaf=2)
  assert fit.rule.num_leaves == 2
  assert fit.rule.predict(_ragged(1024, g=8)) == _tiled(16)
  assert fit.rule.predict(_ragged(4096, g=8)) == _tiled(128)


def _failing(entry, config):
  failed = Measurement(status="runtime_error", error="RuntimeError: out of memory")
  return dataclasses.replace(entry, measurements=tuple(
      (c, failed if c == config else m_) for c, m_ in entry.measurements))


def test_fit_heuristics_counts_a_failed_config_as_no_answer():
  """Where the fixed heuristic config failed, its regret says so: it counted as the
  slowest config, which where one config ran was the best (1.000x)."""
  def failing_heuristic(m):
    entry = _entry(_ragged(m, g=8), _tiled(16), slower=1.5)
    assert entry.heuristic_config != _tiled(16)
    return _failing(entry, entry.heuristic_config)
  fit = autotuning.fit_heuristics(_result(*map(failing_heuristic, (64, 256, 1024, 4096))),
                                  "ragged_dot.xla")
  assert fit.heuristic_regret.failed == 4 and fit.heuristic_regret.geomean == math.inf
  assert "chose a config that failed at 4 of 4 keys" in str(fit.heuristic_regret)
  assert fit.rule_regret.failed == 0
  assert fit.rule.predict(_ragged(512, g=8)) == _tiled(16)


def test_a_fitted_rule_never_answers_a_key_it_was_fitted_on_with_a_config_that_failed_there():
  # The config fastest at most keys failed at one: the leaf ranked it first, covered the
  # key by any config of its space, and answered that key with it.
  entries = [_entry(_ragged(m, g=8), _tiled(16), slower=1.5) for m in (64, 256, 1024, 4096)]
  entries[2] = _failing(entries[2], _tiled(16))
  fit = autotuning.fit_heuristics(_result(*entries), "ragged_dot.xla", max_depth=0)
  assert fit.rule.predict(entries[2].bound_args) != _tiled(16)
  assert all(dict(e.measurements)[fit.rule.predict(e.bound_args)].ok for e in entries)


def test_a_config_no_longer_offered_is_no_answer_of_a_sweep():
  # A stale entry's fastest config is outside today's space: it was the "best" that
  # regrets were measured against, and where only it ran, printing the fit raised
  # IndexError (a leaf with an empty ranking).
  gone = _tiled(8)
  assert all(gone not in _ragged(m, g=8).autotuning_configs for m in (64, 256, 512, 1024))

  def with_gone(entry, time_s):
    ran = Measurement(status="ok", median_s=time_s, ci_low_s=time_s, ci_high_s=time_s,
                      num_samples=3)
    return dataclasses.replace(entry, measurements=entry.measurements + ((gone, ran),))

  entries = [with_gone(_entry(_ragged(m, g=8), _tiled(16), slower=1.5), 1e-4)
             for m in (64, 256, 1024)]
  fit = autotuning.fit_heuristics(_result(*entries), "ragged_dot.xla")
  assert fit.rule_regret.geomean == 1.0 and fit.rule.predict(_ragged(512, g=8)) == _tiled(16)
  failed = Measurement(status="compile_error", error="too many registers")
  only_gone = [dataclasses.replace(e, measurements=tuple(
      (c, m if c == gone else failed) for c, m in e.measurements)) for e in entries]
  with pytest.raises(ValueError, match="at least 3 full sweeps.*found 0 among 3"):
    autotuning.fit_heuristics(_result(*only_gone), "ragged_dot.xla")


def test_fit_heuristics_rejects_too_little_data():
  few = _result(*[_entry(_ragged(m), _tiled(16)) for m in (64, 128)])
  with pytest.raises(ValueError, match="at least 3 full sweeps of ragged_dot.xla"):
    autotuning.fit_heuristics(few, stellarax.XlaRaggedDot)
  partial = _entry(_ragged(512), _tiled(16))
  partial = dataclasses.replace(partial, measurements=partial.measurements[:2])
  with pytest.raises(ValueError, match="found 2 among 3 entries"):
    autotuning.fit_heuristics(few.with_entry(partial), "ragged_dot.xla")
  with pytest.raises(TypeError, match="AutotuningResult or a cache"):
    autotuning.fit_heuristics([few], "ragged_dot.xla")
  with pytest.raises(TypeError, match="pass an op's registered name"):
    autotuning.fit_heuristics(few, 3)


def test_fit_heuristics_fits_one_structure_at_a_time():
  """A float32 and a bfloat16 sweep of one shape have the same features: pooled, one rule
  would average two devices' worth of different answers. It asks which one."""
  f32 = [_entry(_ragged(m, g=8), _tiled(16)) for m in (64, 256, 1024)]
  bf16 = [_entry(_ragged(m, g=8, dtype=BF16), _tiled(128)) for m in (64, 256, 1024, 4096)]
  both = _result(*f32, *bf16)
  with pytest.raises(ValueError, match=r"2 structures.*4 of group_sizes int32 rank 1, lhs "
                     r"bfloat16 rank 2.*3 of .*lhs float32 rank 2.*like="):
    autotuning.fit_heuristics(both, "ragged_dot.xla")
  fit = autotuning.fit_heuristics(both, "ragged_dot.xla", like=_ragged(32, dtype=BF16))
  assert fit.num_keys == 4 and fit.rule.predict(_ragged(100, g=8, dtype=BF16)) == _tiled(128)
  assert "lhs bfloat16 rank 2" in fit.structure and fit.structure in str(fit)
  fit = autotuning.fit_heuristics(both, "ragged_dot.xla", like=_ragged(32))
  assert fit.num_keys == 3 and fit.rule.predict(_ragged(100, g=8)) == _tiled(16)
  with pytest.raises(TypeError, match="like=.*must be a call"):
    autotuning.fit_heuristics(both, "ragged_dot.xla", like="bf16")
  with pytest.raises(ValueError, match="like= is a call of test_transfer.toy"):
    autotuning.fit_heuristics(both, "ragged_dot.xla", like=ToyOp().bind(_spec(16, 4)))


def test_fit_heuristics_fits_one_set_of_static_options_at_a_time():
  # Causal and non-causal sweeps of the same shapes were pooled into one rule (the
  # features are shapes): one config for both, 3x off at half the keys.
  fast = XlaChunkedAttentionConfig(chunk_q=64, chunk_k=64)
  slow = XlaChunkedAttentionConfig(chunk_q=None, chunk_k=None)

  def attention(t, causal):
    q = _spec(1, t, 2, 32)
    return stellarax.XlaChunkedAttention.bind(q, q, q, is_causal=causal)

  causal = [_entry(attention(t, True), fast, slower=3.0) for t in (256, 512, 1024)]
  plain = [_entry(attention(t, False), slow, slower=3.0) for t in (256, 512, 1024, 2048)]
  both = _result(*causal, *plain)
  with pytest.raises(ValueError, match=r"2 structures or sets of static options.*4 of .*"
                     r"is_causal=false.*3 of .*is_causal=true.*like="):
    autotuning.fit_heuristics(both, "attention.xla_chunked")
  for calls, best in ((causal, fast), (plain, slow)):
    fit = autotuning.fit_heuristics(both, "attention.xla_chunked", like=calls[0].bound_args)
    assert fit.num_keys == len(calls) and fit.rule_regret.geomean == 1.0
    assert fit.rule.predict(attention(512, calls is causal)) == best
    assert f"is_causal={str(calls is causal).lower()}" in fit.structure


@pytest.mark.parametrize("options", [dict(min_gain=None), dict(min_gain="0.1"),
                                     dict(min_gain=True), dict(max_depth=2.0),
                                     dict(min_leaf=True), dict(min_gain=-0.1)])
def test_fit_heuristics_rejects_bad_options_with_the_fix(options):
  sweeps = _result(*[_entry(_ragged(m), _tiled(16)) for m in (64, 128, 256)])
  with pytest.raises(ValueError, match=f"{next(iter(options))}=.*must be"):
    autotuning.fit_heuristics(sweeps, "ragged_dot.xla", **options)


def test_rule_text_gives_thresholds_exactly():
  rule = autotuning.heuristics_fit.Rule(
      (_tiled(16),), "ratio", 0.123456789, autotuning.heuristics_fit.Rule((_tiled(16),)),
      autotuning.heuristics_fit.Rule((_tiled(128),)))
  assert "if ratio <= 0.123456789:" in rule.text()


def test_rule_text_of_a_size_agrees_with_the_rule_at_the_boundary():
  # A threshold is the midpoint of two features seen, log2(a) and log2(b); where a * b is
  # a square it can round just below log2(sqrt(a * b)), and the text printed
  # floor(2 ** t): "M <= 400" where the rule sent M=400 above (14,207 such pairs).
  text = autotuning.heuristics_fit._test_text
  checked = 0
  for a in range(1, 600, 7):
    for k in range(2, 12):
      t = (math.log2(a) + math.log2(a * k * k)) / 2
      n = int(text("log2 M", t).split("<= ")[1])
      assert math.log2(n) <= t < math.log2(n + 1), (a, k, t, n)
      checked += 1
  assert checked > 500
  assert text("log2 M", 8.5) == "M <= 362" and text("log2 M", 0.5) == "M <= 1"


# ---- the recorded sweeps ------------------------------------------------------------------


@pytest.fixture(scope="module", params=["ragged_dot.xla", "attention.xla_chunked"])
def recorded(request):
  with warnings.catch_warnings():
    # Recorded with jax 0.11.2: under another jax the loader warns, and the entries are
    # still the data under test.
    warnings.simplefilter("ignore", autotuning.VersionWarning)
    result = autotuning.AutotuningResult.load(SWEEPS / f"{request.param}.json")
  return request.param, result, autotuning.fit_heuristics(result, request.param)


def test_recorded_sweeps_are_full_sweeps(recorded):
  name, result, fit = recorded
  assert fit.num_keys == len(result) >= 12
  for entry in result:
    assert {c for c, _ in entry.measurements} >= entry.bound_args.autotuning_configs


def test_transfer_beats_the_fixed_heuristic_on_recorded_sweeps(recorded):
  name, _, fit = recorded
  assert fit.transfer_regret.geomean < fit.heuristic_regret.geomean, str(fit)


def test_fitted_rule_on_recorded_sweeps(recorded):
  name, result, fit = recorded
  for regret in (fit.rule_regret, fit.heuristic_regret, fit.transfer_regret):
    assert 1.0 <= regret.geomean <= regret.worst and regret.num_keys == fit.num_keys
  assert fit.rule.text()
  for entry in result:
    ba = entry.bound_args
    assert fit.rule.predict(ba) in ba.autotuning_configs
