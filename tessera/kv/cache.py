"""PagedKVCache: per-layer K and V page pools, and the fused kernel that writes new tokens into their slots."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from tessera.dtypes import FLOAT_DTYPES


@njit(parallel=True, cache=True)
def _write_slots_kernel(k_rows, v_rows, k_new, v_new, slots):  # pragma: no cover - compiled
    """``k_rows[slots[t]] = k_new[t]`` and the same for V, for every token, in one pass over the new tokens."""
    for t in prange(slots.shape[0]):
        row = slots[t]
        k_rows[row] = k_new[t]
        v_rows[row] = v_new[t]


@njit(cache=True)
def _write_slots_serial(k_rows, v_rows, k_new, v_new, slots):  # pragma: no cover - compiled
    """:func:`_write_slots_kernel` on the calling thread (decode steps: waking the pool costs more than the copy)."""
    for t in range(slots.shape[0]):
        row = slots[t]
        k_rows[row] = k_new[t]
        v_rows[row] = v_new[t]


def write_slots_torch(k_rows: torch.Tensor, v_rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      slots: torch.Tensor) -> None:
    """:func:`_write_slots_kernel` as one ``index_copy_`` per pool, on whatever device the pools live on.

    ``k_rows``/``v_rows`` are ``[slots, Hkv, D]`` views of a layer's pools, ``k_new``/``v_new`` ``[T, Hkv, D]`` and
    ``slots`` int64 ``[T]`` (distinct), all on that device.
    """
    k_rows.index_copy_(0, slots, k_new)
    v_rows.index_copy_(0, slots, v_new)


#: fewer new K+V bytes than this are copied on the calling thread
SERIAL_WRITE_BYTES = 1 << 18


def _bits(t: torch.Tensor) -> np.ndarray:
    """A NumPy view Numba can copy: 16-bit floats travel as int16 bits (a copy needs no arithmetic)."""
    return t.view(torch.int16).numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()


class PagedKVCache:
    """K and V page pools for every layer, in the layout ``plan(...).run`` reads.

    Parameters
    ----------
    num_layers, num_pages, page_size, num_kv_heads, head_dim : int
        Each layer holds ``k_pages[layer]`` and ``v_pages[layer]`` of shape ``[num_pages, page_size, Hkv, D]``.
    dtype : torch.float32, torch.bfloat16 or torch.float16
    device : where the pools live (default CPU). CPU pools are written by a Numba kernel; others by
        ``index_copy_`` on their device.

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
                 dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        for name, value in (("num_layers", num_layers), ("num_pages", num_pages), ("page_size", page_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedKVCache: {name} must be an int >= 1, got {value!r}")
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"PagedKVCache: dtype must be float32, bfloat16 or float16, got {dtype}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"PagedKVCache: device must be a torch device such as 'cpu' or 'cuda:0', got "
                             f"{device!r} ({err})") from None
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_pages = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_pages = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

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
        if isinstance(slots, torch.Tensor):
            slot_array = slots.detach().to("cpu", torch.int64).numpy()
        else:
            slot_array = np.asarray(slots, dtype=np.int64)
        if slot_array.ndim != 1 or slot_array.shape[0] != k.shape[0] or k.shape != v.shape:
            raise ValueError(f"PagedKVCache.write: need one slot per token: {k.shape[0]} tokens (k), {v.shape[0]} (v), "
                             f"{slot_array.size} slots")
        if slot_array.size and (slot_array.min() < 0 or slot_array.max() >= self.num_slots):
            raise ValueError(f"PagedKVCache.write: slots must lie in [0, {self.num_slots}), got "
                             f"[{slot_array.min()}, {slot_array.max()}]")
        if slot_array.size > 1 and np.unique(slot_array).size != slot_array.size:
            raise ValueError("PagedKVCache.write: two tokens map to the same slot; each token needs its own slot")
        rows = (-1, self.num_kv_heads, self.head_dim)
        if self.device.type != "cpu":  # Numba reaches host memory only; the device copies rows itself
            write_slots_torch(self.k_pages[layer].view(rows), self.v_pages[layer].view(rows), k, v,
                              torch.as_tensor(slot_array, device=self.device))
            return
        small = 2 * k.numel() * k.element_size() < SERIAL_WRITE_BYTES
        (_write_slots_serial if small else _write_slots_kernel)(
            _bits(self.k_pages[layer].view(rows)), _bits(self.v_pages[layer].view(rows)),
            _bits(k.contiguous()), _bits(v.contiguous()), slot_array,
        )
