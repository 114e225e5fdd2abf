"""``triton``: NVIDIA GPUs through Triton kernels generated from the spec.

Importing this package registers the backend without importing triton; the kernels load on first use.
"""

from tessera.backends.base import register
from tessera.backends.triton.backend import TritonBackend

BACKEND = register(TritonBackend())

__all__ = ["BACKEND", "TritonBackend"]
