"""The cpu backend's KV storage: new rows written by one Numba pass over the step's tokens; for a quantized cache
(``tessera.kv.quantized``) the same pass quantizes each (token, head) row as it stores it."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange, types
from numba.core.extending import overload

from tessera.backends.cpu.numba_math import widen
from tessera.backends.cpu.ops._narrow import _f32_to_bits, _f32_to_half_bits, storage_view
from tessera.backends.kv_storage import KVStorage
from tessera.kv.quantized import KV_FORMATS, QuantizedPages

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


_TWO_M120 = np.float32(2.0 ** -120)


def _encode(y, codes):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(_encode, inline="always")
def _encode_overload(y, codes):
    """``y`` (float32, already within the format's range) as a code of ``codes``' dtype: int8 rounded half to even
    (torch's ``round``); e4m3 bits (uint8) rounded to nearest even as torch's float8 cast: ``|y| * 2^-120`` puts
    e4m3's exponent and top 3 mantissa bits at float32's bit 20 (subnormals too), so rounding the float32 bits to
    bit 20 is the e4m3 rounding, a carry into the exponent included."""
    if codes.dtype == types.int8:
        return lambda y, codes: np.int8(np.rint(y))
    if codes.dtype == types.uint8:
        def encode(y, codes):
            b = _f32_to_bits(abs(y) * _TWO_M120)
            code = min((b + np.uint32(0x7FFFF) + ((b >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20),
                       np.uint32(0x7E))
            return np.uint8(code | ((_f32_to_bits(y) >> np.uint32(24)) & np.uint32(0x80)))
        return encode
    return None


@njit(inline="always")
def _quantize_rows(codes, scales, new, t, row, top):  # pragma: no cover - compiled
    """Token ``t`` of ``new [T, Hkv, D]`` into slot ``row``: per head, scale = absmax / top rounded to float16 (its
    bits stored), codes of ``x * (1 / scale)`` clamped to +-top: :func:`tessera.kv.quantized.quantize_kv`'s ops."""
    for h in range(new.shape[1]):
        amax = np.float32(0.0)
        for x in range(new.shape[2]):
            amax = max(amax, abs(widen(new[t, h, x])))
        bits = _f32_to_half_bits(amax / top)
        scales[row, h] = bits
        s = widen(bits)
        inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
        for x in range(new.shape[2]):
            y = min(max(widen(new[t, h, x]) * inv, -top), top)
            codes[row, h, x] = _encode(y, codes)


def store_row(rows, scales, new, t, row, top):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


# Not inlined at Numba's IR level: _quantize_rows inlined twice over that way trips Numba's IR scope check
# (NumbaIRAssumptionWarning); as a call of its own LLVM still inlines it.
@overload(store_row)
def _store_row_overload(rows, scales, new, t, row, top):
    """Token ``t`` of ``new [T, Hkv, D]`` into slot ``row`` of ``rows [rows, Hkv, D]``, as the pool stores it: copied
    when ``rows`` holds the model's dtype (``new`` in the same storage dtype; ``scales`` and ``top`` unused),
    quantized into codes and ``scales`` when it holds int8 / e4m3 codes. Chosen by the pool's type, so a kernel
    written once (the fused decode layer) compiles for either cache."""
    if rows.dtype in (types.int8, types.uint8):
        return lambda rows, scales, new, t, row, top: _quantize_rows(rows, scales, new, t, row, top)

    def copy(rows, scales, new, t, row, top):
        for h in range(new.shape[1]):
            for x in range(new.shape[2]):
                rows[row, h, x] = new[t, h, x]
    return copy


@njit(parallel=True, cache=True)
def _write_quantized_kernel(k_codes, k_scales, v_codes, v_scales, k_new, v_new, slots, top):  # pragma: no cover
    """Quantize and store every new token's K and V rows (``top``: the format's largest code)."""
    for t in prange(slots.shape[0]):
        _quantize_rows(k_codes, k_scales, k_new, t, slots[t], top)
        _quantize_rows(v_codes, v_scales, v_new, t, slots[t], top)


@njit(cache=True)
def _write_quantized_serial(k_codes, k_scales, v_codes, v_scales, k_new, v_new, slots, top):  # pragma: no cover
    """:func:`_write_quantized_kernel` on the calling thread (decode steps)."""
    for t in range(slots.shape[0]):
        _quantize_rows(k_codes, k_scales, k_new, t, slots[t], top)
        _quantize_rows(v_codes, v_scales, v_new, t, slots[t], top)


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

    def write_slots_quantized(self, k_rows: QuantizedPages, v_rows: QuantizedPages, k_new: torch.Tensor,
                              v_new: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantize-on-write in one Numba pass: each new (token, head) row's absmax, scale and codes, stored into
        its slot (:func:`tessera.kv.quantized.quantize_kv`'s results, bit for bit)."""
        small = 2 * k_new.numel() * k_new.element_size() < SERIAL_WRITE_BYTES
        (_write_quantized_serial if small else _write_quantized_kernel)(
            k_rows.code_bits().numpy(), storage_view(k_rows.scales),
            v_rows.code_bits().numpy(), storage_view(v_rows.scales),
            storage_view(k_new.contiguous()), storage_view(v_new.contiguous()), slots.numpy(),
            np.float32(KV_FORMATS[k_rows.fmt][1]),
        )
