"""The benchmark suites ``tessera bench`` runs: each module has ``cases(quick: bool) -> Iterator[Case]``.

Cases are generated lazily so that only one case's inputs are alive at a time (the decode cases hold hundreds of
MiB of KV to stay larger than the last-level cache).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator

from tessera.bench.harness import Case

#: suite name -> the module defining its ``cases``, in the order ``all`` runs them
SUITES = {name: f"{__name__}.{name}" for name in ("kernels", "attention", "paged", "e2e")}


def suite_cases(name: str) -> Callable[[bool], Iterator[Case]]:
    """The ``cases`` function of suite ``name``; raises ValueError naming the known suites."""
    if name not in SUITES:
        raise ValueError(f"unknown benchmark suite {name!r}; choose from {', '.join(SUITES)} or 'all'")
    return importlib.import_module(SUITES[name]).cases
