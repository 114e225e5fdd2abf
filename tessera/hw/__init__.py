"""What this machine can do: measured throughput ceilings that benchmarks report against.

Nothing is measured at import. The first :func:`get_ceilings` call on a machine measures (a few seconds) and caches
the result in ``~/.cache/tessera/ceilings.json`` (or ``$TESSERA_CACHE_DIR``).

Examples
--------
>>> from tessera.hw import get_ceilings
>>> c = get_ceilings()
>>> c.gemm_fp32_gflops, c.read_gbps
"""

from tessera.hw.ceilings import Ceilings, cache_path, get_ceilings, measure_ceilings

__all__ = ["Ceilings", "cache_path", "get_ceilings", "measure_ceilings"]
