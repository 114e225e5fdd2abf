"""What a machine can do: this machine's measured ceilings, device descriptors, and the roofline model.

Nothing is measured at import. The first :func:`get_ceilings` call on a machine measures (a few seconds) and caches
the result in ``~/.cache/tessera/ceilings.json`` (or ``$TESSERA_CACHE_DIR``). :mod:`tessera.hw.devices` describes
this CPU (from the ceilings), H100/H200 SXM (datasheets) and a parameterized NPU; :mod:`tessera.hw.roofline` turns
an op's FLOPs and bytes into a lower-bound time on one of them.

Examples
--------
>>> from tessera.hw import get_ceilings, devices, roofline
>>> c = get_ceilings()
>>> c.gemm_fp32_gflops, c.read_gbps
>>> roofline.predict_seconds(2e9, 1e6, devices.H100_SXM, "bf16")
"""

from tessera.hw import devices, roofline
from tessera.hw.ceilings import Ceilings, cache_path, get_ceilings, measure_ceilings
from tessera.hw.devices import H100_SXM, H200_SXM, Device, hypothetical_npu, this_cpu
from tessera.hw.roofline import (
    arithmetic_intensity,
    attainable_flops,
    bound,
    predict_seconds,
)

__all__ = [
    "H100_SXM",
    "H200_SXM",
    "Ceilings",
    "Device",
    "arithmetic_intensity",
    "attainable_flops",
    "bound",
    "cache_path",
    "devices",
    "get_ceilings",
    "hypothetical_npu",
    "measure_ceilings",
    "predict_seconds",
    "roofline",
    "this_cpu",
]
