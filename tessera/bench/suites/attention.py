"""Dense attention on the cpu backend against torch SDPA: causal prefill and batched decode over context lengths.

Heads are Llama-3-8B's (32 query, 8 KV, D = 128). Prefill FLOPs count only the unmasked (causal) score entries:
``4 * D * Hq * S (S + 1) / 2`` per sequence. Decode is memory-bound: bytes are the K and V read once (the queries
and outputs are noise), and its KV is ``B * L * 2 * Hkv * D * 4`` bytes in fp32 (256 MiB at B = 8, L = 16k), which
is far larger than any cache, so no rotation of inputs is needed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tessera.attention import AttentionSpec, attention, causal
from tessera.bench.harness import Case
from tessera.bench.machine import host_backend

HQ, HKV, D = 32, 8, 128


def _prefill(seq: int, dtype: torch.dtype, tag: str) -> Case:
    ours = host_backend()  # the backend timed as ours, looked up once
    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(1, seq, HQ, D, generator=gen).to(dtype)
    k = torch.randn(1, seq, HKV, D, generator=gen).to(dtype)
    v = torch.randn(1, seq, HKV, D, generator=gen).to(dtype)
    spec = AttentionSpec(HQ, HKV, D, mask=causal())
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    flops = 4.0 * D * HQ * seq * (seq + 1) / 2
    bytes_moved = (q.numel() + k.numel() + v.numel() + q.numel()) * q.element_size()
    return Case("attention", f"prefill causal {tag} S={seq}", lambda: attention(q, k, v, spec, backend=ours),
                lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True), "sdpa",
                flops, bytes_moved, tag, {"phase": "prefill", "context": seq})


def _decode(batch: int, ctx: int, dtype: torch.dtype, tag: str) -> Case:
    ours = host_backend()  # the backend timed as ours, looked up once
    gen = torch.Generator().manual_seed(ctx)
    q = torch.randn(batch, 1, HQ, D, generator=gen).to(dtype)
    k = torch.randn(batch, ctx, HKV, D, generator=gen).to(dtype)
    v = torch.randn(batch, ctx, HKV, D, generator=gen).to(dtype)
    spec = AttentionSpec(HQ, HKV, D, mask=causal())
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return Case("attention", f"decode {tag} B={batch} L={ctx}", lambda: attention(q, k, v, spec, backend=ours),
                lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True), "sdpa",
                4.0 * D * HQ * ctx * batch, (k.numel() + v.numel()) * k.element_size(), tag,
                {"phase": "decode", "context": ctx, "batch": batch})


def cases(quick: bool) -> Iterator[Case]:
    prefill = (256, 512, 1024) if quick else (512, 1024, 2048, 4096)
    decode = (1024, 2048, 4096) if quick else (1024, 2048, 4096, 8192, 16384)
    for seq in prefill:
        yield _prefill(seq, torch.float32, "fp32")
    if not quick:
        yield _prefill(2048, torch.bfloat16, "bf16")
    for ctx in decode:
        yield _decode(8, ctx, torch.float32, "fp32")
    yield _decode(8, decode[-1], torch.bfloat16, "bf16")
