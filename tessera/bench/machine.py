"""Who ran a benchmark and what the machine could do at the time: a fingerprint and ceilings measured in-run.

The cached ceilings of :func:`tessera.hw.get_ceilings` are for quick reports; a benchmark file measures again, in
the same run as its cases, because a shared machine's available bandwidth changes from hour to hour.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import torch

from tessera.hw import probes
from tessera.hw.devices import Device

#: libraries whose versions decide kernel speed; recorded in every result file
LIBRARIES = ("torch", "numpy", "numba", "llvmlite", "triton", "transformers")


@dataclass(frozen=True)
class RunCeilings:
    """Rates this machine reached during the run (GB = 1e9 bytes, GFLOP = 1e9 FLOP)."""

    gemm_fp32_gflops: float
    gemm_bf16_gflops: float
    read_gbps: float
    copy_gbps: float
    seconds: float

    def peak_gflops(self, dtype: str) -> float:
        """The GEMM ceiling for ``dtype`` ("fp32", "bf16", "fp16"; half types use the bf16 probe)."""
        return self.gemm_fp32_gflops if dtype == "fp32" else self.gemm_bf16_gflops

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def device(self) -> Device:
        """This CPU as a roofline :class:`~tessera.hw.devices.Device`, with the rates of this run (built once per
        ceilings: the report asks for it for every case)."""
        return _device_of(self)


@functools.lru_cache(maxsize=8)
def _device_of(ceilings: RunCeilings) -> Device:
    self = ceilings
    return Device(
            name=f"{probes.cpu_model()}, {probes.num_cores()} cores (this run)", kind="cpu",
            peak_flops={"fp32": self.gemm_fp32_gflops * 1e9, "bf16": self.gemm_bf16_gflops * 1e9,
                        "fp16": self.gemm_bf16_gflops * 1e9},
            mem_bw=self.read_gbps * 1e9, sram_bytes=0, source="measured in this tessera bench run",
        )


def measure_run_ceilings(quick: bool = False) -> RunCeilings:
    """fp32 and bf16 GEMM, streaming read and copy bandwidth, all threads; ~5 s (``quick``: fewer repeats and a
    smaller read buffer, ~3 s)."""
    start = time.perf_counter()
    n = probes.GEMM_SIZE  # smaller products under-report the ceiling (seen: 104 vs 240 GFLOP/s at n = 1024)
    gemm_fp32 = probes.measure_gemm_gflops(n, reps=4 if quick else 8)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, n, generator=gen).to(torch.bfloat16)
    gemm_bf16 = 2.0 * n**3 / probes.best_seconds(lambda: torch.matmul(a, b), 3 if quick else 5) / 1e9
    num_bytes = (256 << 20) if quick else probes.READ_BYTES
    read, _ = probes.measure_read_gbps(num_bytes, reps=5 if quick else 10)
    src = torch.empty(num_bytes // 8, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    # a copy reads and writes each byte: count both, as STREAM does
    copy = 2 * src.numel() * 4 / probes.best_seconds(lambda: dst.copy_(src), 5 if quick else 10) / 1e9
    return RunCeilings(gemm_fp32, gemm_bf16, read, copy, time.perf_counter() - start)


def fingerprint() -> dict[str, object]:
    """CPU model, cores, ISA flags, library versions, Python, OS and the git commit (when run from a checkout)."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "cpu_model": probes.cpu_model(),
        "num_cores": probes.num_cores(),
        "torch_threads": torch.get_num_threads(),
        "isa": list(probes.isa_flags()),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "libraries": versions,
        "commit": git_commit(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }


def git_commit() -> str | None:
    """``HEAD``'s hash (with ``-dirty`` when the tree has changes) of the checkout tessera runs from, or None."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def host_backend() -> str:
    """The backend the suites time as "ours" on host tensors: ``TESSERA_BENCH_BACKEND`` when set, else the
    highest-priority usable backend that runs CPU tensors (what ``backend="auto"`` picks for them)."""
    from tessera.backends import registry

    chosen = os.environ.get("TESSERA_BENCH_BACKEND")
    if chosen:
        registry.get(chosen)  # unknown names raise here, with the list of known ones
        return chosen
    first = registry.by_priority("cpu")
    if not first:
        raise RuntimeError("no usable backend runs CPU tensors; `tessera info` says why each is unusable")
    return first[0].name
