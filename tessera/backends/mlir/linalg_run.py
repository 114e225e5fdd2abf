"""Running the linalg attention kernel (the form GPU targets compile) on this CPU.

The ``mlir`` backend runs the loop kernel on llvm-cpu; the linalg kernel is what cuda, rocm and vulkan-spirv compile
(:mod:`tessera.backends.mlir.targets`). Compiling that same text for llvm-cpu and running it here is how the IR shipped
to GPUs is checked against the float64 oracle on a machine without one.
"""

from __future__ import annotations

import numpy as np
import torch

from tessera.mlir.attention_linalg import LinalgAttentionKernel


def dense_attention(kernel: LinalgAttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a dense batch through ``kernel`` compiled for llvm-cpu.

    Parameters
    ----------
    q : ``[B, Tq, Hq, D]``; k, v : ``[B, S, Hkv, D]`` (any float dtype; computed in float32). Query ``i`` of each
        sequence sits at position ``S - Tq + i``.

    Returns
    -------
    out float32 ``[B, Tq, Hq, D]`` and lse float32 ``[B, Tq, Hq]`` (sinks included, except with no keys at all:
    IREE cannot take an empty buffer, so that case returns 0 and -inf without a call).
    """
    from tessera.mlir.iree_compile import load_function

    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0]:
        raise ValueError(f"expected q [B, Tq, Hq, D] and k, v [B, S, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    batch, tq, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    if d != kernel.head_dim or k.shape[3] != d or hq % hkv:
        raise ValueError(f"head dim {d} (kernel: {kernel.head_dim}) or heads {hq}/{hkv} do not fit the kernel")
    out = torch.zeros(batch, tq, hq, d)
    lse = torch.full((batch, tq, hq), float("-inf"))
    if out.numel() == 0 or s == 0:  # nothing to attend: IREE refuses zero-byte buffers
        return out, lse
    fn = load_function(kernel.text, kernel.entry)
    q5 = q.float().reshape(batch, tq, hkv, hq // hkv, d).contiguous()
    res_out, res_lse = fn(q5.numpy(), k.float().contiguous().numpy(), v.float().contiguous().numpy(), kernel.aux_i,
                          kernel.aux_f)
    out = torch.from_numpy(np.asarray(res_out.to_host())).reshape(batch, tq, hq, d)
    lse = torch.from_numpy(np.asarray(res_lse.to_host())).reshape(batch, tq, hq)
    return out, lse
