"""``reference``: the float64 oracle backend."""

from tessera.backends.reference.attention import ReferenceBackend, sequence_attention, varlen_attention_f64

__all__ = ["ReferenceBackend", "sequence_attention", "varlen_attention_f64"]
