"""The cpu backend object (temporary stub: delegates to the reference until the kernels land)."""
from tessera.backends.reference.attention import ReferenceBackend


class CpuBackend(ReferenceBackend):
    name = "cpu"
    priority = 10
