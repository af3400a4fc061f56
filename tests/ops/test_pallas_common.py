"""Helpers every Pallas implementation shares."""

import pytest

from stellarax.ops.pallas_common import unpack_refs


def test_unpack_refs_spreads_present_operands_and_fills_absent_ones():
  assert unpack_refs(["q", "k", "o"], [True, False, True, False, True]) == [
      "q", None, "k", None, "o"]
  assert unpack_refs([], [False, False]) == [None, None]
  with pytest.raises(ValueError, match="2 refs for 1 present operands"):
    unpack_refs(["q", "k"], [True, False])
  with pytest.raises(ValueError, match="1 refs for 2 present operands"):
    unpack_refs(["q"], [True, True])
