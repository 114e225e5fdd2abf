"""Register every Tessera torch custom op: ``import tessera.integrations.torch_ops``.

Attention (``tessera::attention``, ``tessera::varlen_attention``, ``tessera::attention_backward``) lives in
:mod:`tessera.integrations.attention_ops`, paged attention (``tessera::paged_attention``, ``plan(...).run`` as an
op) in :mod:`tessera.integrations.paged_ops`, the kernel library's hot ops (``tessera::rms_norm``,
``tessera::fused_add_rms_norm``, ``tessera::rope``, ``tessera::silu_and_mul``, ``tessera::qmatmul``) in
:mod:`tessera.integrations.kernel_ops`. ``tessera.attention`` and ``tessera.kernels`` import them on first need (a
``torch.compile`` trace, or attention on tensors that require a gradient), so plain inference never pays for the
registration; import this module to call ``torch.ops.tessera.*`` directly.
"""

from __future__ import annotations

from tessera.integrations import attention_ops, kernel_ops, paged_ops
from tessera.integrations.attention_ops import dense_attention, ragged_attention
from tessera.integrations.paged_ops import paged_attention
from tessera.integrations.kernel_ops import apply_rope, qmatmul, rms_norm, silu_and_mul
from tessera.integrations.spec_handles import lookup_spec, register_spec, release

#: the qualified names of the ops this package registers
OPS = ("tessera::attention", "tessera::varlen_attention", "tessera::attention_backward", "tessera::paged_attention",
       "tessera::rms_norm",
       "tessera::fused_add_rms_norm", "tessera::rope", "tessera::silu_and_mul", "tessera::qmatmul")

__all__ = ["OPS", "apply_rope", "attention_ops", "dense_attention", "kernel_ops", "lookup_spec", "paged_attention",
           "paged_ops", "qmatmul", "ragged_attention", "register_spec", "release", "rms_norm", "silu_and_mul"]
