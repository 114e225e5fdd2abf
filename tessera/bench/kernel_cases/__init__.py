"""Benchmark cases of the kernel library, one module per op family; ``tessera bench kernels`` and
``benchmarks/kernels_cpu.py`` run them all.

Each module defines ``cases(quick: bool) -> list[KernelCase]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class KernelCase:
    """One op at one shape: our call and torch eager's composition of the same op, on the same inputs.

    ``bytes_moved`` is the minimum traffic (inputs read once + outputs written once); ``flops`` the useful floating
    point operations (0 for memory-bound ops). ``target`` is the issue's bound on ours / torch time, if any.
    """

    family: str
    name: str
    ours: Callable[[], Any]
    torch_eager: Callable[[], Any]
    bytes_moved: int
    flops: int = 0
    target: float | None = None
