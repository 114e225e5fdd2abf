"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md has no python example"
    namespace: dict = {}
    for block in blocks:  # later blocks may use names from earlier ones, as a reader would
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102  (our own README)
