"""The ``tessera`` command line, with the ceilings probes faked so nothing is measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera import __version__
from tessera.cli import main
from tessera.hw import get_ceilings, probes


@pytest.fixture(autouse=True)
def fake_ceilings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(probes, "measure_gemm_gflops", lambda: 123.0)
    monkeypatch.setattr(probes, "measure_read_gbps", lambda: (45.6, "torch.sum"))
    monkeypatch.setattr(probes, "others_busy_fraction", lambda before, after, wall: 0.0)


def test_info_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tessera"] == __version__
    assert {"python", "torch", "numba", "triton"} <= set(info["versions"])
    backends = {b["name"]: b for b in info["backends"]}
    assert backends["reference"]["usable"] and backends["reference"]["reasons"] == []
    assert all(b["usable"] == (not b["reasons"]) for b in backends.values())
    assert [b["priority"] for b in info["backends"]] == sorted((b["priority"] for b in info["backends"]), reverse=True)
    assert info["ceilings"]["gemm_fp32_gflops"] == 123.0 and info["ceilings"]["read_gbps"] == 45.6


def test_info_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for text in ("tessera", "torch", "backends", "reference", "fp32 GEMM", "123.0 GFLOP/s", "45.6 GB/s"):
        assert text in out


def test_info_refresh_measures_again(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    get_ceilings()
    monkeypatch.setattr(probes, "measure_gemm_gflops", lambda: 456.0)
    assert main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ceilings"]["gemm_fp32_gflops"] == 123.0
    assert main(["info", "--json", "--refresh"]) == 0
    assert json.loads(capsys.readouterr().out)["ceilings"]["gemm_fp32_gflops"] == 456.0


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "info" in capsys.readouterr().err


def test_user_errors_are_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                  tmp_path: Path) -> None:
    monkeypatch.delenv("TESSERA_DEBUG", raising=False)
    assert main(["generate", "hi", "--model", str(tmp_path / "missing.gguf")]) == 2
    err = capsys.readouterr().err
    assert "error: FileNotFoundError: load_model:" in err and "TESSERA_DEBUG=1" in err and "Traceback" not in err
    assert main(["generate", "hi", "--backend", "tpu"]) == 2
    assert "unknown backend 'tpu'" in capsys.readouterr().err
    monkeypatch.setenv("TESSERA_DEBUG", "1")
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        main(["generate", "hi", "--backend", "tpu"])


def test_python_dash_m_tessera(tmp_path: Path) -> None:
    get_ceilings()  # cache an entry (faked) so the subprocess reads it instead of measuring
    env = {**os.environ, "TESSERA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "tessera", "info", "--json"], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tessera"] == __version__


def test_building_the_parser_imports_no_torch():
    """Every command's start-up builds the whole parser: a subcommand whose ``add_parser`` imports torch (or NumPy)
    costs every command about a second."""
    import subprocess
    import sys

    code = "import sys, tessera.cli as c; c._build_parser(); print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"building the CLI parser imported {out}"


@pytest.mark.parametrize("command", ["generate", "serve", "warmup", "perplexity"])
def test_kv_cache_dtype_flag(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every command that builds an engine takes ``--kv-cache-dtype`` (warmup too: a quantized cache's kernels are
    their own), and a format that does not exist is refused with the choices."""
    from tessera.cli import _build_parser

    parser = _build_parser()
    assert parser.parse_args([command, "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    assert parser.parse_args([command]).kv_cache_dtype is None
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--kv-cache-dtype", "int4"])
    assert "fp8_e4m3" in capsys.readouterr().err
