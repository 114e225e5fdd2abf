"""The cpu backend's KV storage: new rows written by one Numba pass over the step's tokens."""

from __future__ import annotations

import torch
from numba import njit, prange

from tessera.backends.cpu.ops._narrow import storage_view
from tessera.backends.kv_storage import KVStorage

#: fewer new K+V bytes than this are copied on the calling thread
SERIAL_WRITE_BYTES = 1 << 18


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


class CpuKVStorage(KVStorage):
    """Host pools; :meth:`write_slots` copies whole token rows ``[Hkv, D]`` in Numba, without torch's per-call
    dispatch (a decode step writes every layer's one row per sequence)."""

    def write_slots(self, k_rows: torch.Tensor, v_rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    slots: torch.Tensor) -> None:
        small = 2 * k_new.numel() * k_new.element_size() < SERIAL_WRITE_BYTES
        (_write_slots_serial if small else _write_slots_kernel)(
            storage_view(k_rows), storage_view(v_rows), storage_view(k_new.contiguous()),
            storage_view(v_new.contiguous()), slots.numpy(),
        )
