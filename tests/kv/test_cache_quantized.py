"""A quantized PagedKVCache (int8, fp8 e4m3): quantize-on-write, page copies, sizes, and the engine over it."""

from __future__ import annotations

import pytest
import torch

from tessera.engine import LLM
from tessera.kv.cache import PagedKVCache
from tessera.kv.quantized import KV_FORMATS, QuantizedPages, bytes_per_token, dequantize_kv, quantize_kv

FORMATS = sorted(KV_FORMATS)
BACKENDS = ["auto", "reference"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_write_stores_what_quantize_kv_gives(fmt: str, backend: str) -> None:
    gen = torch.Generator().manual_seed(7)
    cache = PagedKVCache(2, 6, 4, 3, 24, torch.float32, backend=backend, kv_cache_dtype=fmt)
    assert isinstance(cache.k_pages[1], QuantizedPages) and cache.k_pages[1].fmt == fmt
    k = torch.randn(5, 3, 24, generator=gen) * 3
    v = torch.randn(5, 3, 24, generator=gen)
    slots = torch.tensor([17, 2, 9, 23, 0])  # shuffled, across pages, the last slot of the pool
    cache.write(1, k, v, slots)
    for pages, new in ((cache.k_pages[1], k), (cache.v_pages[1], v)):
        rows = pages.reshape(-1, 3, 24)
        codes, scales = quantize_kv(new, fmt)
        assert torch.equal(rows.codes[slots].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(rows.scales[slots], scales)
        untouched = torch.ones(24, dtype=torch.bool)
        untouched[slots] = False
        assert not rows.scales[untouched].any()  # nothing else was written
    assert not cache.k_pages[0].scales.any()  # nor another layer
    # copy-on-write copies codes and scales of every layer
    cache.copy_pages([(0, 5)])
    assert torch.equal(cache.k_pages[1].scales[5], cache.k_pages[1].scales[0])
    assert torch.equal(cache.v_pages[1].codes[5].view(torch.uint8), cache.v_pages[1].codes[0].view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_sizes(fmt: str) -> None:
    cache = PagedKVCache(3, 2, 16, 4, 64, torch.bfloat16, kv_cache_dtype=fmt)
    assert cache.bytes_per_token == 3 * 2 * 4 * (64 + 2)
    pools = [*cache.k_pages, *cache.v_pages]
    stored = sum(p.codes.numel() * p.codes.element_size() + p.scales.numel() * p.scales.element_size() for p in pools)
    assert stored == cache.bytes_per_token * cache.num_slots
    # the same memory holds ~2x the tokens of bf16 pages: 1.94x at D=64, 1.97x at D=128
    for d, at_least in ((64, 1.93), (128, 1.96)):
        ratio = bytes_per_token(8, d, torch.bfloat16, None) / bytes_per_token(8, d, torch.bfloat16, fmt)
        assert ratio >= at_least


def test_bad_format_is_refused() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be None .* \['fp8_e4m3', 'int8'\], got 'int4'"):
        PagedKVCache(1, 2, 4, 1, 8, torch.float32, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="LLM: kv_cache_dtype"):
        LLM(torch.nn.Module(), kv_cache_dtype="q8_0")  # checked before the model is looked at


def test_dequantize_only_the_pages_asked_for() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 4, 2, 8, generator=gen)
    pages = QuantizedPages(*quantize_kv(x, "int8"), "int8")
    out = pages.dequantize(torch.float32, torch.tensor([3, 1]))
    full = dequantize_kv(pages.codes, pages.scales)
    assert torch.equal(out[[1, 3]], full[[1, 3]])


@pytest.mark.parametrize("serial", [True, False], ids=["serial", "parallel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_quantize_on_write_is_bit_exact(fmt: str, dtype: torch.dtype, serial: bool, monkeypatch) -> None:
    """The cpu backend's fused Numba writer gives quantize_kv's codes and scales bit for bit, over values spanning
    six decades (e4m3 subnormal codes, rounding carries into the exponent), a zero row and negative zeros."""
    import warnings

    from tessera.backends.cpu import kv_storage

    monkeypatch.setattr(kv_storage, "SERIAL_WRITE_BYTES", 1 << 40 if serial else 0)
    gen = torch.Generator().manual_seed(11)
    t, h, d = 64, 3, 40
    x = torch.randn(t, h, d, generator=gen) * torch.logspace(-4, 2, t).view(t, 1, 1)
    x = (x * torch.rand(t, h, d, generator=gen) ** 6).to(dtype)
    x[5, 1] = 0.0
    x[6, 0, :3] = -0.0
    rows = QuantizedPages(torch.zeros(t + 7, h, d, dtype=KV_FORMATS[fmt][0]), torch.zeros(t + 7, h, dtype=torch.float16),
                          fmt)
    slots = torch.randperm(t + 7, generator=gen)[:t]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Numba IR warning here once came with wrong signs
        kv_storage.CpuKVStorage().write_slots_quantized(rows, rows, x, x, slots)
    codes, scales = quantize_kv(x, fmt)
    assert torch.equal(rows.codes[slots].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(rows.scales[slots], scales)
