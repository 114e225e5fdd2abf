"""The Numba cache directory follows the kernel sources (Numba alone misses edits to inlined helpers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera import _numba_cache


def _tree(root: Path) -> Path:
    pkg = root / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "kernel.py").write_text("from numba import njit\n\n@njit(cache=True)\ndef f(x):\n    return helper(x)\n")
    (pkg / "sub" / "helper.py").write_text("from numba import njit\n\n@njit(inline='always')\ndef helper(x):\n    return x\n")
    (pkg / "plain.py").write_text("def g():\n    return 1\n")
    return pkg


def test_digest_follows_every_numba_source_and_only_those(tmp_path: Path) -> None:
    pkg = _tree(tmp_path)
    first = _numba_cache.sources_digest(pkg)
    assert first == _numba_cache.sources_digest(pkg)
    (pkg / "plain.py").write_text("def g():\n    return 2\n")  # no Numba in it: same kernels
    assert _numba_cache.sources_digest(pkg) == first
    (pkg / "sub" / "helper.py").write_text("from numba import njit\n\n@njit(inline='always')\ndef helper(x):\n    return x + 1\n")
    assert _numba_cache.sources_digest(pkg) != first  # the inlined helper changed: a new directory


def test_digest_ignores_files_that_only_name_numba(tmp_path: Path) -> None:
    """A version table or a docstring naming Numba holds no kernel code: editing it keeps the compiled kernels."""
    pkg = _tree(tmp_path)
    (pkg / "cli.py").write_text('PACKAGES = ("torch", "numba")\n')
    first = _numba_cache.sources_digest(pkg)
    (pkg / "cli.py").write_text('"""Reports the numba version."""\nPACKAGES = ("numba",)\n')
    assert _numba_cache.sources_digest(pkg) == first
    (pkg / "uses.py").write_text("import numba as nb\n")  # an import under another name still counts
    assert _numba_cache.sources_digest(pkg) != first


def test_digest_follows_the_forced_simd_width(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = _tree(tmp_path)
    monkeypatch.delenv("TESSERA_SIMD_LANES", raising=False)
    default = _numba_cache.sources_digest(pkg)
    monkeypatch.setenv("TESSERA_SIMD_LANES", "8")
    assert _numba_cache.sources_digest(pkg) != default


def test_configure_sets_a_versioned_directory_and_respects_the_user(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = _tree(tmp_path)
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    import numba

    monkeypatch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)  # restored after the test
    target = _numba_cache.configure(pkg)
    assert target == tmp_path / "cache" / "numba" / _numba_cache.sources_digest(pkg)
    assert target.is_dir() and os.environ["NUMBA_CACHE_DIR"] == str(target) == numba.config.CACHE_DIR
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert _numba_cache.configure(pkg) is None
    assert os.environ["NUMBA_CACHE_DIR"] == str(tmp_path / "mine")


def test_old_directories_are_pruned_but_recent_ones_kept(tmp_path: Path) -> None:
    root = tmp_path / "numba"
    three_days = 3 * 24 * 3600
    dirs = []
    for i in range(_numba_cache.KEEP + 2):  # the first two are the oldest and unused for days
        d = root / f"v{i}"
        d.mkdir(parents=True)
        stamp = d.stat().st_mtime - (three_days - i if i < 2 else 0)
        os.utime(d, (stamp, stamp))
        dirs.append(d)
    _numba_cache._prune(root, dirs[-1])
    assert [d.exists() for d in dirs] == [False, False] + [True] * _numba_cache.KEEP


def test_import_tessera_points_numba_at_the_versioned_directory(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["TESSERA_CACHE_DIR"] = str(tmp_path)
    code = "import tessera, numba; print(numba.config.CACHE_DIR)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert Path(out.stdout.strip()).parent == tmp_path / "numba"
