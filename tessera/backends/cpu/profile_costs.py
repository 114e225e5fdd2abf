"""What ``tessera profile`` counts for the cpu backend's own kernels (the generic ops are counted in
:mod:`tessera.profiling.accounting`, which asks each backend for :meth:`CpuBackend.profile_targets`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tessera.backends.cpu.kernel_args import LayerConfig, LayerWeights
from tessera.hw import roofline


def fused_layers_cost(x: np.ndarray, h: np.ndarray, layers: Any, kvs: Any, config: LayerConfig,
                      positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, slots: np.ndarray, schedule: Any,
                      *rest: Any) -> roofline.Cost:
    """A run of fused decoder layers (``decode_layer.decoder_layers_kernel``), per layer: its four weight matrices
    once, ``2 T params`` FLOPs, plus each sequence's attention: its new tokens (several in a speculative verification
    step) over its cached keys, each key read once per sequence. ``layers`` / ``kvs`` are the kernel's typed lists of
    ``(weights, norms)`` and ``(k_rows, v_rows, kv_quant)``."""
    tokens = x.shape[0]
    elem = x.itemsize
    if schedule is not None and hasattr(schedule, "seq_q_len"):
        q_lens, kv_lens = [int(q) for q in schedule.seq_q_len], [int(k) for k in schedule.seq_kv_len]
    else:  # one query per sequence
        q_lens, kv_lens = [1] * tokens, [int(p) + 1 for p in positions]
    flops = traffic = 0.0
    for i in range(len(layers)):
        weights = LayerWeights(*layers[i][0])
        k_rows = kvs[i][0]
        mats = [projection_params_bytes(w) for w in (weights.qkv_w, weights.o_w, weights.gate_up_w, weights.down_w)]
        attn = roofline.attention_cost(q_lens, kv_lens, int(config.num_q_heads), k_rows.shape[1], k_rows.shape[2],
                                       elem)
        acts = 4 * tokens * x.shape[1] * elem  # x and h, read and written in place
        flops += 2.0 * tokens * sum(p for p, _ in mats) + attn[0]
        traffic += float(sum(b for _, b in mats) + attn[1] + acts)
    return flops, traffic


def projection_params_bytes(w: Any) -> tuple[int, int]:
    """(parameters, bytes) of a fused-layer projection: a float array, or a packed tuple ``(codes [N, K/2], scales,
    offsets, has_min, group)`` / ``(codes [N, K], scales, group)`` whose bytes are the codes plus the per-group scales
    and offsets."""
    if isinstance(w, tuple):
        arrays = [a for a in w if hasattr(a, "nbytes") and hasattr(a, "dtype")]
        codes = arrays[0]
        per_byte = 2 if codes.dtype.kind == "u" else 1  # uint8 holds two int4 codes, int8 one
        return int(codes.size) * per_byte, int(sum(a.nbytes for a in arrays))
    return int(w.size), int(w.nbytes)


#: (module path, attribute, op name, cost function): ``fused_decode`` imported the kernel by name, so it is patched
#: there
PROFILE_TARGETS = (
    ("tessera.backends.cpu.ops.fused_decode", "decoder_layers_kernel", "fused_decoder_layers", fused_layers_cost),
)
