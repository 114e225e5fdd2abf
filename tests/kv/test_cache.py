"""PagedKVCache: layout, the fused slot write, and its errors."""

from __future__ import annotations

import pytest
import torch

from tessera.kv import PagedKVCache
from tessera.backends.cpu.kv_storage import CpuKVStorage
from tessera.backends.kv_storage import GENERIC, KVStorage, storage_for


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
    """Pools off the host are written by the generic storage (``index_copy_``); on the CPU it must store what the
    cpu backend's Numba kernel stores."""
    gen = torch.Generator().manual_seed(4)
    cache = PagedKVCache(num_layers=1, num_pages=7, page_size=3, num_kv_heads=2, head_dim=5, dtype=dtype)
    cache.k_pages[0].copy_(torch.randn(cache.k_pages[0].shape, generator=gen))
    cache.v_pages[0].copy_(torch.randn(cache.v_pages[0].shape, generator=gen))
    k_rows, v_rows = cache.k_pages[0].clone().view(-1, 2, 5), cache.v_pages[0].clone().view(-1, 2, 5)
    k = torch.randn(9, 2, 5, generator=gen).to(dtype)
    v = torch.randn(9, 2, 5, generator=gen).to(dtype)
    slots = torch.randperm(21, generator=gen)[:9]
    cache.write(0, k, v, slots)
    assert isinstance(cache.storage, CpuKVStorage)
    GENERIC.write_slots(k_rows, v_rows, k, v, slots)
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


def test_storage_follows_the_backend_and_device() -> None:
    """The cpu backend stores host pools its own way; a device no backend claims, or a backend without storage of
    its own, gets the generic torch storage."""
    cpu = torch.device("cpu")
    assert isinstance(storage_for("auto", cpu), CpuKVStorage) and isinstance(storage_for("cpu", cpu), CpuKVStorage)
    assert storage_for("reference", cpu) is GENERIC
    assert storage_for("auto", torch.device("meta")) is GENERIC
    assert storage_for("cpu", torch.device("meta")) is GENERIC  # the cpu backend does not run meta tensors


def test_copy_pages_copies_every_layer_and_checks_pages() -> None:
    gen = torch.Generator().manual_seed(5)
    cache = PagedKVCache(2, 4, 2, 1, 4, torch.float32)
    for pages in (*cache.k_pages, *cache.v_pages):
        pages.copy_(torch.randn(pages.shape, generator=gen))
    before = [p.clone() for p in (*cache.k_pages, *cache.v_pages)]
    cache.copy_pages([(1, 3), (3, 0)])  # in order: page 0 ends with page 1's rows
    for old, new in zip(before, (*cache.k_pages, *cache.v_pages)):
        assert torch.equal(new[3], old[1]) and torch.equal(new[0], old[1]) and torch.equal(new[2], old[2])
    with pytest.raises(IndexError, match=r"page 4 out of range \[0, 4\)"):
        cache.copy_pages([(0, 4)])


def test_slots_are_checked_once_per_tensor_and_again_after_a_change() -> None:
    """A step passes one slots tensor to every layer: it is validated once, but an in-place change (its version
    counter moves) is validated again, so a stale check never lets a bad slot through."""
    cache = PagedKVCache(2, 2, 4, 1, 4, torch.float32)
    k = torch.randn(2, 1, 4)
    slots = torch.tensor([1, 6])
    cache.write(0, k, k, slots)
    cache.write(1, k, k, slots)
    assert torch.equal(cache.k_pages[1].view(-1, 1, 4)[slots], k)
    slots[1] = 9
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 8\)"):
        cache.write(0, k, k, slots)


def test_a_backend_storage_is_used_for_its_pools(monkeypatch) -> None:
    """A backend's own ``kv_storage()`` allocates and writes the pools of a cache made for it."""
    from tessera.backends import registry

    calls = []

    class Counting(KVStorage):
        def allocate(self, shape, dtype, device):
            calls.append("allocate")
            return super().allocate(shape, dtype, device)

        def write_slots(self, k_rows, v_rows, k_new, v_new, slots):
            calls.append("write")
            super().write_slots(k_rows, v_rows, k_new, v_new, slots)

    backend = registry.get("reference")
    monkeypatch.setattr(type(backend), "kv_storage", lambda self: Counting(), raising=False)
    cache = PagedKVCache(1, 2, 4, 1, 4, torch.float32, backend="reference")
    cache.write(0, torch.randn(1, 1, 4), torch.randn(1, 1, 4), [3])
    assert calls == ["allocate", "allocate", "write"]


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
