"""Micro-benchmarks that measure this machine's ceilings, and a description of its CPU.

Each probe takes a second or two. Nothing here runs at import; :func:`tessera.hw.get_ceilings` calls the probes once
and caches their results.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Callable

import numpy as np
import torch

#: Square fp32 matmul size: large enough that MKL/oneDNN reaches its steady-state kernel, small enough (~0.2 s per
#: product on 2 cores) to repeat a few times.
GEMM_SIZE = 2048
#: The streaming-read buffer: tens of times any last-level cache (32-96 MiB per CCD on current x86 servers).
READ_BYTES = 1 << 30
#: /proc/cpuinfo flags that decide which kernels can run fast; recorded so a slow result can be explained.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "neon", "sve")


def best_seconds(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """The fastest of ``reps`` timed calls of ``fn`` after ``warmup`` untimed ones.

    The minimum, not the median: a ceiling is what the machine can do, and every slower run was disturbed by
    something else (other tenants on a VM, a page fault, a frequency change).
    """
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_gemm_gflops(n: int = GEMM_SIZE, reps: int = 8) -> float:
    """Best fp32 GEMM throughput on square ``[n, n]`` matrices with all threads, in GFLOP/s.

    Both BLAS libraries the cpu backend can reach are timed, ``torch.matmul`` (MKL in torch's x86 wheel) and
    ``numpy.matmul`` (NumPy's bundled OpenBLAS), and the faster counts: on AMD CPUs MKL takes its AVX2 path while
    OpenBLAS may not, and the prefill tiles use whichever is faster.

    Examples
    --------
    >>> measure_gemm_gflops(512, reps=2) > 0
    True
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    out = torch.empty(n, n)
    torch_seconds = best_seconds(lambda: torch.matmul(a, b, out=out), reps)
    a_np, b_np, out_np = a.numpy(), b.numpy(), out.numpy()
    numpy_seconds = best_seconds(lambda: np.matmul(a_np, b_np, out=out_np), reps)
    return 2.0 * n**3 / min(torch_seconds, numpy_seconds) / 1e9


def measure_read_gbps(num_bytes: int = READ_BYTES, reps: int = 10) -> tuple[float, str]:
    """Streaming read bandwidth over a buffer much larger than the last-level cache, with all threads.

    Tries ``torch.sum`` and a Numba ``prange`` reduction over the same fp32 buffer and keeps the faster: the
    ceiling is the best any reader reaches, and which one wins differs between machines.

    Returns
    -------
    (GB/s with GB = 1e9 bytes, the name of the method that reached it)
    """
    return ReadProbe(num_bytes)(reps)


class ReadProbe:
    """:func:`measure_read_gbps` with its buffer kept, to measure the read ceiling again and again in one run.

    Why: on a shared VM the bandwidth left to one guest moves in phases of minutes (a Zen 5 VM read 48-52 GB/s for
    minutes, then 75-80, then 50 again, 2026-12-05), so a fraction of a ceiling measured once at the start of a
    benchmark mixes two phases. A probe right before and right after each timed run (four 1 GiB passes per reader at
    ``reps=3``, ~0.2 s) gives the ceiling of the moment the run saw.

    Parameters
    ----------
    num_bytes : size of the fp32 buffer read; allocated and touched once, here (1 GiB by default).
    """

    def __init__(self, num_bytes: int = READ_BYTES) -> None:
        # fill_ rather than randn: it touches every page (so page faults stay out of the timed reads) at memory
        # speed.
        self.num_bytes = num_bytes
        self._buf = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
        self._numba_sum = _numba_parallel_sum()

    def __call__(self, reps: int = 10) -> tuple[float, str]:
        """The best GB/s of ``reps`` passes per reader, and the reader that reached it (see
        :func:`measure_read_gbps`)."""
        buf = self._buf
        results = {"torch.sum": self.num_bytes / best_seconds(lambda: buf.sum(), reps) / 1e9}
        if self._numba_sum is not None:
            arr, numba_sum = buf.numpy(), self._numba_sum
            try:
                results["numba prange sum"] = self.num_bytes / best_seconds(lambda: numba_sum(arr), reps) / 1e9
            except Exception:  # Numba compiles on the first call; if it can't here, torch.sum's number stands alone
                self._numba_sum = None
        method = max(results, key=results.__getitem__)
        return results[method], method


def _numba_parallel_sum() -> Callable | None:
    """A parallel fp32 sum that Numba compiles on its first call, or None when Numba is not installed."""
    try:
        from numba import njit, prange
    except ImportError:
        return None

    # fastmath lets LLVM reassociate the sum into several vector accumulators; without it the loop is latency-bound
    # on one add chain and measures the core, not the memory.
    @njit(parallel=True, fastmath=True, cache=False)
    def parallel_sum(a: np.ndarray) -> float:  # pragma: no cover - compiled
        total = 0.0
        for i in prange(a.size):
            total += a[i]
        return total

    return parallel_sum


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds all processes have used, CPU seconds this process has used), or None off Linux.

    Two snapshots around a probe give :func:`others_busy_fraction`. Hypervisor steal time counts as used: a
    neighbour VM takes cycles from the probe just as a local process does.
    """
    try:
        with open("/proc/stat", encoding="ascii") as f:
            jiffies = [int(x) for x in f.readline().split()[1:]]
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    # /proc/stat's first line: user nice system idle iowait irq softirq steal guest guest_nice (guest is in user).
    busy = sum(jiffies[:8]) - jiffies[3] - jiffies[4]
    own = os.times()
    return busy / ticks, own.user + own.system


def others_busy_fraction(before: tuple[float, float] | None, after: tuple[float, float] | None, wall: float) -> float:
    """Fraction of the machine's CPU time that other processes used between two :func:`cpu_seconds` snapshots.

    0.0 means the probes had the machine to themselves; 0.5 on a 2-core machine means another process kept one
    core busy, and the ceilings measured then are low. Returns 0.0 when unknown.
    """
    if before is None or after is None or wall <= 0:
        return 0.0
    others = (after[0] - before[0]) - (after[1] - before[1])
    return min(1.0, max(0.0, others / (wall * (os.cpu_count() or 1))))


def cpu_model() -> str:
    """The CPU's name, with family/model/stepping when /proc/cpuinfo has them.

    Hypervisors often report a bare family name ("AMD EPYC"), which would make a Zen 3 and a Zen 5 host look alike;
    the family/model numbers tell them apart, so the ceilings cache re-measures when moved between them.
    """
    fields = _cpuinfo_fields()
    name = fields.get("model name") or fields.get("Model") or platform.processor() or platform.machine() or "unknown"
    ids = [f"{key} {fields[key]}" for key in ("cpu family", "model", "stepping") if key in fields]
    return f"{name} ({', '.join(ids)})" if ids else name


def isa_flags() -> tuple[str, ...]:
    """The entries of :data:`ISA_FLAGS` this CPU advertises (empty when /proc/cpuinfo is unavailable)."""
    fields = _cpuinfo_fields()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return tuple(flag for flag in ISA_FLAGS if flag in flags)


def num_cores() -> int:
    """Logical CPUs this process may run on (its affinity mask, which containers often narrow), at least 1."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's ``key: value`` lines of /proc/cpuinfo ({} off Linux)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break  # the first processor block is enough; all cores of a host share a model
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields
