"""Lookups: defaults, forcing, switching off, errors, cost, and that they never measure."""

from __future__ import annotations

import timeit

import pytest
import torch

from tessera import tuning
from tessera.tuning import Crossover, Tunable


def test_untuned_lookup_returns_the_default_and_never_measures(toy):
    def measure(candidate, shape_class):
        raise AssertionError("a lookup ran a measurement")

    tuning.register(Tunable("toy", 2, (1, 2, 4), measure), replace=True)
    try:
        assert tuning.tuned("toy") == 2
        assert tuning.tuned("toy", None, 3) == 3  # the call site's default wins when nothing is tuned
        assert tuning.lookup("toy") == (2, "default", None)
    finally:
        tuning.unregister("toy")


def test_per_class_defaults_and_unknown_names(toy):
    toy("toy", default={"a": 1, "b": 4}, shape_classes=("a", "b"))
    assert (tuning.tuned("toy", "a"), tuning.tuned("toy", "b")) == (1, 4)
    with pytest.raises(ValueError, match="no shape class 'c'"):
        tuning.tuned("toy", "c")
    with pytest.raises(KeyError, match="no tunable named 'nope'; registered: .*toy"):
        tuning.tuned("nope")


def test_forced_values(toy, monkeypatch):
    toy("toy", default={"a": 1, "b": 4}, shape_classes=("a", "b"))
    monkeypatch.setenv("TESSERA_TUNE_TOY", "2")
    monkeypatch.setenv("TESSERA_TUNING", "off")  # forcing is explicit: it applies even with tuning off
    tuning.reset()
    assert (tuning.tuned("toy", "a"), tuning.tuned("toy", "b", 99)) == (2, 2)
    assert tuning.lookup("toy", "a")[1] == "forced"
    monkeypatch.setenv("TESSERA_TUNE_TOY", "b=1")
    tuning.reset()
    assert (tuning.tuned("toy", "a"), tuning.tuned("toy", "b")) == (1, 1)


@pytest.mark.parametrize("raw, match", [
    ("abc", r"TESSERA_TUNE_TOY='abc': expected a int for tunable 'toy' \(candidates: 1, 2, 4\)"),
    ("-3", "needs a positive int"),
    ("z=3", r"CLASS one of \['\*'\]"),
])
def test_malformed_forced_value_names_the_variable(toy, monkeypatch, raw, match):
    toy()
    monkeypatch.setenv("TESSERA_TUNE_TOY", raw)
    with pytest.raises(ValueError, match=match):
        tuning.tuned("toy")


def test_tuning_off_returns_defaults(toy, monkeypatch):
    toy()
    tuning.registry.record("toy", None, {"chosen": 4})
    assert tuning.tuned("toy") == 4
    monkeypatch.setenv("TESSERA_TUNING", "off")
    tuning.reset()
    tuning.registry.record("toy", None, {"chosen": 4})
    assert tuning.tuned("toy") == 2 and not tuning.tuning_enabled()
    monkeypatch.setenv("TESSERA_TUNING", "maybe")
    tuning.reset()
    with pytest.raises(ValueError, match="TESSERA_TUNING='maybe': expected 'off'"):
        tuning.tuned("toy")


def test_overriding_restores(toy):
    toy()
    assert tuning.tuned("toy") == 2
    with tuning.overriding("toy", 4):
        assert tuning.tuned("toy", None, 1) == 4
    assert tuning.tuned("toy", None, 1) == 1


def test_tunable_validation():
    measure = lambda c, s: 1.0  # noqa: E731
    with pytest.raises(ValueError, match="must match"):
        Tunable("Bad-Name", 1, (1,), measure)
    with pytest.raises(ValueError, match="exactly one of measure= and crossover="):
        Tunable("t", 1, (1,), measure, crossover=Crossover(measure, measure))
    with pytest.raises(TypeError, match="must be a int"):
        Tunable("t", 1, (1, 2.5), measure)
    with pytest.raises(ValueError, match="no value for shape classes"):
        Tunable("t", {"a": 1}, (1,), measure, shape_classes=("a", "b"))


def test_hot_path_lookup_is_well_under_a_microsecond(toy):
    toy()
    tuned = tuning.tuned
    tuned("toy", None, 2)
    # the best of several repeats: a loaded machine slows some repeats, not the lookup
    per_call = min(timeit.repeat(lambda: tuned("toy", None, 2), number=20_000, repeat=7)) / 20_000
    assert per_call < 1e-6, f"{per_call * 1e9:.0f} ns per lookup"


def test_cpu_backend_reads_its_tunables(monkeypatch):
    """qmatmul takes the tiled path above the forced crossover and the GEMV at or below it."""
    from tessera.backends.cpu.ops import quant as cpu_quant
    from tessera.kernels.quant import quantize

    paths = []
    for name in ("_gemv", "_gemm_tiled"):  # spies without the kernels: no Numba compile in this test
        monkeypatch.setattr(cpu_quant, name, lambda x, qw, name=name: paths.append(name) or x.new_zeros(len(x), 64))
    # group 64: group-32 int4 takes the row panels at every M under vnni512, where the crossover is not consulted
    qw = quantize(torch.randn(64, 64), "int4", 64)
    monkeypatch.setenv("TESSERA_TUNE_QUANT_GEMV_MAX_M", "int4=4")
    tuning.reset()
    for m in (4, 5):
        cpu_quant.qmatmul(torch.randn(m, 64), qw)
    assert paths == ["_gemv", "_gemm_tiled"]
    assert tuning.tuned("quant_gemv_max_m", "int8", 64) == 64  # other formats keep their default
    monkeypatch.undo()
    x = torch.randn(3, 64)
    whole = cpu_quant._gemm_tiled(x, qw)  # one tile of 512 rows
    with tuning.overriding("quant_tile_n", 16):  # four tiles of 16 rows: the same product
        torch.testing.assert_close(cpu_quant._gemm_tiled(x, qw), whole)


def test_decode_plan_reads_its_threshold():
    import numpy as np

    import tessera.attention  # noqa: F401
    from tessera.attention import AttentionSpec, causal
    from tessera.backends.base import KVLayout, RaggedBatch
    from tessera.backends.cpu import decode

    batch = RaggedBatch((1,), (100,))
    spec = AttentionSpec(4, 2, 64, mask=causal())
    assert decode.DecodePlan.build(batch, [0], spec, KVLayout.contiguous(batch)).serial
    with tuning.overriding("decode_serial_max_bytes", 0):
        plan = decode.DecodePlan.build(batch, [0], spec, KVLayout.contiguous(batch))
    import numba

    assert plan.serial == (numba.get_num_threads() == 1)
    assert np.asarray(plan.schedule.seq_q_len).tolist() == [1]
