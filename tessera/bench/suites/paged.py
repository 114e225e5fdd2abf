"""Paged-KV attention on the cpu backend (plan once, run one layer) against "gather the pages, then SDPA".

Heads 32/8, D = 128, pages of 16 tokens shuffled through the pool, mixed context lengths, so no sequence's keys are
contiguous. Decode cases report K/V bytes read (memory-bound); the mixed case has prefill chunks next to decodes.
``benchmarks/paged_cpu.py`` reuses :func:`make_batch` and :func:`gather_then_sdpa` for its longer report.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tessera.attention import AttentionSpec, causal, plan
from tessera.bench.harness import Case, copies_for, rotating
from tessera.bench.machine import host_backend

HQ, HKV, D, PAGE = 32, 8, 128, 16


def make_batch(kv_lens: list[int], q_lens: list[int], dtype: torch.dtype, gen: torch.Generator):
    """A shuffled page pool holding every sequence, its page table, and the queries: ``(q, k_pages, v_pages,
    table)`` with q ``[sum(q_lens), Hq, D]``, pages ``[num_pages, PAGE, Hkv, D]`` and table int32 ``[B, max_pages]``."""
    pages_per_seq = [math.ceil(kl / PAGE) for kl in kv_lens]
    num_pages = sum(pages_per_seq)
    k_pages = torch.randn(num_pages, PAGE, HKV, D, generator=gen).to(dtype)
    v_pages = torch.randn(num_pages, PAGE, HKV, D, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.zeros(len(kv_lens), max(pages_per_seq), dtype=torch.int32)
    start = 0
    for s, n in enumerate(pages_per_seq):
        table[s, :n] = order[start : start + n]
        start += n
    q = torch.randn(sum(q_lens), HQ, D, generator=gen).to(dtype)
    return q, k_pages, v_pages, table


def make_shared_prefix_batch(n: int, prefix: int, own: int, gen: torch.Generator):
    """``n`` decodes whose first ``prefix`` keys are the same pages, each with ``own`` keys of its own (float32, pages
    in order): ``(q, k_pages, v_pages, table, kv_lens)``, q ``[n, Hq, D]``. The cascade case of
    ``benchmarks/paged_cpu.py`` and ``benchmarks/attention_breakdown.py``."""
    prefix_pages, own_pages = prefix // PAGE, own // PAGE
    num_pages = prefix_pages + n * own_pages
    k_pages = torch.randn(num_pages, PAGE, HKV, D, generator=gen)
    v_pages = torch.randn(num_pages, PAGE, HKV, D, generator=gen)
    table = torch.zeros(n, prefix_pages + own_pages, dtype=torch.int32)
    table[:, :prefix_pages] = torch.arange(prefix_pages, dtype=torch.int32)
    table[:, prefix_pages:] = prefix_pages + torch.arange(n * own_pages, dtype=torch.int32).view(n, own_pages)
    q = torch.randn(n, HQ, D, generator=gen)
    return q, k_pages, v_pages, table, [prefix + own] * n


def cascade_plans(spec: AttentionSpec, q_lens: list[int], kv_lens: list[int], table: torch.Tensor, q: torch.Tensor,
                  k_pages: torch.Tensor, v_pages: torch.Tensor) -> dict[bool, object]:
    """Plans of one step with the shared-prefix cascade on (``True``) and off (``False``), each run once so that its
    backend plan exists."""
    ours = host_backend()  # the backend timed as ours, looked up once
    plans = {}
    for enabled in (True, False):
        plans[enabled] = plan(spec, q_lens, kv_lens, table, PAGE, backend=ours, shared_prefix=enabled)
        plans[enabled].run(q, k_pages, v_pages)
    return plans


def gather_then_sdpa(q, k_pages, v_pages, table, q_lens: list[int], kv_lens: list[int]) -> list[torch.Tensor]:
    """The baseline: copy each sequence's pages into a contiguous tensor, then torch SDPA with a causal bool mask."""
    outs, q0 = [], 0
    for s, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        pages = table[s, : math.ceil(kl / PAGE)].long()
        k = k_pages[pages].reshape(-1, HKV, D)[:kl].transpose(0, 1).unsqueeze(0)
        v = v_pages[pages].reshape(-1, HKV, D)[:kl].transpose(0, 1).unsqueeze(0)
        qs = q[q0 : q0 + ql].transpose(0, 1).unsqueeze(0)
        keep = torch.ones(ql, kl, dtype=torch.bool).tril(kl - ql)
        outs.append(F.scaled_dot_product_attention(qs, k, v, attn_mask=keep, enable_gqa=True))
        q0 += ql
    return outs


def paged_case(name: str, kv_lens: list[int], q_lens: list[int], dtype: torch.dtype, tag: str) -> Case:
    ours = host_backend()  # the backend timed as ours, looked up once
    gen = torch.Generator().manual_seed(0)
    q, k_pages, v_pages, table = make_batch(kv_lens, q_lens, dtype, gen)
    p = plan(AttentionSpec(HQ, HKV, D, mask=causal()), q_lens, kv_lens, table, PAGE, backend=ours)
    kv_bytes = 2 * sum(kv_lens) * HKV * D * k_pages.element_size()
    # a small pool would be read from the cache after the first call: rotate through copies of it
    pools = rotating([(k_pages, v_pages)] + [(k_pages.clone(), v_pages.clone())
                                             for _ in range(copies_for(kv_bytes) - 1)])
    score_entries = sum(ql * (kl - ql) + ql * (ql + 1) / 2 for ql, kl in zip(q_lens, kv_lens))
    decode = max(q_lens) == 1
    return Case("paged", f"{name} {tag}", lambda: p.run(q, *pools()),
                lambda: gather_then_sdpa(q, *pools(), table, q_lens, kv_lens), "gather+sdpa",
                4.0 * D * HQ * score_entries, kv_bytes, tag,
                {"phase": "decode" if decode else "mixed", "context": max(kv_lens), "batch": len(kv_lens)})


def cases(quick: bool) -> Iterator[Case]:
    lens = [1024, 4096, 2048, 3000] if quick else [1024, 16384, 4096, 2048, 8192, 3000, 12000, 6000]
    for batch in (1, 4) if quick else (1, 8, 32):
        for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            yield paged_case(f"decode B={batch}", (lens * 4)[:batch], [1] * batch, dtype, tag)
    yield paged_case("mixed prefill+decode", [2048, 512, 4096, 1024, 3000, 700], [512, 512, 1, 1, 4, 1],
                     torch.float32, "fp32")
