"""Rotary embeddings: our in-place ``apply_rope`` (cpu backend) vs transformers' eager formulation
(``q * cos + rotate_half(q) * sin`` on a gathered full-width cos/sin cache), Llama-3-8B heads (32 q, 8 kv, D=128)."""

from __future__ import annotations

import torch

from tessera.bench.kernel_cases import KernelCase
from tessera.bench.machine import host_backend
from tessera.kernels.rope import RotaryEmbedding, apply_rope

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_POSITION = 32, 8, 128, 8192


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _case(tokens: int, dtype: torch.dtype, rope: RotaryEmbedding, full_cos: torch.Tensor,
          full_sin: torch.Tensor) -> KernelCase:
    ours = host_backend()  # the backend timed as ours, looked up once
    q = torch.randn(tokens, NUM_Q_HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    # decode sits at the end of a long context, prefill is a chunk somewhere inside it
    positions = torch.arange(MAX_POSITION - tokens, MAX_POSITION) if tokens == 1 else torch.arange(1000, 1000 + tokens)

    def torch_eager():
        cos, sin = full_cos[positions][:, None].to(dtype), full_sin[positions][:, None].to(dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    elems = q.numel() + k.numel()
    moved = 2 * elems * q.element_size() + 2 * tokens * (HEAD_DIM // 2) * 4
    name = f"apply_rope T={tokens} {NUM_Q_HEADS}/{NUM_KV_HEADS}x{HEAD_DIM} {str(dtype).removeprefix('torch.')}"
    return KernelCase("rope", name, lambda: apply_rope(q, k, positions, rope, backend=ours), torch_eager, moved)


def cases(quick: bool) -> list[KernelCase]:
    rope = RotaryEmbedding.build(HEAD_DIM, MAX_POSITION, base=500000.0)
    full_cos, full_sin = torch.cat((rope.cos, rope.cos), -1), torch.cat((rope.sin, rope.sin), -1)
    token_counts = (1, 64) if quick else (1, 64, 512)
    return [_case(t, dtype, rope, full_cos, full_sin) for t in token_counts for dtype in (torch.float32, torch.bfloat16)]
