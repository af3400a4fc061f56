"""bench/result_dispatch.py runs and shows no retrace of a function without ops."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_result_dispatch_counts_traces(capsys):
  spec = importlib.util.spec_from_file_location("result_dispatch", ROOT / "bench" / "result_dispatch.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules["result_dispatch"] = module
  spec.loader.exec_module(module)
  assert module.main(["--calls", "5"]) == 0
  rows = {tuple(c.strip() for c in line.split("|")[1:4]) for line in capsys.readouterr().out.splitlines()
          if line.startswith("| ")}
  assert {("before", "no op", "1"), ("inside", "no op", "0"), ("after", "no op", "0"),
          ("inside", "ragged_dot", "1"), ("after", "ragged_dot", "0")} <= rows
