"""Machine-specific tuning of the backends' thresholds, with a persistent per-machine cache.

The cpu backend chooses between code paths by constants (up to how many rows the packed quantized GEMV beats
de-quantized BLAS tiles, when a GEMV or a decode step is worth waking the thread pool). Where those crossovers fall
depends on the machine; ``tessera tune`` measures them here and caches the result per machine fingerprint, and the
kernels read them through :func:`tuned`, a memoized lookup that never measures and falls back to the old constants.

::

    from tessera.tuning import tuned
    if m <= tuned("quant_gemv_max_m", "int4", 128): ...

Files: ``fingerprint.py`` (what identifies a machine), ``cache.py`` (the JSON file), ``registry.py``
(:class:`Tunable`, :func:`tuned`, environment overrides), ``search.py`` (the measurements), ``workload.py`` (the
model shapes they run on), ``summary.py`` (what ``tessera tune --show`` and ``tessera info`` print). Each backend's
tunables live in its own folder, in the module its class names as ``tunables_module``. docs/tuning.md
"""

from tessera.tuning.registry import (
    Crossover,
    Tunable,
    get,
    lookup,
    overriding,
    register,
    reset,
    tuned,
    tunables,
    tuning_enabled,
    unregister,
)
from tessera.tuning.summary import tuning_summary

__all__ = [
    "Crossover", "Tunable", "get", "lookup", "overriding", "register", "reset", "tuned", "tunables",
    "tuning_enabled", "tuning_summary", "unregister",
]
