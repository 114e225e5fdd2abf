"""``triton``: NVIDIA GPUs through Triton kernels generated from the spec.

Importing this package does not import triton; the kernels load on first use.
"""

from tessera.backends.triton.backend import TritonBackend

__all__ = ["TritonBackend"]
