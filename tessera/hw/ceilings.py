"""This machine's measured ceilings (fp32 GEMM GFLOP/s, memory read GB/s), measured once and cached as JSON.

Benchmarks report their throughput as a fraction of these numbers, so "40% of the GEMM ceiling" means the same
thing on every machine. The cache holds one entry per machine key (CPU model, cores, torch threads): a home
directory shared between hosts keeps each host's own numbers.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from tessera._atomic import exclusive, write_text_atomic
from tessera.hw import probes

#: Bump when the meaning of a field or the measuring method changes; older cache files are then re-measured.
SCHEMA = 1
CACHE_FILE = "ceilings.json"
#: When other processes use more than this fraction of the CPUs during the probes, the measurement warns.
BUSY = 0.1


@dataclass(frozen=True, slots=True)
class Ceilings:
    """Measured throughput ceilings of this machine, plus what they were measured on.

    Parameters
    ----------
    gemm_fp32_gflops : float
        Best fp32 GEMM throughput of ``torch.matmul`` and ``numpy.matmul`` on ``[gemm_size, gemm_size]`` matrices,
        all threads (GFLOP/s).
    read_gbps : float
        Best streaming-read bandwidth over ``read_bytes`` bytes, all threads, in GB/s (1e9 bytes).
    read_method : str
        Which reader reached ``read_gbps``: ``"torch.sum"`` or ``"numba prange sum"``.
    cpu_model : str
        CPU name with family/model/stepping (see :func:`tessera.hw.probes.cpu_model`).
    num_cores : int
        Logical CPUs this process may use.
    torch_threads : int
        ``torch.get_num_threads()`` during the measurement.
    torch_version : str
    isa : tuple of str
        Vector-ISA flags the CPU advertises (``avx2``, ``avx512f``, ``avx512_bf16``, ``amx_tile``, ...).
    gemm_size, read_bytes : int
        Problem sizes of the two probes.
    measured_at : str
        ISO-8601 UTC time of the measurement.
    measure_seconds : float
        Wall time the probes took.
    others_busy : float
        Fraction of the machine's CPU time other processes (or a hypervisor's other guests) used while the probes
        ran, 0..1. Both ceilings come out low when it is high; above :data:`BUSY` they are suspect and
        ``tessera info --refresh`` on an idle machine re-measures.
    """

    gemm_fp32_gflops: float
    read_gbps: float
    read_method: str
    cpu_model: str
    num_cores: int
    torch_threads: int
    torch_version: str
    isa: tuple[str, ...]
    gemm_size: int
    read_bytes: int
    measured_at: str
    measure_seconds: float
    others_busy: float

    def __post_init__(self) -> None:
        for name in ("gemm_fp32_gflops", "read_gbps", "measure_seconds", "others_busy"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"Ceilings.{name} must be a finite float >= 0, got {value!r}")
        for name in ("num_cores", "torch_threads", "gemm_size", "read_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Ceilings.{name} must be an int >= 1, got {value!r}")
        for name in ("read_method", "cpu_model", "torch_version", "measured_at"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Ceilings.{name} must be a str, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.isa, tuple) or not all(isinstance(flag, str) for flag in self.isa):
            raise TypeError(f"Ceilings.isa must be a tuple of str, got {self.isa!r}")

    @property
    def key(self) -> str:
        """The machine key this entry is cached under."""
        return machine_key(self.cpu_model, self.num_cores, self.torch_threads)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``isa`` as a list)."""
        out = asdict(self)
        out["isa"] = list(self.isa)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ceilings:
        """Inverse of :meth:`to_dict`; raises TypeError/ValueError on missing, extra or malformed fields."""
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"a ceilings entry needs exactly the fields {sorted(names)}, got {got}")
        return cls(**{**data, "isa": tuple(data["isa"]) if isinstance(data["isa"], list) else data["isa"]})


def machine_key(cpu_model: str, num_cores: int, torch_threads: int) -> str:
    """Cache key: a result is only valid for the same CPU, core count and torch thread count."""
    # "v2": the GEMM probe also times numpy.matmul since 2026-11-29; older entries re-measure.
    return f"v2 | {cpu_model} | {num_cores} cores | {torch_threads} torch threads"


