"""Quantized KV pages: int8 and fp8 (e4m3) codes with one scale per token and KV head.

A quantized layer pool is a :class:`QuantizedPages`: ``codes [num_pages, page_size, Hkv, D]`` (int8, or
``torch.float8_e4m3fn``) and ``scales [num_pages, page_size, Hkv]`` float16. Token ``t``'s head ``h`` holds
``codes[..., t, h, :] * scales[..., t, h]``.

Why these choices:

- **Per token and head, not per page.** A token's scale is fixed when it is written (quantize-on-write), so a page
  never has to be re-scaled when a later token with larger values arrives, and a token's error depends on its own
  range only (keys of different heads differ in range by orders of magnitude).
- **float16 scales.** A scale costs 2 bytes per token and head: ``D + 2`` bytes against bf16's ``2 D``, 1.94x the
  tokens per byte at D=64 and 1.97x at D=128 (a float32 scale: 1.88x / 1.94x). The codes are computed against the
  *rounded* scale, so ``codes * scale`` is exactly what the quantizer meant: dequantization is exact arithmetic on
  what is stored.
- **Symmetric int8** (``scale = absmax / 127``, codes in [-127, 127]) and **fp8 e4m3** (``scale = absmax / 448``,
  round to nearest even, as torch's cast): int8 has the finer grid near the maximum, fp8 the finer grid near 0
  (outlier-heavy keys); both are reported, neither is assumed better.

The functions here are the reference: torch ops on any device. Backends that read or write the codes themselves
(the cpu backend's decode kernel and slot writer) are tested against them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.kv.formats import KV_CACHE_DTYPES

#: name -> (codes dtype, largest code magnitude)
KV_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
}
assert tuple(KV_FORMATS) == KV_CACHE_DTYPES, "tessera.kv.formats lists the same names"
#: the scales' dtype (see the module docstring)
SCALE_DTYPE = torch.float16


def check_format(kv_cache_dtype: str | None, where: str) -> str | None:
    """``kv_cache_dtype`` validated: None (pages in the model's dtype) or a name of :data:`KV_FORMATS`."""
    if kv_cache_dtype is None or kv_cache_dtype in KV_FORMATS:
        return kv_cache_dtype
    raise ValueError(f"{where}: kv_cache_dtype must be None (the model's dtype) or one of {sorted(KV_FORMATS)}, got "
                     f"{kv_cache_dtype!r}")


def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str | None) -> int:
    """Bytes one token takes in one layer's K and V pools together, scales included."""
    if kv_cache_dtype is None:
        return 2 * num_kv_heads * head_dim * dtype.itemsize
    return 2 * num_kv_heads * (head_dim * KV_FORMATS[kv_cache_dtype][0].itemsize + SCALE_DTYPE.itemsize)


def quantize_kv(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize token rows.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., D]`` float32 / bfloat16 / float16; one scale per row of D values.
    fmt : str
        A name of :data:`KV_FORMATS`.

    Returns
    -------
    codes : ``[..., D]`` in the format's codes dtype; scales : ``[...]`` float16. A row of zeros gets scale 0 and
    codes 0; a non-finite value makes its row's scale non-finite (it is not hidden).
    """
    codes_dtype, top = KV_FORMATS[fmt]
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / top).to(SCALE_DTYPE)
    s = scale.float().unsqueeze(-1)
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    # the rounded scale can sit a hair below absmax / top: clamp so the largest value maps to the top code
    y = (xf * inv).clamp(-top, top)
    codes = y.round().to(codes_dtype) if codes_dtype == torch.int8 else y.to(codes_dtype)
    return codes, scale


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scales[..., None]`` in ``dtype`` (computed in float32)."""
    return (codes.float() * scales.float().unsqueeze(-1)).to(dtype)


@dataclass(frozen=True)
class QuantizedPages:
    """One layer's quantized K (or V) pool; ``reshape`` gives the token-row view the kernels address.

    Attributes
    ----------
    codes : torch.Tensor
        ``[num_pages, page_size, Hkv, D]`` (or ``[rows, Hkv, D]``), int8 or float8_e4m3fn.
    scales : torch.Tensor
        ``[num_pages, page_size, Hkv]`` (or ``[rows, Hkv]``) float16.
    fmt : str
        The :data:`KV_FORMATS` name.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: str

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dim(self) -> int:
        return self.codes.dim()

    def reshape(self, *shape) -> QuantizedPages:
        """The same storage viewed as ``shape`` (its last dim is D; the scales drop it)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        codes = self.codes.reshape(shape)
        return QuantizedPages(codes, self.scales.reshape(codes.shape[:-1]), self.fmt)

    def code_bits(self) -> torch.Tensor:
        """The codes as kernels load them: int8 as is, e4m3 as its uint8 bit patterns (a NumPy array cannot hold
        float8, and Triton's interpreter cannot load it everywhere; the kernels widen the bits themselves)."""
        return self.codes if self.codes.dtype == torch.int8 else self.codes.view(torch.uint8)

    def contiguous(self) -> QuantizedPages:
        if self.codes.is_contiguous() and self.scales.is_contiguous():
            return self
        return QuantizedPages(self.codes.contiguous(), self.scales.contiguous(), self.fmt)

    def dequantize(self, dtype: torch.dtype, pages: torch.Tensor | None = None) -> torch.Tensor:
        """The pool in ``dtype``. With ``pages`` (int64 ids along dim 0), only those pages are computed and
        written into an uninitialised pool of the full shape, so memory is touched only where a plan reads."""
        if pages is None:
            return dequantize_kv(self.codes, self.scales, dtype)
        out = torch.empty(self.codes.shape, dtype=dtype, device=self.codes.device)
        if pages.numel():
            out[pages] = dequantize_kv(self.codes[pages], self.scales[pages], dtype)
        return out
