"""What a tuning result depends on: this machine's CPU, vector ISA, core count and cache sizes, and a digest of them.

A tuned threshold is a crossover between two code paths, and where it falls depends on the core (vector width, FMA
units), how many cores share the work and how much of the data the caches hold. Library versions are left out on
purpose: they change more often than the hardware, and a threshold measured under the previous torch is still a far
better guess than a constant measured on another machine. ``tessera tune`` re-measures when wanted.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tessera.hw import probes

#: where Linux describes the first CPU's caches: one ``index*`` directory per cache, with level, type and size
SYSFS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
#: ``os.sysconf`` names glibc provides for the same sizes, used when sysfs is unavailable (some containers)
_SYSCONF = {"L1d": "SC_LEVEL1_DCACHE_SIZE", "L2": "SC_LEVEL2_CACHE_SIZE", "L3": "SC_LEVEL3_CACHE_SIZE"}


def parse_size(text: str) -> int | None:
    """Bytes of a sysfs cache size such as ``"32K"``, ``"32768K"``, ``"2M"`` or ``"1048576"``; None if unreadable.

    Examples
    --------
    >>> parse_size("512K"), parse_size("2M"), parse_size("64")
    (524288, 2097152, 64)
    """
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if scale != 1 else text
    try:
        value = int(digits) * scale
    except ValueError:
        return None
    return value if value > 0 else None


def cache_sizes(sysfs: Path = SYSFS_CACHE) -> dict[str, int | None]:
    """L1 data, L2 and L3 sizes in bytes of the first CPU (None where unknown).

    Read from ``sysfs/index*/{level,type,size}``; instruction caches are skipped. When sysfs has no entry for a
    level, ``os.sysconf`` is asked (glibc reads the same information from CPUID).
    """
    sizes: dict[str, int | None] = {"L1d": None, "L2": None, "L3": None}
    try:
        indices = sorted(sysfs.glob("index*"))
    except OSError:
        indices = []
    for index in indices:
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = parse_size((index / "size").read_text())
        except OSError:
            continue
        if kind == "Instruction":
            continue
        key = "L1d" if level == "1" else f"L{level}"
        if key in sizes and sizes[key] is None:
            sizes[key] = size
    for key, name in _SYSCONF.items():
        if sizes[key] is None:
            try:
                value = os.sysconf(name)
            except (ValueError, OSError, AttributeError):  # name unknown to this libc / platform
                continue
            sizes[key] = value if value > 0 else None
    return sizes


@functools.lru_cache(maxsize=1)
def fingerprint() -> dict[str, Any]:
    """This machine as a JSON-ready dict: ``cpu_model``, ``isa`` (list), ``logical_cores``, ``caches``.

    Computed once per process (a few reads of /proc and /sys, ~1 ms): the hot-path lookup reads the cache file,
    whose name is this dict's :func:`digest`, on its first call.
    """
    return {
        "cpu_model": probes.cpu_model(),
        "isa": list(probes.isa_flags()),
        "logical_cores": probes.num_cores(),
        "caches": cache_sizes(),
    }


def digest(fp: dict[str, Any] | None = None) -> str:
    """16 hex digits of SHA-256 over the canonical JSON of ``fp`` (default: this machine's fingerprint).

    Examples
    --------
    >>> len(digest({"cpu_model": "x", "isa": [], "logical_cores": 2, "caches": {}}))
    16
    """
    fp = fingerprint() if fp is None else fp
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
