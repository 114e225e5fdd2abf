"""PagedKVCache: per-layer K and V page pools, kept by the backend's
:class:`~tessera.backends.kv_storage.KVStorage`."""

from __future__ import annotations

import numpy as np
import torch

from tessera.backends.registry import parse_device
from tessera.dtypes import FLOAT_DTYPES
from tessera.backends.kv_storage import KVStorage, storage_for
from tessera.kv.quantized import KV_FORMATS, SCALE_DTYPE, QuantizedPages, bytes_per_token, check_format


class PagedKVCache:
    """K and V page pools for every layer, in the layout ``plan(...).run`` reads.

    Parameters
    ----------
    num_layers, num_pages, page_size, num_kv_heads, head_dim : int
        Each layer holds ``k_pages[layer]`` and ``v_pages[layer]`` of shape ``[num_pages, page_size, Hkv, D]``.
    dtype : torch.float32, torch.bfloat16 or torch.float16
        The dtype :meth:`write` takes and attention computes in.
    device : where the pools live (default CPU).
    backend : whose :class:`~tessera.backends.kv_storage.KVStorage` allocates and writes them (``"auto"``: the
        highest-priority usable backend for ``device``'s tensors; the cpu backend writes host pools with a Numba
        kernel, a backend without storage of its own gets torch's ``index_copy_``).
    kv_cache_dtype : None, "int8" or "fp8_e4m3"
        None stores K/V in ``dtype``. A quantized format stores each layer's pools as
        :class:`~tessera.kv.quantized.QuantizedPages` (codes plus a float16 scale per token and head), quantized as
        they are written; ``plan(...).run`` reads them as they are.

    Token ``j`` of a sequence whose page table row is ``pages`` lives in slot ``pages[j // page_size] * page_size +
    j % page_size``; :meth:`write` takes those slots (the BlockManager's ``slot_mapping``).

    Examples
    --------
    >>> cache = PagedKVCache(num_layers=2, num_pages=64, page_size=16, num_kv_heads=2, head_dim=64,
    ...                      dtype=torch.float32)
    >>> cache.write(0, k_new, v_new, slots)        # k_new, v_new [tokens, Hkv, D]; slots int [tokens]
    >>> out = plan(spec, q_lens, kv_lens, page_table, 16).run(q, cache.k_pages[0], cache.v_pages[0])
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", backend: str = "auto",
                 kv_cache_dtype: str | None = None) -> None:
        for name, value in (("num_layers", num_layers), ("num_pages", num_pages), ("page_size", page_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedKVCache: {name} must be an int >= 1, got {value!r}")
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"PagedKVCache: dtype must be float32, bfloat16 or float16, got {dtype}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.kv_cache_dtype = check_format(kv_cache_dtype, "PagedKVCache")
        self.device = parse_device(device, "PagedKVCache")
        self.storage: KVStorage = storage_for(backend, self.device)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_pages = [self._pool(shape) for _ in range(num_layers)]
        self.v_pages = [self._pool(shape) for _ in range(num_layers)]
        # the last slots checked: a step passes the same tensor to every layer's write, so it is validated (and
        # moved to the pools' device) once per step, not once per layer
        self._checked: tuple[object, int, torch.Tensor] | None = None

    def _pool(self, shape: tuple[int, ...]) -> torch.Tensor | QuantizedPages:
        if self.kv_cache_dtype is None:
            return self.storage.allocate(shape, self.dtype, self.device)
        codes = self.storage.allocate(shape, KV_FORMATS[self.kv_cache_dtype][0], self.device)
        return QuantizedPages(codes, self.storage.allocate(shape[:-1], SCALE_DTYPE, self.device), self.kv_cache_dtype)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes across every layer's K and V (codes and scales for a quantized cache)."""
        return self.num_layers * bytes_per_token(self.num_kv_heads, self.head_dim, self.dtype, self.kv_cache_dtype)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | list[int]) -> None:
        """Store new tokens' K and V of one layer into their slots.

        Parameters
        ----------
        layer : int
        k, v : ``[tokens, Hkv, D]`` in the cache dtype, on the cache's device
        slots : int tensor (any device) or list ``[tokens]``, each in ``[0, num_pages * page_size)`` and distinct
        """
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"PagedKVCache.write: layer {layer} out of range [0, {self.num_layers})")
        want = (self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != want or t.dtype != self.dtype:
                raise ValueError(f"PagedKVCache.write: {name} must be [tokens, {want[0]}, {want[1]}] {self.dtype}, got "
                                 f"{list(getattr(t, 'shape', []))} {getattr(t, 'dtype', type(t).__name__)}")
            if t.device != self.device:
                raise ValueError(f"PagedKVCache.write: {name} is on {t.device}, the cache on {self.device}; move it "
                                 f"with .to({str(self.device)!r})")
        slot_rows = self._slots(slots)
        if slot_rows.shape[0] != k.shape[0] or k.shape != v.shape:
            raise ValueError(f"PagedKVCache.write: need one slot per token: {k.shape[0]} tokens (k), {v.shape[0]} (v), "
                             f"{slot_rows.shape[0]} slots")
        if slot_rows.shape[0] == 0:
            return
        rows = (-1, self.num_kv_heads, self.head_dim)
        if self.kv_cache_dtype is None:
            self.storage.write_slots(self.k_pages[layer].view(rows), self.v_pages[layer].view(rows), k, v, slot_rows)
        else:
            self.storage.write_slots_quantized(self.k_pages[layer].reshape(rows), self.v_pages[layer].reshape(rows),
                                               k, v, slot_rows)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: page ``src`` -> ``dst`` in every layer's K and V, in the order given."""
        for src, dst in copies:
            for page in (src, dst):
                if not 0 <= page < self.num_pages:
                    raise IndexError(f"PagedKVCache.copy_pages: page {page} out of range [0, {self.num_pages})")
        if not copies:
            return
        if self.kv_cache_dtype is None:
            self.storage.copy_pages([*self.k_pages, *self.v_pages], copies)
        else:
            pools = [*self.k_pages, *self.v_pages]
            self.storage.copy_pages([p.codes for p in pools] + [p.scales for p in pools], copies)

    def _slots(self, slots: torch.Tensor | list[int]) -> torch.Tensor:
        """``slots`` checked (1-D, distinct, in range) as int64 on the pools' device. A tensor already checked and
        not modified since (its version counter) is not checked again."""
        if isinstance(slots, torch.Tensor) and self._checked is not None and self._checked[0] is slots \
                and self._checked[1] == slots._version:
            return self._checked[2]
        if isinstance(slots, torch.Tensor):
            host = slots.detach().to("cpu", torch.int64).numpy()
        else:
            host = np.asarray(slots, dtype=np.int64)
        if host.ndim != 1:
            raise ValueError(f"PagedKVCache.write: slots must be 1-D [tokens], got shape {list(host.shape)}")
        if host.size and (host.min() < 0 or host.max() >= self.num_slots):
            raise ValueError(f"PagedKVCache.write: slots must lie in [0, {self.num_slots}), got "
                             f"[{host.min()}, {host.max()}]")
        if host.size > 1 and np.unique(host).size != host.size:
            raise ValueError("PagedKVCache.write: two tokens map to the same slot; each token needs its own slot")
        if isinstance(slots, torch.Tensor) and slots.device == self.device and slots.dtype == torch.int64 \
                and slots.is_contiguous():
            rows = slots.detach()
        else:
            rows = torch.from_numpy(np.ascontiguousarray(host)).to(self.device)
        if isinstance(slots, torch.Tensor):
            self._checked = (slots, slots._version, rows)
        return rows
