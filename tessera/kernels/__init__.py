"""``tessera.kernels``: the op set beyond attention, one API over every backend.

Each public function validates its arguments (clear errors at the boundary) and dispatches through
:mod:`tessera.kernels.registry` to ``reference`` (float64), ``cpu`` or ``triton``; ``backend="auto"`` picks by device.
The families and their exact semantics are documented in ``docs/kernels/``.

Examples
--------
>>> from tessera.kernels import rms_norm, silu_and_mul, qmatmul, quantize
>>> y, r = rms_norm(x, w, 1e-5, residual=r)          # fused residual add, returns the new residual
>>> h = silu_and_mul(gate_up)                        # [..., 2I] -> [..., I]
>>> out = qmatmul(x, quantize(w, "int4", group_size=32))
"""

from tessera.kernels.activations import gelu, gelu_and_mul, relu, silu, silu_and_mul
from tessera.kernels.embedding import embed, gemma_embed_scale, lm_head
from tessera.kernels.moe import SharedExpert, combine, grouped_matmul, moe_mlp, permute, route
from tessera.kernels.norms import layer_norm, qk_norm, rms_norm
from tessera.kernels.quant import QuantizedWeight, dequantize, from_gguf, matmul, qmatmul, quantize
from tessera.kernels.rope import RotaryEmbedding, apply_rope
from tessera.kernels.sampling import SamplerParams, argmax, filtered_probs, log_softmax, sample, softmax, topk

__all__ = [
    "QuantizedWeight", "RotaryEmbedding", "SamplerParams", "SharedExpert", "apply_rope", "argmax", "combine",
    "dequantize", "embed", "filtered_probs", "from_gguf", "gelu", "gelu_and_mul", "gemma_embed_scale", "grouped_matmul", "layer_norm",
    "lm_head", "log_softmax", "matmul", "moe_mlp", "permute", "qk_norm", "qmatmul", "quantize", "relu", "rms_norm",
    "route", "sample", "silu", "silu_and_mul", "softmax", "topk",
]
