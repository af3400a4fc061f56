"""Test settings: strict rank promotion, and a private user cache per run."""

import os
import tempfile

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")

# Never read or write the real user cache from tests.
os.environ["STELLARAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="stellarax-test-cache-")


@pytest.fixture
def user_cache_dir(tmp_path, monkeypatch):
  """A fresh, empty user cache folder for one test."""
  monkeypatch.setenv("STELLARAX_CACHE_DIR", str(tmp_path / "cache"))
  return tmp_path / "cache"
