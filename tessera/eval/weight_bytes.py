"""What a model's weights take in memory, counted from the tensors it holds: bytes per weight of the matrices a
format quantizes (the layer projections and the token tables) and the bytes of every weight.

The counts are of the tensors themselves (a packed weight's codes, scales, zero points or mins; a float tensor's
elements), each tensor once however many names refer to it. They are what the model holds, not the process's
resident memory (which also holds the allocator's slack, the interpreter and the kernels' code).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.kernels.quant import QuantizedWeight, StackedWeight
from tessera.models.model import Model
from tessera.models.requantize import is_projection

#: the token tables (``lm_head`` is absent when tied: the logits read ``embed``)
TABLES = ("embed", "lm_head")
# GGUF's names for the packed layouts from_gguf keeps (fmt, group, scales dtype): Q4_0 / Q4_1 / Q8_0
_GGUF_NAMES = {("int4", 32, torch.float16): "Q4_0", ("int4_min", 32, torch.float16): "Q4_1",
               ("int8", 32, torch.float16): "Q8_0"}


@dataclass(frozen=True)
class WeightBytes:
    """Bytes a model's weights take.

    Attributes
    ----------
    matrix_bytes : int
        Bytes of the projections and token tables as held (packed parts included).
    matrix_params : int
        Their weights (``N * K`` each).
    model_bytes : int
        Bytes of every weight the model holds (norms, biases and anything else too).
    held : dict of str to int
        Weights of the projections and tables per format as held (``"int4_min/32 f32 scales"``, ``"Q8_0"``,
        ``"fp32"``): which formats a row's model really runs.
    """

    matrix_bytes: int
    matrix_params: int
    model_bytes: int
    held: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_per_weight(self) -> float:
        """``matrix_bytes / matrix_params``: 4 for float32, 2 for bf16, 1.125 for int8 with a float32 scale per 32."""
        return self.matrix_bytes / self.matrix_params


def weight_bytes(model: Model) -> WeightBytes:
    """Count ``model``'s weights (see :class:`WeightBytes`)."""
    seen: set[int] = set()
    matrix_bytes = matrix_params = model_bytes = 0
    held: dict[str, int] = {}
    for name, w in model.weights.items():
        if id(w) in seen:  # one tensor under two names is held once
            continue
        seen.add(id(w))
        size = _nbytes(w)
        model_bytes += size
        if is_projection(name) or name in TABLES:
            params = int(w.shape[0]) * int(w.shape[1])
            matrix_bytes += size
            matrix_params += params
            for label, count in _labels(w):
                held[label] = held.get(label, 0) + count
    if matrix_params == 0:
        raise ValueError("weight_bytes: the model has no projections or token table")
    return WeightBytes(matrix_bytes, matrix_params, model_bytes, dict(sorted(held.items())))


def format_label(w: torch.Tensor | QuantizedWeight) -> str:
    """A matrix's format as the report names it: ``"fp32"``, ``"Q4_1"`` (a GGUF layout kept as stored),
    ``"int8/32"`` (float32 scales per group of 32), ``"fp8_e4m3/channel"``, or a ggml block format's name."""
    if isinstance(w, torch.Tensor):
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(w.dtype, str(w.dtype))
    if w.scales is None:  # a ggml block format (Q5_0 .. Q6_K): scales inside its blocks
        return w.fmt
    gguf = _GGUF_NAMES.get((w.fmt, w.group_size, w.scales.dtype))
    if gguf is not None:
        return gguf
    group = "channel" if w.group_size == w.shape[1] else str(w.group_size)
    scales = "" if w.scales.dtype == torch.float32 else f" {str(w.scales.dtype).removeprefix('torch.')} scales"
    return f"{w.fmt}/{group}{scales}"


def _labels(w: torch.Tensor | QuantizedWeight | StackedWeight) -> list[tuple[str, int]]:
    parts = w.parts if isinstance(w, StackedWeight) else (w,)
    return [(format_label(p), int(p.shape[0]) * int(p.shape[1])) for p in parts]


def _nbytes(w: torch.Tensor | QuantizedWeight | StackedWeight) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return int(w.nbytes)
