"""How a backend stores KV pages: allocate the pools, write new tokens' rows, copy pages.

:class:`KVStorage` does all three with plain torch calls, so it runs on any device torch has. A backend with a
faster way (the cpu backend writes rows with a Numba kernel) returns its own subclass from an optional
``Backend.kv_storage()``; :func:`storage_for` picks it for a cache.
"""

from __future__ import annotations

import torch

from tessera.backends import registry
from tessera.kv.quantized import QuantizedPages, quantize_kv


class KVStorage:
    """The device-generic storage: ``torch.zeros`` pools, ``index_copy_`` writes, ``copy_`` page copies."""

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One pool ``[num_pages, page_size, Hkv, D]``, zeroed (a page never read before it is written, but zeros
        keep a stray read finite)."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def write_slots(self, k_rows: torch.Tensor, v_rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    slots: torch.Tensor) -> None:
        """``k_rows[slots[t]] = k_new[t]`` and the same for V.

        k_rows, v_rows : ``[num_slots, Hkv, D]`` views of one layer's pools; k_new, v_new : ``[T, Hkv, D]``;
        slots : int64 ``[T]``, distinct and in range (the cache validated them), on the pools' device.
        """
        k_rows.index_copy_(0, slots, k_new)
        v_rows.index_copy_(0, slots, v_new)

    def write_slots_quantized(self, k_rows: QuantizedPages, v_rows: QuantizedPages, k_new: torch.Tensor,
                              v_new: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantize the new rows (:func:`~tessera.kv.quantized.quantize_kv`) and store codes and scales.

        k_rows, v_rows : token-row views ``[num_slots, Hkv, D]`` of one layer's quantized pools; the rest as in
        :meth:`write_slots`.
        """
        for rows, new in ((k_rows, k_new), (v_rows, v_new)):
            codes, scales = quantize_kv(new, rows.fmt)
            # index_copy_ has no float8 kernel on every device: copy the codes' bytes
            rows.codes.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))
            rows.scales.index_copy_(0, slots, scales)

    def copy_pages(self, pools: list[torch.Tensor], copies: list[tuple[int, int]]) -> None:
        """Copy page ``src`` to ``dst`` in every pool, in the order given (copy-on-write of a shared page)."""
        for src, dst in copies:
            for pages in pools:
                pages[dst].copy_(pages[src])


GENERIC = KVStorage()


def storage_for(backend: str, device: torch.device) -> KVStorage:
    """The storage of ``backend`` (or, under ``"auto"``, of the highest-priority usable backend for ``device``'s
    tensors) when it has its own, else :data:`GENERIC`."""
    if backend == "auto":
        first = registry.by_priority(device.type)
        chosen = first[0] if first else None
    else:
        chosen = registry.get(backend)
        if device.type not in registry.device_types(chosen):
            chosen = None  # a backend that does not run this device's tensors cannot write them either
    own = getattr(chosen, "kv_storage", None)
    return own() if own is not None else GENERIC
