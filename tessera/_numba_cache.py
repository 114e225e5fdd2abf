"""Where Numba keeps tessera's compiled kernels: a directory per version of the kernel sources.

Numba's on-disk cache (``@njit(cache=True)``) checks only the timestamp of the file that defines the jitted function
(Numba's documentation lists it as a limitation: changes to functions in other files are not seen). Tessera's kernels
inline helpers from other files (``simd.py``'s intrinsics, ``attn_microkernels.py``, ``numba_math.py``), so after an
edit to a helper, the kernels that inline it would keep running the old machine code from ``__pycache__`` until their
own file changed; kernel experiments had to set a fresh ``NUMBA_CACHE_DIR`` for every variant. Keying the cache
directory by a hash of every source file that uses Numba makes any such edit start from a fresh directory instead.

:func:`configure` runs on ``import tessera`` (cost: a few ms to hash the kernel sources). It sets ``NUMBA_CACHE_DIR``
only when the user has not, and only to a directory it can write; older directories beyond the newest
``KEEP`` are removed once they have not been used for a day.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import time
from pathlib import Path

#: cache directories (source versions) kept side by side
KEEP = 4
# A line importing Numba, or its njit decorator anywhere (kernels that import it under another module's name).
_USES_NUMBA = re.compile(rb"^[ \t]*(?:import|from)[ \t]+numba\b|njit", re.MULTILINE)
_DAY = 24 * 3600


def _width_environment() -> str:
    """``TESSERA_SIMD_LANES``, ``TESSERA_ISA`` and the ``simd`` part of ``TESSERA_CPU_VARIANTS``: what picks the
    vector width of the explicit-SIMD kernels. Other variant choices compile to kernels of their own signature, so
    they share one directory (forcing ``qgemv=portable`` must not recompile everything)."""
    forced = os.environ.get("TESSERA_CPU_VARIANTS", "")
    simd = [part for part in forced.split(",") if part.strip().startswith("simd") or part.strip() == "portable"]
    return "|".join((os.environ.get("TESSERA_SIMD_LANES", ""), os.environ.get("TESSERA_ISA", ""), *simd))


def cache_root() -> Path:
    """``$TESSERA_CACHE_DIR/numba``, by default ``~/.cache/tessera/numba`` (the Triton backend's cache sits next to it)."""
    root = os.environ.get("TESSERA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tessera")
    return Path(root) / "numba"


def sources_digest(package_dir: Path) -> str:
    """12 hex digits of SHA-256 over the relative path and bytes of every ``.py`` file under ``package_dir`` that
    imports Numba or uses ``njit`` (the files whose code a compiled kernel can contain), and over the environment
    that sets the vector width compiled into the kernels without changing a file (:func:`_width_environment`).

    A file that only names Numba (the CLI's version table, a docstring) is left out: editing it must not throw away
    every compiled kernel, which costs minutes on a small machine."""
    digest = hashlib.sha256(_width_environment().encode())
    for path in sorted(package_dir.rglob("*.py")):
        data = path.read_bytes()
        if _USES_NUMBA.search(data):
            digest.update(path.relative_to(package_dir).as_posix().encode())
            digest.update(b"\0")
            digest.update(data)
    return digest.hexdigest()[:12]


def _prune(root: Path, keep: Path) -> None:
    """Remove version directories other than ``keep`` beyond the newest ``KEEP``, if unused for a day."""
    try:
        dirs = sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime, reverse=True)
    except OSError:
        return
    now = time.time()
    for d in dirs[KEEP:]:
        try:
            if d != keep and now - d.stat().st_mtime > _DAY:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def configure(package_dir: Path | None = None) -> Path | None:
    """Point Numba's cache at the directory of the current kernel sources; returns it, or None when the user chose
    one (``NUMBA_CACHE_DIR``) or none can be written (Numba then keeps its default, ``__pycache__``)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return None
    package_dir = package_dir or Path(__file__).resolve().parent
    root = cache_root()
    target = root / sources_digest(package_dir)
    try:
        target.mkdir(parents=True, exist_ok=True)
        os.utime(target)  # mark as used, for _prune
    except OSError:
        return None
    if not os.access(target, os.W_OK):
        return None
    os.environ["NUMBA_CACHE_DIR"] = str(target)
    numba = sys.modules.get("numba")
    if numba is not None:  # imported before tessera: its config already read the environment
        numba.config.CACHE_DIR = str(target)
    _prune(root, target)
    return target
