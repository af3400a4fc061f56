"""The jax version check stellarax makes when it is imported."""

import subprocess
import sys

import pytest

from stellarax import _requirements


@pytest.mark.parametrize("version", ["0.11.2", "0.11.10", "0.12.0.dev20261201", "1.0.0"])
def test_this_jax_or_newer_is_taken(version):
  _requirements.require_jax(version)


@pytest.mark.parametrize("version", ["0.10.2", "0.11.1", "0.4.38"])
def test_an_older_jax_is_refused_with_what_to_do(version):
  with pytest.raises(ImportError, match=rf"needs jax 0\.11\.2 or newer; this environment has "
                                        rf"jax {version}\. Upgrade jax and jaxlib"):
    _requirements.require_jax(version)


def test_importing_stellarax_under_an_old_jax_says_so(tmp_path):
  # A stand-in jax 0.10.2 first on the path (as on a machine whose image has an older
  # jax): the import fails with the check's message, not a missing name deep inside.
  (tmp_path / "jax").mkdir()
  (tmp_path / "jax" / "__init__.py").write_text('__version__ = "0.10.2"\n')
  code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import stellarax"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "stellarax needs jax 0.11.2 or newer; this environment has jax 0.10.2" in proc.stderr
