"""``reference``: the float64 oracle backend."""

from tessera.backends.base import register
from tessera.backends.reference.attention import ReferenceBackend, sequence_attention, varlen_attention_f64

BACKEND = register(ReferenceBackend())

__all__ = ["BACKEND", "ReferenceBackend", "sequence_attention", "varlen_attention_f64"]
