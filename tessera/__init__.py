"""Tessera: declarative attention kernels and LLM bring-up.

The engine's entry points are importable from the top level (loaded on first use, so ``import tessera`` stays light):

>>> import tessera
>>> llm = tessera.LLM()                       # SmolLM2-135M-Instruct
>>> llm.generate(["Hello"], tessera.SamplingParams(temperature=0.0, max_tokens=8))[0].text
"""

import os as _os

__version__ = "0.1.0"

# Thread-pool behaviour on small shared CPUs, set before torch / NumPy load their runtimes (a no-op when the user set
# them, or imported torch / NumPy first: then export them in the shell). Idle OpenMP threads (torch) and OpenBLAS
# threads (NumPy) otherwise spin for up to ~0.1 s after each call and starve Numba's kernels on the same cores:
# measured on 2 cores, 32-request Q4_1 throughput 104-108 tok/s with OpenBLAS's default spin vs 125-129 with
# OPENBLAS_THREAD_TIMEOUT=4; see docs/performance.md for OMP_WAIT_POLICY.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
# ...but a passive pool sleeps as soon as a region ends, and waking it for the next costs 20-73 us: a decode step is
# one parallel region per layer, 30 a token. A bounded spin (libgomp counts ~100k spins per ms: ~0.2 ms) keeps the
# pool awake between a step's layers and lets it sleep between steps. Zen 4, 2 threads, alternating processes
# (2026-12-02): SmolLM2 Q4_1 batch-1 decode 104.5 / 111.7 / 107.0 tok/s passive vs 112.4 / 122.7 / 118.2 with the
# spin; a 32-request load with 8 in flight 200.8 / 180.2 vs 214.2 / 208.9; prompt prefill within noise.
_os.environ.setdefault("GOMP_SPINCOUNT", "20000")

# Compiled Numba kernels live in a directory keyed by their sources (Numba alone misses edits to inlined helpers).
from tessera._numba_cache import configure as _configure_numba_cache  # noqa: E402

_configure_numba_cache()
del _configure_numba_cache

#: top-level name -> the module that defines it
_LAZY = {
    "LLM": "tessera.engine.llm",
    "SamplingParams": "tessera.engine.params",
    "RequestOutput": "tessera.engine.params",
    "CompletionOutput": "tessera.engine.params",
    "load_model": "tessera.models",
}

__all__ = ["__version__", *_LAZY]
del _os


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'tessera' has no attribute {name!r}")
