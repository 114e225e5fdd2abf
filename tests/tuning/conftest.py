"""Fixtures of the tuning tests: a private cache directory, a clean environment and toy tunables."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from tessera import tuning
from tessera.tuning import Tunable


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch) -> Iterator[None]:
    """Every test gets its own cache root, tuning on, no forced values, and forgets lookups before and after."""
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TESSERA_TUNING", raising=False)
    for name in list(os.environ):
        if name.startswith("TESSERA_TUNE_"):
            monkeypatch.delenv(name)
    tuning.reset()
    yield
    tuning.reset()


@pytest.fixture
def toy() -> Iterator[Callable[..., Tunable]]:
    """Register toy tunables (removed after the test): ``toy(name, times, default=...)`` with ``times`` mapping each
    candidate to a list of seconds its measure returns in turn (cycling)."""
    names: list[str] = []

    def make(name: str = "toy", times: dict | None = None, default=2, candidates=None, **kwargs) -> Tunable:
        times = times or {1: [1.0], 2: [1.0], 4: [1.0]}
        calls = {c: 0 for c in times}

        def measure(candidate, shape_class):
            seq = times[candidate]
            calls[candidate] += 1
            return seq[(calls[candidate] - 1) % len(seq)]

        t = Tunable(name, default, tuple(candidates or times), measure, doc="a toy", **kwargs)
        tuning.register(t, replace=True)
        names.append(name)
        return t

    yield make
    for name in names:
        tuning.unregister(name)
