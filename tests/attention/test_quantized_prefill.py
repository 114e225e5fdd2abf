"""Prefill tiles and shared-prefix cascades over quantized KV pages on the cpu backend: they read the codes (no
de-quantized copy of the pages is made) and match the float64 oracle on the de-quantized K/V.

The decode rows of the same steps are covered by ``test_paged_quantized.py``; the tolerance class is the one
described there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.attention import AttentionSpec, causal, plan, sliding_window
from tessera.backends.cpu.kv_gather import dequantize_token_rows, gather_heads
from tessera.kv.quantized import KV_FORMATS, QuantizedPages, dequantize_kv
from tests.attention.cases import VARIANTS, oracle, seed_of
from tests.attention.test_paged import shared_prefix_batch
from tests.attention.test_paged_quantized import check_quantized, quantized
from tests.attention.tolerances import assert_matches_oracle

FORMATS = sorted(KV_FORMATS)
PREFILL_VARIANTS = [v for v in VARIANTS if v.name in {"causal", "window16", "alibi_causal", "custom_dilated"}]


pytestmark = pytest.mark.usefixtures("float_qk")  # the float Q.K path (conftest.py)


@pytest.fixture
def no_page_dequantize(monkeypatch):
    """Fail if anything de-quantizes whole pages (the path a backend that cannot read codes takes)."""
    def refuse(self, dtype, pages=None):
        raise AssertionError("the cpu backend de-quantized the pages instead of reading the codes")

    monkeypatch.setattr(QuantizedPages, "dequantize", refuse)


@pytest.mark.parametrize("variant", [pytest.param(v, id=v.name) for v in PREFILL_VARIANTS])
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_reads_quantized_pages(fmt: str, variant, no_page_dequantize, request) -> None:
    # prompt chunks (queries at the end of longer caches), a whole prompt, a decode row in the same step; odd
    # lengths, partial last pages, GQA 4
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    check_quantized("cpu", fmt, (37, 70, 1, 23), (37, 131, 50, 89), 8, 2, 40, variant, 16, torch.float32, gen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_low_precision_prefill_reads_quantized_pages(fmt: str, dtype: torch.dtype, no_page_dequantize,
                                                     request) -> None:
    # bf16 queries take the bf16 P.V product where this CPU has one (the prefill_pv variant)
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    causal_variant = next(v for v in VARIANTS if v.name == "causal")
    check_quantized("cpu", fmt, (33, 5), (33, 70), 6, 3, 64, causal_variant, 8, dtype, gen)


@pytest.mark.parametrize("head_dim", [32, 40], ids=["prefix-kernel", "prefix-blas"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cascade_reads_quantized_pages(fmt: str, head_dim: int, no_page_dequantize) -> None:
    from tessera.backends.cpu.cascade import MIN_PREFIX_KEYS

    gen = torch.Generator().manual_seed(seed_of(f"cascade-{fmt}-{head_dim}"))
    prefix_pages = MIN_PREFIX_KEYS // 16 + 2
    layout, q, k_pages, v_pages, table, _, _ = shared_prefix_batch(gen, torch.float32, prefix_pages, [1, 17, 40, 5],
                                                                   d=head_dim)
    spec = AttentionSpec(8, 2, head_dim, mask=causal())
    kq, vq = quantized(k_pages, fmt), quantized(v_pages, fmt)
    p = plan(spec, list(layout.q_lens), list(layout.kv_lens), table, 16, backend="cpu")
    out, lse = p.run(q, kq, vq, return_lse=True)
    assert len(p._state.cascades) == 1  # white-box: the step did take the cascade
    kd, vd = dequantize_kv(kq.codes, kq.scales), dequantize_kv(vq.codes, vq.scales)
    rows_k, rows_v = [], []
    for s, kl in enumerate(layout.kv_lens):
        n = -(-kl // 16)
        rows_k.append(kd[table[s, :n].long()].reshape(-1, 2, head_dim)[:kl])
        rows_v.append(vd[table[s, :n].long()].reshape(-1, 2, head_dim)[:kl])
    ref_out, ref_lse = oracle(q, torch.cat(rows_k), torch.cat(rows_v), layout, spec)
    assert_matches_oracle(out, lse, ref_out, ref_lse, torch.float32, f"cascade {fmt} D={head_dim}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_gathers_equal_dequantize_kv(fmt: str) -> None:
    """The gathers de-quantize bit for bit as dequantize_kv (float32), head-major and token-major, serial and
    parallel sizes, shuffled rows; scales spread over orders of magnitude."""
    gen = torch.Generator().manual_seed(seed_of(f"gather-{fmt}"))
    for rows_n, hkv, d in ((1, 1, 8), (77, 3, 40), (3000, 2, 64)):
        x = torch.randn(rows_n + 5, hkv, d, generator=gen) * torch.logspace(-4, 4, hkv).view(1, hkv, 1)
        pages = quantized(x, fmt)
        rows = torch.randperm(rows_n + 5, generator=gen)[:rows_n].numpy().astype(np.int64)
        want = dequantize_kv(pages.codes, pages.scales)[torch.from_numpy(rows)]
        assert torch.equal(gather_heads(pages, rows), want.permute(1, 0, 2))
        assert torch.equal(dequantize_token_rows(pages, rows), want)
    assert gather_heads(pages, np.zeros(0, dtype=np.int64)).shape == (2, 0, 64)


def test_window_prefill_over_quantized_pages_in_one_plan(no_page_dequantize) -> None:
    # a plan reused across layers (one plan, two pools per format) equals the plan run on float32 de-quantized pools
    gen = torch.Generator().manual_seed(seed_of("window-two-pools"))
    spec = AttentionSpec(4, 1, 16, mask=sliding_window(9))
    table = torch.randperm(12, generator=gen).to(torch.int32).view(2, 6)
    p = plan(spec, [21, 3], [21, 40], table, 8, backend="cpu")
    for fmt in FORMATS:
        pool_k, pool_v = torch.randn(12, 8, 1, 16, generator=gen), torch.randn(12, 8, 1, 16, generator=gen)
        q = torch.randn(24, 4, 16, generator=gen)
        out = p.run(q, quantized(pool_k, fmt), quantized(pool_v, fmt))
        kq, vq = quantized(pool_k, fmt), quantized(pool_v, fmt)
        want = p.run(q, dequantize_kv(kq.codes, kq.scales), dequantize_kv(vq.codes, vq.scales))
        # the same values in another order: the decode rows apply a key's scale after its dot product
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