def cache_path() -> Path:
    """``$TESSERA_CACHE_DIR/ceilings.json``, by default ``~/.cache/tessera/ceilings.json``."""
    root = os.environ.get("TESSERA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tessera")
    return Path(root) / CACHE_FILE


def measure_ceilings() -> Ceilings:
    """Run the probes now (a few seconds, ~1 GiB of memory), without reading or writing the cache.

    Examples
    --------
    >>> c = measure_ceilings()
    >>> print(f"{c.gemm_fp32_gflops:.0f} GFLOP/s, {c.read_gbps:.1f} GB/s ({c.read_method})")
    """
    start, cpu_before = time.perf_counter(), probes.cpu_seconds()
    gemm = probes.measure_gemm_gflops()
    read, method = probes.measure_read_gbps()
    wall = time.perf_counter() - start
    others = probes.others_busy_fraction(cpu_before, probes.cpu_seconds(), wall)
    if others > BUSY:
        warnings.warn(
            f"other processes used {others:.0%} of the CPUs while the ceilings were measured, so they came out low "
            f"({gemm:.0f} GFLOP/s, {read:.1f} GB/s). Re-measure on an idle machine with `tessera info --refresh`",
            RuntimeWarning,
            stacklevel=2,
        )
    return Ceilings(
        gemm_fp32_gflops=round(gemm, 2),
        read_gbps=round(read, 2),
        read_method=method,
        cpu_model=probes.cpu_model(),
        num_cores=probes.num_cores(),
        torch_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        isa=probes.isa_flags(),
        gemm_size=probes.GEMM_SIZE,
        read_bytes=probes.READ_BYTES,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        measure_seconds=round(wall, 2),
        others_busy=round(others, 3),
    )


def get_ceilings(refresh: bool = False) -> Ceilings:
    """This machine's ceilings: from the cache when it holds a valid entry for this machine, else measured and cached.

    Parameters
    ----------
    refresh : bool
        Measure again even when a cached entry exists (and overwrite it).

    Returns
    -------
    Ceilings

    Examples
    --------
    >>> from tessera.hw import get_ceilings
    >>> c = get_ceilings()
    >>> print(f"{100.0 / c.gemm_fp32_gflops:.0%} of the fp32 GEMM ceiling")  # a kernel that reached 100 GFLOP/s
    """
    path = cache_path()
    key = machine_key(probes.cpu_model(), probes.num_cores(), torch.get_num_threads())
    if not refresh and (cached := _read_entry(path, key)) is not None:
        return cached
    # Two processes measuring at once (pytest -n 2) would each see half the machine and cache that; the lock makes
    # the second one wait and then reuse the first one's result.
    with exclusive(path):
        if not refresh and (cached := _read_entry(path, key)) is not None:
            return cached
        measured = measure_ceilings()
        _write_entry(path, measured)
    return measured


def _read_entry(path: Path, key: str) -> Ceilings | None:
    """The cached entry for ``key``, or None when the file or entry is missing, unreadable or malformed."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("schema") != SCHEMA:
            return None
        entry = data["machines"][key]
        return Ceilings.from_dict(entry)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _write_entry(path: Path, ceilings: Ceilings) -> None:
    """Merge ``ceilings`` into the cache file atomically, keeping other machines' entries."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            machines = data["machines"] if data.get("schema") == SCHEMA and isinstance(data["machines"], dict) else {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            machines = {}
        machines[ceilings.key] = ceilings.to_dict()
        text = json.dumps({"schema": SCHEMA, "machines": machines}, indent=2, sort_keys=True) + "\n"
        write_text_atomic(path, text)  # a reader never sees half a file
    except OSError as err:
        warnings.warn(
            f"could not cache the measured ceilings at {path} ({err}); they will be measured again next time. "
            "Set TESSERA_CACHE_DIR to a writable directory to keep them",
            RuntimeWarning,
            stacklevel=3,
        )
