"""Tessera inside the PyTorch ecosystem: torch custom ops and a transformers attention backend.

Modules
-------
``spec_handles``     the process-wide table that turns an :class:`~tessera.attention.AttentionSpec` (whose masks and
                     score functions hold Python callables) into an integer a torch op schema can carry
``attention_grad``   the float64 backward of attention (gradients of q, k, v and sinks), recomputed from the spec
``attention_ops``    ``tessera::attention`` / ``tessera::varlen_attention`` (+ their backward op): fake
                     implementations for ``torch.compile`` / ``torch.export``, autograd, and the eager autograd path
``kernel_ops``       ``tessera::rms_norm``, ``tessera::fused_add_rms_norm``, ``tessera::rope``,
                     ``tessera::silu_and_mul``, ``tessera::qmatmul``
``torch_ops``        imports the two op modules: ``import tessera.integrations.torch_ops`` registers every op
``transformers``     ``register()``: ``attn_implementation="tessera"`` for Hugging Face transformers models

``docs/integrations.md`` describes what users write and what the limits are.
"""
