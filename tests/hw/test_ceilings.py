"""tessera.hw: the ceilings cache (probes faked, so these tests take milliseconds) and the probes' arithmetic."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from tessera.hw import Ceilings, cache_path, get_ceilings
from tessera.hw import ceilings as ceilings_mod
from tessera.hw import probes


@pytest.fixture
def fake_probes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Point the cache at tmp_path and replace the slow probes; returns the log of probe calls."""
    calls: list[str] = []
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(probes, "measure_gemm_gflops", lambda: calls.append("gemm") or 100.0 + len(calls))
    monkeypatch.setattr(probes, "measure_read_gbps", lambda: (calls.append("read") or 20.0, "torch.sum"))
    # The fakes take microseconds, over which CPU-time accounting (10 ms ticks) is noise.
    monkeypatch.setattr(probes, "others_busy_fraction", lambda before, after, wall: 0.0)
    return calls


def test_measures_once_then_reads_the_cache(fake_probes: list[str], tmp_path: Path) -> None:
    first = get_ceilings()
    second = get_ceilings()
    assert fake_probes == ["gemm", "read"]
    assert first == second
    assert cache_path() == tmp_path / "ceilings.json"
    data = json.loads(cache_path().read_text())
    assert data["schema"] == ceilings_mod.SCHEMA
    assert data["machines"][first.key]["gemm_fp32_gflops"] == first.gemm_fp32_gflops


def test_refresh_measures_again_and_overwrites(fake_probes: list[str]) -> None:
    first = get_ceilings()
    refreshed = get_ceilings(refresh=True)
    assert fake_probes == ["gemm", "read", "gemm", "read"]
    assert refreshed.gemm_fp32_gflops != first.gemm_fp32_gflops
    assert get_ceilings() == refreshed


def test_metadata_describes_the_machine(fake_probes: list[str]) -> None:
    c = get_ceilings()
    assert c.cpu_model and c.num_cores >= 1 and c.torch_threads >= 1
    assert c.read_method == "torch.sum"
    assert c.measured_at[:2] == "20"  # ISO date
    assert 0.0 <= c.others_busy <= 1.0


def test_another_machine_measures_its_own_entry(fake_probes: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    here = get_ceilings()
    monkeypatch.setattr(probes, "cpu_model", lambda: "Other CPU (cpu family 1, model 2, stepping 3)")
    there = get_ceilings()
    assert fake_probes.count("gemm") == 2
    assert there.key != here.key
    assert set(json.loads(cache_path().read_text())["machines"]) == {here.key, there.key}


INVALID_CACHES = ["not json", "[]", '{"schema": 0, "machines": {}}', '{"schema": 1, "machines": []}']


@pytest.mark.parametrize("content", INVALID_CACHES)
def test_an_invalid_cache_is_measured_over(fake_probes: list[str], content: str) -> None:
    cache_path().write_text(content)
    c = get_ceilings()
    assert fake_probes == ["gemm", "read"]
    assert get_ceilings() == c


def test_a_malformed_entry_is_measured_over(fake_probes: list[str]) -> None:
    c = get_ceilings()
    data = json.loads(cache_path().read_text())
    data["machines"][c.key]["read_gbps"] = "fast"
    cache_path().write_text(json.dumps(data))
    get_ceilings()
    assert fake_probes.count("gemm") == 2


def test_an_unwritable_cache_warns_and_still_returns(fake_probes: list[str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(blocker / "sub"))  # a directory can't be made under a file
    with pytest.warns(RuntimeWarning, match="TESSERA_CACHE_DIR"):
        c = get_ceilings()
    assert c.gemm_fp32_gflops > 0


def test_from_dict_round_trips_and_rejects_bad_entries(fake_probes: list[str]) -> None:
    c = get_ceilings()
    assert Ceilings.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ValueError, match="exactly the fields"):
        Ceilings.from_dict({**c.to_dict(), "extra": 1})
    with pytest.raises(ValueError, match="gemm_fp32_gflops"):
        Ceilings.from_dict({**c.to_dict(), "gemm_fp32_gflops": float("nan")})


def test_a_busy_machine_warns(fake_probes: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probes, "others_busy_fraction", lambda before, after, wall: 0.6)
    with pytest.warns(RuntimeWarning, match="60% of the CPUs"):
        c = get_ceilings()
    assert c.others_busy == 0.6


def test_others_busy_fraction_subtracts_our_own_cpu_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probes.os, "cpu_count", lambda: 2)
    # 2 s wall on 2 cores: the machine was busy 3 cpu-seconds, 2 of them ours -> others used 1 of 4.
    assert probes.others_busy_fraction((10.0, 5.0), (13.0, 7.0), wall=2.0) == pytest.approx(0.25)
    assert probes.others_busy_fraction(None, (1.0, 1.0), wall=1.0) == 0.0
    assert probes.others_busy_fraction((0.0, 0.0), (0.0, 5.0), wall=1.0) == 0.0  # clamped, never negative


def test_the_real_probes_run_on_tiny_sizes() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numba may warn about thread layers on some machines
        gbps, method = probes.measure_read_gbps(num_bytes=1 << 22, reps=1)
    assert probes.measure_gemm_gflops(n=64, reps=1) > 0
    assert gbps > 0 and method in ("torch.sum", "numba prange sum")
    assert probes.cpu_model() and probes.num_cores() >= 1
    assert set(probes.isa_flags()) <= set(probes.ISA_FLAGS)


def test_a_read_probe_keeps_its_buffer_and_measures_again(monkeypatch: pytest.MonkeyPatch) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = probes.ReadProbe(num_bytes=1 << 22)

        def no_allocation(*args, **kwargs):
            raise AssertionError("ReadProbe allocated a buffer after its construction")

        monkeypatch.setattr(probes.torch, "empty", no_allocation)  # each measurement reads the buffer it kept
        first, second = probe(reps=1), probe(reps=2)
    for gbps, method in (first, second):
        assert gbps > 0 and method in ("torch.sum", "numba prange sum")
