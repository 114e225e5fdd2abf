"""A small builder of MLIR text in the generic-free "pretty" syntax that IREE's parser reads.

Lowerings emit the upstream dialects (arith, math, scf, vector, tensor) plus IREE's dispatch ops as text: IREE parses
and verifies every op, so a malformed lowering fails at compile time with MLIR's own diagnostic, pointing at the line.
The builder only hands out fresh SSA names and keeps the indentation of nested regions readable.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class TextBuilder:
    """Accumulates the lines of one function body; :meth:`value` returns a fresh SSA name for each result."""

    def __init__(self, indent: int = 2) -> None:
        self._lines: list[str] = []
        self._count = 0
        self._indent = indent

    def fresh(self, hint: str = "v") -> str:
        """A new SSA name ``%<hint><n>``, unique in this builder."""
        self._count += 1
        return f"%{hint}{self._count}"

    def value(self, rhs: str, hint: str = "v") -> str:
        """Emit ``%name = rhs`` and return ``%name``."""
        name = self.fresh(hint)
        self.line(f"{name} = {rhs}")
        return name

    def line(self, text: str) -> None:
        """Emit one line at the current indentation."""
        self._lines.append(" " * self._indent + text)

    def comment(self, text: str) -> None:
        self.line(f"// {text}")

    @contextmanager
    def region(self) -> Iterator[None]:
        """Indent the lines emitted inside the ``with`` block (the caller writes the braces)."""
        self._indent += 2
        try:
            yield
        finally:
            self._indent -= 2

    def text(self) -> str:
        return "\n".join(self._lines)
