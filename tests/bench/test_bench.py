"""``tessera bench``: the harness, result files, compare's verdicts, plots, and the CLI end to end on a fake suite."""

from __future__ import annotations

import json

import pytest

from tessera.bench import harness
from tessera.bench.compare import compare
from tessera.bench.harness import Case, measure
from tessera.bench.machine import RunCeilings, fingerprint
from tessera.bench.plot import plot_file
from tessera.bench.report import derived, read_json, to_json
from tessera.bench.suites import SUITES, suite_cases
from tessera.cli import main
from tests.bench import fake_suite

CEILINGS = RunCeilings(gemm_fp32_gflops=200.0, gemm_bf16_gflops=400.0, read_gbps=40.0, copy_gbps=35.0, seconds=1.0)


def _timer(values):
    it = iter(values)
    return lambda: next(it)


def test_measure_takes_medians_and_spreads_of_interleaved_runs():
    ours = [9.0] + [1.0, 2.0, 3.0, 4.0, 100.0]  # warm-up, then 5 timed calls (one outlier)
    base = [9.0] + [2.0] * 5
    r = measure(Case("s", "c", _timer(ours), _timer(base), "torch", self_timed=True, reps=5))
    assert r.error is None and r.reps == 5
    assert r.seconds == 3.0 and r.baseline_seconds == 2.0 and r.ratio == 1.5
    assert r.spread > 0 and r.baseline_spread == 0.0


def test_a_failing_case_is_reported_not_raised():
    def boom():
        raise RuntimeError("kernel exploded")

    r = measure(Case("s", "bad", boom))
    assert r.seconds is None and "kernel exploded" in r.error


def test_derived_rates_fractions_and_roofline():
    r = measure(Case("s", "c", _timer([1.0] * 10), flops=100e9, bytes_moved=10e9, self_timed=True, reps=5))
    d = derived(r, CEILINGS)
    assert d["gflops"] == pytest.approx(100.0) and d["gbps"] == pytest.approx(10.0)
    assert d["frac_compute"] == pytest.approx(0.5) and d["frac_read"] == pytest.approx(0.25)
    # roofline: max(100e9 / 200e9, 10e9 / 40e9) = 0.5 s predicted, compute-bound
    assert d["predicted_seconds"] == pytest.approx(0.5) and d["bound"] == "compute"
    assert d["roofline_fraction"] == pytest.approx(0.5)


def test_rotating_copies_cover_the_cache():
    assert harness.copies_for(1 << 30) == 1
    assert harness.copies_for(8 << 20, total=128 << 20) == 16
    from tessera.tuning.fingerprint import cache_sizes

    assert harness.rotate_bytes() >= max(harness.ROTATE_BYTES, 2 * (cache_sizes().get("L3") or 0))
    nxt = harness.rotating(["a", "b", "c"])
    assert [nxt() for _ in range(5)] == ["a", "b", "c", "a", "b"]


def _file(times: dict[str, tuple[float, float]]) -> dict:
    """A result file with cases name -> (median seconds, spread)."""
    results = []
    for name, (seconds, spread) in times.items():
        r = harness.Result("s", name, "fp32", {}, 0.0, 0.0, None, seconds=seconds, spread=spread, reps=5)
        results.append(r)
    return to_json(results, CEILINGS, {"cpu_model": "test"}, True, ["s"], {})


def test_compare_flags_slowdowns_beyond_threshold_plus_noise():
    old = _file({"steady": (1.0, 0.02), "slower": (1.0, 0.02), "noisy": (1.0, 0.40), "faster": (1.0, 0.0),
                 "gone": (1.0, 0.0)})
    new = _file({"steady": (1.05, 0.02), "slower": (1.30, 0.02), "noisy": (1.30, 0.40), "faster": (0.5, 0.0),
                 "added": (1.0, 0.0)})
    changes, only_old, only_new = compare(old, new, threshold=0.10)
    verdict = {c.key: (c.regressed, c.improved) for c in changes}
    assert verdict == {"s/steady": (False, False), "s/slower": (True, False), "s/noisy": (False, False),
                       "s/faster": (False, True)}
    assert only_old == ["s/gone"] and only_new == ["s/added"]
    with pytest.raises(ValueError, match="threshold"):
        compare(old, new, threshold=-1)


def test_read_json_rejects_other_files(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a tessera bench result file"):
        read_json(path)


def test_plot_writes_roofline_and_latency_pngs(tmp_path):
    results = []
    for ctx, secs in ((1024, 0.001), (2048, 0.002), (4096, 0.004)):
        results.append(harness.Result("attention", f"decode L={ctx}", "fp32", {"phase": "decode", "context": ctx},
                                      1e8 * ctx / 1024, 5e7 * ctx / 1024, None, seconds=secs, spread=0.01, reps=5,
                                      baseline_name="sdpa", baseline_seconds=2 * secs))
    data = to_json(results, CEILINGS, fingerprint(), True, ["attention"], {})
    paths = plot_file(data, tmp_path, "run")
    assert [p.name for p in paths] == ["run-roofline.png", "run-latency.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)


def test_unknown_suite_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown benchmark suite 'nope'"):
        suite_cases("nope")
    assert main(["bench", "nope"]) == 2


def test_cli_bench_then_compare_flags_a_deliberately_slowed_kernel(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(SUITES, "fake", "tests.bench.fake_suite")
    monkeypatch.setattr("tessera.bench.machine.measure_run_ceilings", lambda quick=False: CEILINGS)
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    assert main(["bench", "fake", "--quick", "--json", str(old), "--plot", str(tmp_path)]) == 0
    data = read_json(old)
    assert [r["key"] for r in data["results"]] == ["fake/rms_norm a", "fake/rms_norm b"]
    assert data["machine"]["cpu_model"] and data["ceilings"]["read_gbps"] == 40.0
    assert (tmp_path / "old-roofline.png").exists()
    monkeypatch.setattr(fake_suite, "SLOW", {"rms_norm b"})
    assert main(["bench", "fake", "--quick", "--json", str(new)]) == 0
    capsys.readouterr()
    assert main(["bench", "compare", str(old), str(new)]) == 1
    out = capsys.readouterr().out
    assert "1 regression(s): fake/rms_norm b" in out
    assert main(["bench", "compare", str(old), str(old)]) == 0
    assert main(["bench", "plot", str(old), "--out", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p" / "old-roofline.png").exists() and (tmp_path / "p" / "old-latency.png").exists()


def test_attention_breakdown_script_smoke():
    """`benchmarks/attention_breakdown.py --quick` runs end to end (both reports, tiny shapes)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "benchmarks/attention_breakdown.py", "--quick", "--reps", "2"],
                          capture_output=True, text=True, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kernel alone" in proc.stdout and "suffix decode" in proc.stdout


def test_read_patterns_script_smoke(tmp_path):
    """`benchmarks/read_patterns.py` runs end to end on a small buffer and writes a rate for every order."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "patterns.json"
    proc = subprocess.run([sys.executable, "benchmarks/read_patterns.py", "--mib", "8", "--rounds", "1", "--json",
                           str(out)], capture_output=True, text=True, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rates = json.loads(out.read_text())["gb_per_s"]
    assert len(rates) == 11 and all(r > 0 for r in rates.values())
