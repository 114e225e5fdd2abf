"""PagedKVCache: layout, the fused slot write, and its errors."""

from __future__ import annotations

import pytest
import torch

from tessera.kv import PagedKVCache
from tessera.kv.cache import write_slots_torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_stores_every_token_in_its_slot_and_nothing_else(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(num_layers=2, num_pages=5, page_size=4, num_kv_heads=3, head_dim=8, dtype=dtype)
    for layer in range(2):  # poison: any slot the write does not own must keep this value
        cache.k_pages[layer].fill_(7.0)
        cache.v_pages[layer].fill_(-7.0)
    k = torch.randn(6, 3, 8, generator=gen).to(dtype)
    v = torch.randn(6, 3, 8, generator=gen).to(dtype)
    slots = torch.tensor([19, 0, 5, 6, 7, 12])  # crosses pages, unordered, partial pages
    cache.write(1, k, v, slots)
    k_rows, v_rows = cache.k_pages[1].view(-1, 3, 8), cache.v_pages[1].view(-1, 3, 8)
    assert torch.equal(k_rows[slots], k) and torch.equal(v_rows[slots], v)
    others = torch.ones(20, dtype=torch.bool)
    others[slots] = False
    assert (k_rows[others] == 7).all() and (v_rows[others] == -7).all()
    assert (cache.k_pages[0] == 7).all() and (cache.v_pages[0] == -7).all()
    assert cache.k_pages[1].shape == (5, 4, 3, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_device_writer_matches_the_numba_writer(dtype: torch.dtype) -> None:
    """Pools off the host are written by ``index_copy_``; on the CPU it must store what the Numba kernel stores."""
    gen = torch.Generator().manual_seed(4)
    cache = PagedKVCache(num_layers=1, num_pages=7, page_size=3, num_kv_heads=2, head_dim=5, dtype=dtype)
    cache.k_pages[0].copy_(torch.randn(cache.k_pages[0].shape, generator=gen))
    cache.v_pages[0].copy_(torch.randn(cache.v_pages[0].shape, generator=gen))
    k_rows, v_rows = cache.k_pages[0].clone().view(-1, 2, 5), cache.v_pages[0].clone().view(-1, 2, 5)
    k = torch.randn(9, 2, 5, generator=gen).to(dtype)
    v = torch.randn(9, 2, 5, generator=gen).to(dtype)
    slots = torch.randperm(21, generator=gen)[:9]
    cache.write(0, k, v, slots)
    write_slots_torch(k_rows, v_rows, k, v, slots)
    assert torch.equal(k_rows, cache.k_pages[0].view(-1, 2, 5)) and torch.equal(v_rows, cache.v_pages[0].view(-1, 2, 5))


def test_cache_lives_on_its_device() -> None:
    """The meta device stands in for an accelerator: pools are allocated there and writes take the device path."""
    cache = PagedKVCache(2, 3, 4, 2, 8, torch.bfloat16, device="meta")
    assert cache.device == torch.device("meta")
    assert all(p.device.type == "meta" for p in (*cache.k_pages, *cache.v_pages))
    k = torch.empty(2, 2, 8, dtype=torch.bfloat16, device="meta")
    cache.write(1, k, k, [5, 0])
    with pytest.raises(ValueError, match=r"k is on cpu, the cache on meta; move it with .to\('meta'\)"):
        cache.write(1, torch.zeros(2, 2, 8, dtype=torch.bfloat16), k, [5, 0])
    with pytest.raises(ValueError, match="device must be a torch device"):
        PagedKVCache(1, 2, 4, 2, 8, torch.float32, device="gpu7")


def test_empty_write_is_a_no_op() -> None:
    cache = PagedKVCache(1, 2, 4, 1, 8, torch.float32)
    cache.write(0, torch.empty(0, 1, 8), torch.empty(0, 1, 8), [])
    assert (cache.k_pages[0] == 0).all()


def test_bad_writes_and_configs_raise_clear_errors() -> None:
    cache = PagedKVCache(1, 2, 4, 2, 8, torch.float32)
    k = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 8\)"):
        cache.write(0, k, k, [1, 8])
    with pytest.raises(ValueError, match="same slot"):
        cache.write(0, k, k, [3, 3])
    with pytest.raises(ValueError, match="one slot per token"):
        cache.write(0, k, k, [3])
    with pytest.raises(ValueError, match=r"\[tokens, 2, 8\] torch.float32"):
        cache.write(0, k.bfloat16(), k.bfloat16(), [1, 2])
    with pytest.raises(IndexError, match="layer 1 out of range"):
        cache.write(1, k, k, [1, 2])
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        PagedKVCache(1, 2, 0, 2, 8, torch.float32)
    with pytest.raises(TypeError, match="dtype must be"):
        PagedKVCache(1, 2, 4, 2, 8, torch.float64)


def test_block_manager_package_imports_without_torch() -> None:
    import subprocess
    import sys

    code = "import sys, tessera.kv; tessera.kv.BlockManager(4, 2); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
