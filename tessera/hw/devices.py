"""Hardware descriptors for roofline estimates: this CPU (measured), H100/H200 SXM (datasheet), a parameterized NPU.

A :class:`Device` holds the few numbers a roofline needs: peak FLOP/s per dtype, main-memory bandwidth and the size
of the on-chip memory that decides whether a working set streams from DRAM/HBM. Datasheet numbers are dense (no
2:4 sparsity) and are peaks no kernel reaches; the CPU's numbers are what this machine measured, so "fraction of the
roofline" on the CPU means a fraction of what a good BLAS and a streaming read actually reach here.

Examples
--------
>>> from tessera.hw import devices
>>> devices.H100_SXM.peak_flops["bf16"] / devices.H100_SXM.mem_bw        # ridge point, FLOP per byte
295.2...
>>> devices.get("npu").sram_bytes == 64 * 2**20
True
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("cpu", "gpu", "npu")
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")

TERA = 1e12


@dataclass(frozen=True)
class Device:
    """What a roofline needs to know about one accelerator or CPU.

    Parameters
    ----------
    name : str
        Human-readable name, e.g. ``"NVIDIA H100 SXM"``.
    kind : str
        ``"cpu"``, ``"gpu"`` or ``"npu"``.
    peak_flops : dict[str, float]
        Peak FLOP/s per dtype key (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"int8"``; int8 counts
        integer ops). Only the dtypes the device supports are present.
    mem_bw : float
        Main-memory (DRAM / HBM) bandwidth in bytes/s.
    sram_bytes : int
        On-chip memory in bytes: L2 + L3 for a CPU, shared memory + L2 for a GPU, the scratchpad for an NPU.
    sram_bw : float or None
        On-chip bandwidth in bytes/s when known (vendors rarely publish it).
    source : str
        Where the numbers come from: ``"measured on this machine <date>"`` or the datasheet's name.
    """

    name: str
    kind: str
    peak_flops: dict[str, float] = field(hash=False)
    mem_bw: float
    sram_bytes: int
    sram_bw: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Device.kind must be one of {list(KINDS)}, got {self.kind!r}")
        if not self.peak_flops:
            raise ValueError(f"Device {self.name!r}: peak_flops needs at least one dtype key, e.g. {{'fp32': 1e12}}")
        for key, value in self.peak_flops.items():
            if key not in DTYPES:
                raise ValueError(f"Device {self.name!r}: unknown dtype key {key!r} in peak_flops; use {list(DTYPES)}")
            _check_positive(f"peak_flops[{key!r}]", value)
        _check_positive("mem_bw", self.mem_bw)
        if isinstance(self.sram_bytes, bool) or not isinstance(self.sram_bytes, int) or self.sram_bytes < 0:
            raise ValueError(f"Device.sram_bytes must be an int >= 0, got {self.sram_bytes!r}")
        if self.sram_bw is not None:
            _check_positive("sram_bw", self.sram_bw)

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; raises KeyError naming the keys this device has."""
        if dtype not in self.peak_flops:
            raise KeyError(f"{self.name} has no peak for dtype {dtype!r}; it has {sorted(self.peak_flops)}")
        return self.peak_flops[dtype]

    def with_peaks(self, peaks: dict[str, float]) -> Device:
        """This device with ``peaks`` (OP/s per dtype key, e.g. a backend's measured ``int8`` dot-product rate)
        added to or replacing its ``peak_flops``."""
        return dataclasses.replace(self, peak_flops={**self.peak_flops, **peaks}) if peaks else self


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"Device.{name} must be a finite number > 0, got {value!r}")


# NVIDIA H100 Tensor Core GPU datasheet (SXM5 column), dense throughput: the datasheet's tensor-core numbers are
# quoted with 2:4 sparsity, so bf16/fp16 1979 -> 989, fp8/int8 3958 -> 1979, tf32 989 -> 495. fp32 is the non-tensor
# CUDA-core rate. On chip: 50 MB L2 plus 228 KiB of shared memory on each of the 132 SMs.
_HOPPER_FLOPS = {"fp32": 67 * TERA, "tf32": 495 * TERA, "bf16": 989 * TERA, "fp16": 989 * TERA,
                 "fp8": 1979 * TERA, "int8": 1979 * TERA}
_HOPPER_SRAM = 50 * 10**6 + 132 * 228 * 2**10

