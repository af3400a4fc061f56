"""The README's Python code blocks run, in order, as one program."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_code_blocks_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  assert len(blocks) >= 4
  namespace: dict = {}
  for block in blocks:
    exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
