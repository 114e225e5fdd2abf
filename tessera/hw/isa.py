"""The instruction-set features of this CPU that kernel variants depend on, detected at run time.

Tessera compiles its CPU kernels on the machine that runs them (Numba targets the host CPU), so a variant that uses an
instruction the CPU lacks must never even be compiled: LLVM cannot select the instruction and aborts the process.
Every variant therefore names the features it needs, and :mod:`tessera.backends.cpu.variants` picks among the
variants whose features this module reports.

The source is LLVM's own view of the host (``llvmlite.binding.get_host_cpu_features``): it is what the compiler
will target, it already accounts for the OS enabling the AVX-512 and AMX register state, and it spells features the
way LLVM's intrinsics need them. ``TESSERA_ISA`` caps the features to imitate an older machine, so that one machine
can run the test suite as an AVX2-only or a baseline x86-64 CPU would:

``TESSERA_ISA=avx2``      AVX2 + FMA + F16C and below (what an AMD Zen 3 reports)
``TESSERA_ISA=baseline``  SSE2 only: every family falls back to its portable variant
"""

from __future__ import annotations

import functools
import os

from llvmlite import binding as llvm_binding

#: feature names (LLVM's spelling) that kernel variants may require
KNOWN = ("sse4.1", "ssse3", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni",
         "avx512bf16", "avx512fp16", "avxvnni", "amx-tile", "amx-int8", "amx-bf16")
#: what each ``TESSERA_ISA`` cap keeps
CAPS: dict[str, frozenset[str]] = {
    "baseline": frozenset(),
    "avx2": frozenset({"sse4.1", "ssse3", "avx", "avx2", "fma", "f16c"}),
    "native": frozenset(KNOWN),
}


@functools.cache
def host_features() -> frozenset[str]:
    """The features of :data:`KNOWN` that LLVM reports for this CPU, before any ``TESSERA_ISA`` cap."""
    reported = llvm_binding.get_host_cpu_features()
    return frozenset(name for name in KNOWN if reported.get(name, False))


def cap() -> str:
    """The ``TESSERA_ISA`` cap in force (``native`` when unset)."""
    value = os.environ.get("TESSERA_ISA", "native").strip().lower() or "native"
    if value not in CAPS:
        raise ValueError(f"TESSERA_ISA must be one of {sorted(CAPS)}, got {value!r}; unset it to use every feature "
                         "this CPU has")
    return value


def features() -> frozenset[str]:
    """The features kernel variants may use here: the host's, limited by ``TESSERA_ISA``."""
    return host_features() & CAPS[cap()]


def missing(required: frozenset[str] | set[str] | tuple[str, ...]) -> list[str]:
    """The features of ``required`` that :func:`features` lacks, sorted (empty when all are present)."""
    unknown = set(required) - set(KNOWN)
    if unknown:
        raise ValueError(f"unknown ISA feature(s) {sorted(unknown)}; known: {list(KNOWN)}")
    return sorted(set(required) - features())


def host_cpu_name() -> str:
    """LLVM's name for this CPU (``znver3``, ``sapphirerapids``, ...): the target the kernels are compiled for."""
    return llvm_binding.get_host_cpu_name()
