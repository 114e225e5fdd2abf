"""``cpu``: FlashAttention-style tiled attention through BLAS, Numba kernels for decode-shaped work."""

from tessera.backends.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
