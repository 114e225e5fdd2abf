"""The search on toy tunables with fixed times: fastest wins, the default wins ties and noise."""

from __future__ import annotations

import pytest

from tessera import tuning
from tessera.tuning import Crossover, Tunable, search
from tessera.tuning.search import clearly_faster


def _outcome(name: str = "toy"):
    (outcome,) = search.tune(search.plan([name]), quick=True, write=False)
    return outcome


def test_picks_the_clearly_fastest(toy):
    toy(times={1: [0.80, 0.81, 0.79], 2: [1.0, 1.01, 0.99], 4: [1.2, 1.21, 1.19]})
    o = _outcome()
    assert (o.chosen, o.default) == (1, 2) and o.speedup == pytest.approx(1.0 / 0.8, rel=0.02)
    assert tuning.tuned("toy") == 1  # recorded for this process at once


@pytest.mark.parametrize("times", [
    {1: [0.99], 2: [1.0], 4: [1.1]},  # 1% faster: below the 3% bar
    {1: [0.6, 0.9, 1.2], 2: [1.0], 4: [1.5]},  # 10% faster by the median, but its IQR reaches the default
], ids=["within-3-percent", "overlapping-iqr"])
def test_keeps_the_default_within_noise(toy, times):
    toy(times=times)
    o = _outcome()
    assert o.chosen == 2 and o.speedup == 1.0 and "within noise" in o.reason


def test_clearly_faster_needs_gain_and_disjoint_quartiles():
    assert clearly_faster([1.0] * 5, [1.1] * 5)
    assert not clearly_faster([1.0] * 5, [1.02] * 5)
    assert not clearly_faster([0.9, 1.0, 1.0, 1.3, 1.3], [1.1, 1.2, 1.2, 1.2, 1.25])


def _crossover_tunable(default: int, jitter: float = 0.0) -> Tunable:
    """below costs m seconds, above 20 + m / 2: below wins up to m = 32 of the grid (they meet at m = 40)."""
    state = {"n": 0}

    def noisy(value: float) -> float:
        state["n"] += 1
        return value * (1.0 + jitter * (state["n"] % 3 - 1))

    t = Tunable("toy_x", default, (8, 16, 32, 64, 128), None,
                crossover=Crossover(lambda m, sc: noisy(float(m)), lambda m, sc: noisy(20.0 + m / 2), unit="rows"))
    return tuning.register(t, replace=True)


@pytest.mark.parametrize("default", [8, 128])
def test_crossover_finds_where_the_paths_trade_places(default):
    _crossover_tunable(default, jitter=0.005)
    try:
        o = _outcome("toy_x")
    finally:
        tuning.unregister("toy_x")
    assert o.chosen == 32 and o.speedup > 1.0
    assert [g["m"] for g in o.grid] == [8, 16, 32, 64, 128]
    costs = {c["value"]: c["seconds"] for c in o.candidates}
    assert min(costs, key=costs.get) == 32


def test_crossover_keeps_a_default_that_is_right():
    _crossover_tunable(32)
    try:
        o = _outcome("toy_x")
    finally:
        tuning.unregister("toy_x")
    assert o.chosen == 32 and o.speedup == 1.0


def test_plan_rejects_unknown_names_and_classes(toy):
    toy()
    with pytest.raises(KeyError, match="no tunable named 'nope'"):
        search.plan(["nope"])
    with pytest.raises(ValueError, match="no shape class"):
        search.plan(["toy"], {"toy": ["int4"]})
    assert [(t.name, sc) for t, sc in search.plan(["toy"])] == [("toy", None)]
