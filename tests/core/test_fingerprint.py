"""core/fingerprint.py: which code an op's fingerprint covers, and that edits change it."""

import importlib
import sys
import types

import stellarax
from stellarax.core import fingerprint


def test_an_ops_closure_is_its_kernel_code_not_the_tuning_machinery():
  closure = fingerprint.module_closure(stellarax.PallasTritonRaggedDot.__module__)
  assert {"stellarax.ops.ragged_dot.pallas_triton", "stellarax.ops.pallas_common",
          "stellarax.ops.ragged_dot.base"} <= set(closure)
  assert all(name.startswith("stellarax.ops.") for name in closure)
  mosaic = fingerprint.module_closure(stellarax.PallasMosaicGpuRaggedDot.__module__)
  assert "stellarax.ops.ragged_dot.pallas_mosaic_gpu.forward" in mosaic
  assert fingerprint.code_fingerprint(stellarax.PallasTritonRaggedDot) != \
      fingerprint.code_fingerprint(stellarax.PallasMosaicGpuRaggedDot)


def test_editing_any_module_of_the_closure_changes_the_fingerprint(tmp_path, monkeypatch):
  package = tmp_path / "fp_plugin"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "helper.py").write_text("def tile():\n  return 64\n")
  (package / "unrelated.py").write_text("X = 1\n")
  (package / "kernel.py").write_text(
      "import json\nfrom fp_plugin.helper import tile\n\nclass Kernel:\n  pass\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  kernel = importlib.import_module("fp_plugin.kernel")
  importlib.import_module("fp_plugin.unrelated")
  try:
    # Its own package only: json is not its code, and a module it does not reach is not.
    assert fingerprint.module_closure("fp_plugin.kernel") == ["fp_plugin.helper", "fp_plugin.kernel"]
    before = fingerprint.code_fingerprint(kernel.Kernel)
    assert len(before) == 16
    (package / "unrelated.py").write_text("X = 2\n")
    fingerprint.code_fingerprint.cache_clear()
    assert fingerprint.code_fingerprint(kernel.Kernel) == before
    (package / "helper.py").write_text("def tile():\n  return 64  # retuned\n")
    fingerprint.code_fingerprint.cache_clear()
    assert fingerprint.code_fingerprint(kernel.Kernel) != before
  finally:
    fingerprint.code_fingerprint.cache_clear()
    for name in [n for n in sys.modules if n.startswith("fp_plugin")]:
      del sys.modules[name]


def test_code_without_a_source_file_has_no_fingerprint(monkeypatch):
  module = types.ModuleType("fp_interactive")
  exec("class Kernel:\n  pass\n", module.__dict__)
  monkeypatch.setitem(sys.modules, "fp_interactive", module)
  assert fingerprint.code_fingerprint(module.Kernel) == ""
