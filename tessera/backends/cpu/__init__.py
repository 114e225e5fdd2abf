"""``cpu``: FlashAttention-style tiled attention through BLAS, Numba kernels for decode-shaped work."""

from tessera.backends.base import register
from tessera.backends.cpu.backend import CpuBackend

BACKEND = register(CpuBackend())

__all__ = ["BACKEND", "CpuBackend"]
