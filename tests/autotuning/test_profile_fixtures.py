"""Profiles recorded on real devices still read as they did (tests/data/profiles/)."""

import gzip
import json
import pathlib

import pytest

from stellarax.autotuning.capture import bound_args_from_json
from stellarax.autotuning.profile import read_op_calls
from stellarax.tools import xplane_to_bound_args

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "data" / "profiles"
FOLDERS = sorted(p for p in FIXTURES.iterdir() if p.is_dir())


def _unzipped(folder, tmp_path):
  path = tmp_path / "host.xplane.pb"
  path.write_bytes(gzip.decompress((folder / "profile.xplane.pb.gz").read_bytes()))
  return path


def _recorded(folder):
  return json.loads((folder / "calls.json").read_text())["calls"]


def test_a_recorded_cpu_profile_is_kept():
  assert "cpu" in [folder.name for folder in FOLDERS]


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_recorded_profile_gives_the_recorded_calls(folder, tmp_path):
  calls = read_op_calls(_unzipped(folder, tmp_path))
  recorded = _recorded(folder)
  assert [(c.marker, c.count) for c in calls] == [(r["marker"], r["count"]) for r in recorded]
  assert [c.device_time_s for c in calls] == pytest.approx([r["device_time_s"] for r in recorded],
                                                           rel=1e-9)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_recorded_profile_gives_bound_arguments_to_tune(folder, tmp_path):
  # The specification's path from a profile to tuning: xplane -> JSON -> BoundArguments.
  records = xplane_to_bound_args.extract(_unzipped(folder, tmp_path))
  bound = bound_args_from_json(json.dumps({"calls": records}))
  recorded = [json.loads(r["marker"]) for r in _recorded(folder)]
  assert [ba.op.name for ba in bound] == [m["op"]["name"] for m in recorded]
  for ba, marker in zip(bound, recorded):
    shapes = {name: arg["shape"] for name, arg in marker["arguments"].items()
              if isinstance(arg, dict) and arg.get("__array__")}
    specs = {name: list(ba.arguments[name].shape) for name in shapes}
    assert specs == shapes
    assert ba.op.config is None  # tuning chooses it


def test_op_name_gives_time_to_an_op_whose_loops_lost_the_attribute(tmp_path):
  # In the CPU profile XLA kept the attention VJP's attribute on some instructions and
  # dropped it from loops of its backward; their op_name still names it.
  calls = {json.loads(c.marker)["op"]["name"]: c
           for c in read_op_calls(_unzipped(FIXTURES / "cpu", tmp_path))}
  assert calls["attention.xla_vjp"].device_time_s > calls["attention.xla_chunked"].device_time_s / 2


def test_a_gpu_profile_of_command_buffers_gives_every_op_of_the_model(tmp_path):
  # Recorded on an H200 (bench/gpu_check.py's small model, three steps of forward and
  # gradient): XLA ran the whole step as one CUDA graph, whose events name the command
  # buffer, not their instructions. Before, the profile read as holding no op at all;
  # then attention's VJP counted twice a step (its dq, dk and dv are alike results).
  folder = FIXTURES / "NVIDIA_H200"
  calls = {json.loads(c.marker)["op"]["name"]: c for c in read_op_calls(_unzipped(folder, tmp_path))}
  assert {name: c.count for name, c in calls.items()} == {
      name: 3 for name in ("ragged_dot.xla", "ragged_dot.xla_vjp", "attention.xla_chunked",
                           "attention.xla_vjp", "layer_norm.xla", "layer_norm.xla_vjp")}
  assert all(c.device_time_s > 0 for c in calls.values())