H100_SXM = Device(
    name="NVIDIA H100 SXM", kind="gpu", peak_flops=_HOPPER_FLOPS, mem_bw=3.35e12, sram_bytes=_HOPPER_SRAM,
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM5, dense), HBM3 3.35 TB/s",
)
# NVIDIA H200 Tensor Core GPU datasheet: the H100's compute and caches, 141 GB of HBM3e at 4.8 TB/s.
H200_SXM = Device(
    name="NVIDIA H200 SXM", kind="gpu", peak_flops=_HOPPER_FLOPS, mem_bw=4.8e12, sram_bytes=_HOPPER_SRAM,
    source="NVIDIA H200 Tensor Core GPU datasheet (SXM, dense), HBM3e 4.8 TB/s",
)


def hypothetical_npu(sram_mib: float = 64, mem_bw_gbps: float = 400, matrix_tflops: float = 200,
                     sram_bw_gbps: float | None = None) -> Device:
    """A made-up NPU for what-if estimates: one matrix engine, a scratchpad, one DRAM interface.

    Parameters
    ----------
    sram_mib : float
        Scratchpad size in MiB.
    mem_bw_gbps : float
        DRAM bandwidth in GB/s (1e9 bytes/s).
    matrix_tflops : float
        bf16/fp16 matrix throughput in TFLOP/s; fp8 and int8 get twice that, fp32 a sixteenth (a typical vector-unit
        rate; the matrix engine takes no fp32).
    sram_bw_gbps : float, optional
        Scratchpad bandwidth in GB/s.

    Examples
    --------
    >>> npu = hypothetical_npu(sram_mib=128, mem_bw_gbps=800)
    >>> npu.mem_bw
    800000000000.0
    """
    matrix = matrix_tflops * TERA
    flops = {"fp32": matrix / 16, "bf16": matrix, "fp16": matrix, "fp8": 2 * matrix, "int8": 2 * matrix}
    return Device(
        name=f"hypothetical NPU ({sram_mib:g} MiB SRAM, {mem_bw_gbps:g} GB/s, {matrix_tflops:g} TFLOP/s bf16)",
        kind="npu", peak_flops=flops, mem_bw=mem_bw_gbps * 1e9, sram_bytes=int(sram_mib * 2**20),
        sram_bw=None if sram_bw_gbps is None else sram_bw_gbps * 1e9,
        source="hypothetical: tessera.hw.devices.hypothetical_npu parameters",
    )


def this_cpu() -> Device:
    """This machine's CPU from :func:`tessera.hw.get_ceilings` (measured once, then cached).

    ``peak_flops["fp32"]`` is the measured fp32 GEMM rate. ``Ceilings`` has no bf16 GEMM probe yet, so ``"bf16"``
    reuses the fp32 number: the cpu backend computes bf16 matmuls in fp32 after widening, so that is also roughly what
    a bf16 model can reach here. ``mem_bw`` is the measured streaming-read bandwidth; ``sram_bytes`` is L2 + L3 as
    sysfs reports them (0 where sysfs is unavailable).
    """
    from tessera.hw.ceilings import get_ceilings  # deferred: imports torch

    c = get_ceilings()
    gemm = c.gemm_fp32_gflops * 1e9
    return Device(
        name=f"{c.cpu_model}, {c.num_cores} cores", kind="cpu", peak_flops={"fp32": gemm, "bf16": gemm},
        mem_bw=c.read_gbps * 1e9, sram_bytes=_cpu_cache_bytes(c.num_cores),
        source=f"measured on this machine {c.measured_at} (bf16 = the fp32 GEMM ceiling)",
    )


def _cpu_cache_bytes(num_cores: int, root: Path = Path("/sys/devices/system/cpu")) -> int:
    """L2 + L3 bytes the first ``num_cores`` CPUs see, each shared cache counted once."""
    seen: dict[tuple[str, str], int] = {}
    for cpu in range(num_cores):
        for index in sorted((root / f"cpu{cpu}" / "cache").glob("index*")):
            try:
                level = (index / "level").read_text().strip()
                shared = (index / "shared_cpu_list").read_text().strip()
                size = _parse_size((index / "size").read_text().strip())
            except (OSError, ValueError):
                continue
            if level in ("2", "3"):
                seen[(level, shared)] = size
    return sum(seen.values())


def _parse_size(text: str) -> int:
    """sysfs cache sizes: ``"1024K"``, ``"32M"`` or plain bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text)


def get(name: str, **npu_params: float) -> Device:
    """A device by short name: ``"cpu"`` (this machine), ``"h100"``, ``"h200"`` or ``"npu"`` (``npu_params`` go to
    :func:`hypothetical_npu`)."""
    key = name.lower().replace("-", "_")
    if key == "cpu":
        return this_cpu()
    if key in ("h100", "h100_sxm"):
        return H100_SXM
    if key in ("h200", "h200_sxm"):
        return H200_SXM
    if key == "npu":
        return hypothetical_npu(**npu_params)
    raise ValueError(f"unknown device {name!r}; choose one of 'cpu', 'h100', 'h200', 'npu'")
