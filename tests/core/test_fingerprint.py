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


def _write_package(root, files):
  """Writes `files` ({relative path: source}) under `root`, making the folders."""
  for relative, source in files.items():
    (root / relative).parent.mkdir(parents=True, exist_ok=True)
    (root / relative).write_text(source)


def _forget_package(name):
  fingerprint.code_fingerprint.cache_clear()
  for module in [n for n in sys.modules if n == name or n.startswith(name + ".")]:
    del sys.modules[module]


def test_importing_an_unrelated_module_of_the_package_keeps_the_fingerprint(
    tmp_path, monkeypatch):
  # `import fp_mylib.helpers` binds the package, whose globals gain `train` once anything
  # imports it; that must not make entries tuned with and without it look stale.
  _write_package(tmp_path, {
      "fp_mylib/__init__.py": '"""A package with its own op."""\n',
      "fp_mylib/helpers.py": "def double(x):\n  return x * 2\n",
      "fp_mylib/train.py": "LEARNING_RATE = 1e-3\n",
      "fp_mylib/ops.py": "import fp_mylib.helpers\n\nclass MyOp:\n  pass\n",
  })
  monkeypatch.syspath_prepend(str(tmp_path))
  try:
    ops = importlib.import_module("fp_mylib.ops")
    before = fingerprint.code_fingerprint(ops.MyOp)
    importlib.import_module("fp_mylib.train")
    fingerprint.code_fingerprint.cache_clear()
    assert fingerprint.code_fingerprint(ops.MyOp) == before
    # The package's __init__ is not the op's code just because helpers came through it.
    assert fingerprint.module_closure("fp_mylib.ops") == ["fp_mylib.helpers", "fp_mylib.ops"]
    (tmp_path / "fp_mylib/helpers.py").write_text("def double(x):\n  return x + x\n")
    fingerprint.code_fingerprint.cache_clear()
    assert fingerprint.code_fingerprint(ops.MyOp) != before
  finally:
    _forget_package("fp_mylib")


def test_the_closure_follows_every_form_of_import_without_importing(tmp_path, monkeypatch):
  _write_package(tmp_path, {
      "fp_forms/__init__.py": "from fp_forms.shared import SCALE\n",
      "fp_forms/shared.py": "SCALE = 2\n",
      "fp_forms/kernels/__init__.py": "",
      "fp_forms/kernels/tile.py": "TILE = 64\n",
      "fp_forms/kernels/op.py": (
          "from . import tile\n"                    # a module, relative
          "from ..shared import SCALE\n"            # a name of a module
          "from fp_forms import SCALE as S\n"       # a name of the package itself
          "\n"
          "def lazy():\n"
          "  from fp_forms.lazy.deep import f\n"    # under a package not imported
          "  return f\n"
          "\n"
          "class Op:\n  pass\n"),
      # Importing it would fail: finding `deep` must not run it.
      "fp_forms/lazy/__init__.py": "raise RuntimeError('imported')\n",
      "fp_forms/lazy/deep.py": "def f():\n  return 1\n",
  })
  monkeypatch.syspath_prepend(str(tmp_path))
  try:
    importlib.import_module("fp_forms.kernels.op")
    assert fingerprint.module_closure("fp_forms.kernels.op") == [
        "fp_forms", "fp_forms.kernels.op", "fp_forms.kernels.tile", "fp_forms.lazy.deep",
        "fp_forms.shared"]
    assert "fp_forms.lazy" not in sys.modules
  finally:
    _forget_package("fp_forms")


def test_code_without_a_source_file_has_no_fingerprint(monkeypatch):
  module = types.ModuleType("fp_interactive")
  exec("class Kernel:\n  pass\n", module.__dict__)
  monkeypatch.setitem(sys.modules, "fp_interactive", module)
  assert fingerprint.code_fingerprint(module.Kernel) == ""


def _zip_package(archive, files):
  """Writes a zip archive at `archive` holding `files` ({relative path: source})."""
  import zipfile
  with zipfile.ZipFile(archive, "w") as z:
    for relative, source in files.items():
      z.writestr(relative, source)


def test_code_imported_from_a_zip_archive_has_a_fingerprint_its_edits_change(
    tmp_path, monkeypatch):
  """A zipapp or a zipped plugin: the modules' files are inside the archive, so their
  source comes from the zipimport loader (the fingerprint was "": never stale)."""
  files = {"fp_zipped/__init__.py": "",
           "fp_zipped/tiles.py": "TILE = 64\n",
           "fp_zipped/op.py": "from fp_zipped import tiles\n\nclass ZipOp:\n  pass\n"}
  fingerprints = []
  for version, tile in enumerate(("64", "128")):
    archive = tmp_path / f"plugin{version}.zip"
    _zip_package(archive, files | {"fp_zipped/tiles.py": f"TILE = {tile}\n"})
    monkeypatch.syspath_prepend(str(archive))
    try:
      op = importlib.import_module("fp_zipped.op")
      assert ".zip" in op.__file__
      assert fingerprint.module_closure("fp_zipped.op") == ["fp_zipped.op", "fp_zipped.tiles"]
      fingerprints.append(fingerprint.code_fingerprint(op.ZipOp))
    finally:
      _forget_package("fp_zipped")  # The next archive goes in front of sys.path.
  assert all(len(f) == 16 for f in fingerprints)
  assert fingerprints[0] != fingerprints[1]
