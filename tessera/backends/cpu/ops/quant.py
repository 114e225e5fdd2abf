"""cpu backend of the quant family: Numba GEMV kernels for decode shapes, dequantize-and-BLAS for the rest.

Float ``matmul`` up to :data:`SMALL_M` rows of x runs :mod:`._gemv` (fp32, or bf16/fp16 weights widened in
registers; fp32 accumulation), on one thread below :data:`SERIAL_WORK` multiply-adds and over all threads above;
larger M goes to torch/BLAS.

Up to :data:`QUANT_GEMV_MAX_M` rows of x (per format) the packed weights are streamed once by
:mod:`._quant_kernels` (memory-bound at one row; with more rows each weight row is decoded once into L1 and dotted
with every x row). Above it BLAS wins: the weight is dequantized in blocks of :data:`TILE_N` rows (a few MiB, so it
stays in cache and the full float matrix is never held) and each block goes through one fp32 GEMM.
"""

from __future__ import annotations

import numpy as np
import torch

from tessera.backends.cpu import variants
from tessera.backends.cpu.ops import _dequant_bf16 as dequant_bf16
from tessera.backends.cpu.ops import _gemv as float_gemv
from tessera.backends.cpu.ops import _ggml_kernels as ggml
from tessera.backends.cpu.ops import _qdot as qdot
from tessera.backends.cpu.ops import _quant_kernels as kernels
from tessera.backends.cpu.ops._int8_simd import VNNI512
from tessera.backends.cpu.ops._narrow import group_view
from tessera.backends.reference.ops.quant import dequantize_in, quantize_in
from tessera.kernels.quant import QuantizedWeight
from tessera.tuning import tuned

SMALL_M = 8
#: qmatmul keeps the packed GEMV (each weight row decoded once into L1, then dotted with every x row) up to this many
#: rows of x; above, de-quantized tiles through BLAS win. Measured crossovers (2 cores, SmolLM2 shapes 3072 x 576,
#: 576 x 1536, 960 x 576): int4 / int4_min between 128 and 256 rows (at 32 rows the GEMV took 1.1 ms vs 3.9 for the
#: tiles), int8 between 64 and 128.
QUANT_GEMV_MAX_M = {"int4": 128, "int4_min": 128, "int8": 64, "fp8_e4m3": 64}
#: the same limits where the ``qgemm`` variant is a bf16 one (torch's bf16 GEMM on AVX512-BF16 or AMX tiles): the tiles
#: then win far earlier. Zen 5, 2 threads, 2026-12-05 (packed rows / bf16 tiles, ms, min of 20 calls): int4 at 32 rows
#: 0.65 / 0.66 (3072 x 576), 2.39 / 2.84 (5632 x 2048); at 48 rows 0.94 / 0.72 and 3.60 / 3.25; at 64 rows the tiles
#: are 1.5-1.9x faster, at 128 rows 2.0-2.4x; int8 at 48 rows 0.50 / 0.62 and 2.77 / 2.63, at 64 about even. With the
#: Zen 3 limits here, a 64-token SmolLM2 prompt cost 1.9 ms a token against 0.9 for a 512-token one.
QUANT_GEMV_MAX_M_BF16 = {"int4": 40, "int4_min": 40, "int8": 48, "fp8_e4m3": 64}
#: the ggml block formats' GEMV (one float32 decode per weight row, shared by the x rows) up to this many x rows; not
#: yet measured against the BLAS tiles, so set where the decode is clearly amortized
GGML_GEMV_MAX_M = 16
TILE_N = 512
#: below this many multiply-adds (M * N * K) the float GEMV runs on the calling thread: waking the thread pool
#: (~50 us) costs more than splitting the read saves (576 x 576 and 1536 x 576 at M = 1 are faster serial)
SERIAL_WORK = 1 << 23
#: weight dtypes the float GEMV reads directly, as the numpy dtype of their storage
_GEMV_VIEW = {torch.float32: torch.float32, torch.bfloat16: torch.uint16, torch.float16: torch.int16}


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 ``x @ w.T`` for x float32 ``[M, K]`` (M <= SMALL_M) and w float32/bf16/fp16 ``[N, K]`` (fp32
    accumulation; also used by the cpu ``lm_head``)."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m == 0 or n == 0 or k == 0:
        return out.zero_()
    if x.dtype == torch.float32 and x.is_contiguous() and not x.requires_grad:
        xn = x.numpy()  # the decode path: no copies (each torch call here costs ~1 us, 120 calls a token)
    else:
        xn = x.detach().float().contiguous().numpy()
    if w.dtype == torch.float32 and w.is_contiguous() and not w.requires_grad:
        wn = w.numpy()
    else:
        wn = w.detach().contiguous().view(_GEMV_VIEW[w.dtype]).numpy()
    serial = m * n * k < tuned("gemv_serial_work", None, SERIAL_WORK)  # tessera tune measures the crossover
    (float_gemv.gemv_serial if serial else float_gemv.gemv)(xn, wn, out.numpy())
    return out


def quantize(w: torch.Tensor, fmt: str, group_size: int) -> QuantizedWeight:
    return quantize_in(w, fmt, group_size, torch.float32)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    if qw.fmt in ggml.FMT_CODES:
        return _ggml_rows(qw, 0, qw.shape[0])
    return dequantize_in(qw, torch.float32)


def _ggml_rows(qw: QuantizedWeight, lo: int, hi: int) -> torch.Tensor:
    """Rows ``lo:hi`` of a ggml block-format weight, de-quantized to float32 ``[hi - lo, K]``."""
    out = torch.empty(hi - lo, qw.shape[1], dtype=torch.float32)
    if hi > lo:
        ggml.dequantize_rows(qw.data.numpy(), ggml.FMT_CODES[qw.fmt], qw.shape[1], lo, out.numpy())
    return out


def _ggml_matmul(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """float32 ``x @ W.T`` for a ggml block format up to :data:`GGML_GEMV_MAX_M` rows of x (Q4_K and Q6_K under
    ``vnni512``: every M, their row panels): int8 dot products on x quantized per block of 32 (:mod:`._qdot_ggml`,
    the panels of :mod:`._qdot`) where a ``qgemv`` variant with them runs, else each weight row
    decoded once to float32 and dotted with every x row. Above, tiles of :data:`TILE_N` rows de-quantized and run
    through a GEMM in the ``qgemm`` variant's precision (see :func:`_gemm_tiled`; the tile is de-quantized to float32,
    then rounded to bf16 once)."""
    m, n = x.shape[0], qw.shape[0]
    isa = qdot.chosen_token(qw)  # memoized; the int8 kernels' self-check on a process's first packed weight
    # the K-quant row panels beat the de-quantized bf16 tiles at every M measured (docs/kernels/quant.md)
    if isa is not None and (m <= GGML_GEMV_MAX_M or qdot.takes_panels(qw, isa)):
        serial = m * n * qw.shape[1] < tuned("gemv_serial_work", None, SERIAL_WORK)
        return qdot.qmatmul(x, qw, isa, serial)
    if m <= GGML_GEMV_MAX_M:
        out = torch.empty(m, n, dtype=torch.float32)
        ggml.gemv(x.numpy(), qw.data.numpy(), ggml.FMT_CODES[qw.fmt], out.numpy())
        return out
    return _ggml_tiled(x, qw)


def _ggml_tiled(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """float32 ``x @ W.T`` for a ggml block format through de-quantized tiles of :data:`TILE_N` rows (see
    :func:`_ggml_matmul`)."""
    m, n = x.shape[0], qw.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    tile_n = tuned("quant_tile_n", None, TILE_N)
    low = variants.choose("qgemm").name != "fp32"  # as in _gemm_tiled: bf16 tiles through torch's bf16 GEMM
    xb = x.to(torch.bfloat16) if low else None
    for lo in range(0, n, tile_n):
        hi = min(n, lo + tile_n)
        tile = _ggml_rows(qw, lo, hi)
        if low:
            out[:, lo:hi] = torch.mm(xb, tile.to(torch.bfloat16).T)
        else:
            np.matmul(x.numpy(), tile.numpy().T, out=out.numpy()[:, lo:hi])
    return out


def blas_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 ``x @ w.T`` through NumPy's OpenBLAS sgemm for contiguous float32 CPU tensors.

    torch's MKL takes its AVX2 path on AMD CPUs; on this machine OpenBLAS reached 250 GFLOP/s on SmolLM2's prefill
    shapes where torch gave 110-214 (M=512, K=576, N=576: 112 vs 255), and 197 vs 87 at M=32 (batched decode).
    """
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    np.matmul(x.numpy(), w.numpy().T, out=out.numpy())
    return out


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # the Numba and NumPy paths have no autograd and want row-major operands; anything else keeps torch's semantics
    plain = w.is_contiguous() and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    if x.shape[0] <= SMALL_M and w.dtype in _GEMV_VIEW and plain:
        out = gemv(x, w)
        return out if x.dtype == torch.float32 else out.to(x.dtype)
    if x.dtype == torch.float32:
        return blas_matmul(x.contiguous(), w) if plain and x.device.type == "cpu" else x @ w.T
    # half-precision BLAS paths differ across CPUs in how they accumulate; widening makes fp32 accumulation certain
    return (x.float() @ w.float().T).to(x.dtype)


def _rows_slice(qw: QuantizedWeight, lo: int, hi: int) -> QuantizedWeight:
    """Rows ``lo:hi`` of ``qw`` (views; every part is row-major with N first)."""
    part = lambda t: None if t is None else t[lo:hi]
    return QuantizedWeight(qw.fmt, (hi - lo, qw.shape[1]), qw.group_size, qw.data[lo:hi], qw.scales[lo:hi],
                           part(qw.zeros), part(qw.mins))


def gemv_max_m_default(fmt: str) -> int:
    """The untuned ``quant_gemv_max_m`` of ``fmt``: :data:`QUANT_GEMV_MAX_M_BF16` under a bf16 ``qgemm`` variant,
    else :data:`QUANT_GEMV_MAX_M` (``tessera tune`` measures the crossover on the machine itself)."""
    table = QUANT_GEMV_MAX_M if variants.choose("qgemm").name == "fp32" else QUANT_GEMV_MAX_M_BF16
    return table.get(fmt, SMALL_M)


def _gemm_tiled(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """float32 ``x @ W.T`` through weight tiles of ``quant_tile_n`` rows de-quantized one at a time (the float
    matrix is never held whole), in the ``qgemm`` variant's precision.

    The bf16 variants round x and each tile to bf16 (the tile is de-quantized in bf16 arithmetic: the int4 codes
    times the bf16-rounded scale) and take torch's bf16 GEMM, which accumulates in float32 and rounds its output to
    bf16: about 2^-8 relative error per output, finer than the int8 activations of the decode GEMV. Measured on Zen 4
    (2026-12-02, 2 threads, M=512 x 5632 x 2048 int4): de-quantize + sgemm 87-99 ms, bf16 ~42 ms.
    """
    n = qw.shape[0]
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    tile_n = tuned("quant_tile_n", None, TILE_N)
    low = variants.choose("qgemm").name != "fp32"
    xb = x.to(torch.bfloat16) if low else None
    for lo in range(0, n, tile_n):
        hi = min(n, lo + tile_n)
        if low:
            out[:, lo:hi] = torch.mm(xb, _bf16_tile(qw, lo, hi))
            continue
        tile = dequantize_in(_rows_slice(qw, lo, hi), torch.float32)
        np.matmul(x.numpy(), tile.numpy().T, out=out.numpy()[:, lo:hi])  # OpenBLAS: see blas_matmul
    return out


def _bf16_tile(qw: QuantizedWeight, lo: int, hi: int) -> torch.Tensor:
    """Rows ``lo:hi`` of ``qw`` de-quantized to bf16, transposed ``[K, hi - lo]`` (a view) for ``x @ tile``."""
    bits = torch.empty(hi - lo, qw.shape[1], dtype=torch.int16)
    out = bits.numpy().view(np.uint16)
    if qw.fmt in ("int4", "int4_min"):
        offsets = qw.mins if qw.fmt == "int4_min" else qw.zeros
        dequant_bf16.dequant_int4_bf16(qw.data.numpy(), group_view(qw.scales), group_view(offsets),
                                       qw.fmt == "int4_min", qw.group_size, lo, out)
    elif qw.fmt == "int8":
        dequant_bf16.dequant_int8_bf16(qw.data.numpy(), group_view(qw.scales), qw.group_size, lo, out)
    else:  # fp8: torch converts e4m3 exactly; one rounding to bf16 after the scale
        return (qw.data[lo:hi].float() * qw.scales[lo:hi]).to(torch.bfloat16).T
    return bits.view(torch.bfloat16).T


def _gemv(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    m, k = x.shape
    g = qw.group_size
    isa = qdot.chosen_token(qw) if qdot.unsupported(qw) is None else None
    if isa is not None:  # int8 dot products (the qgemv variant in force)
        serial = m * qw.shape[0] * k < tuned("gemv_serial_work", None, SERIAL_WORK)
        return qdot.qmatmul(x, qw, isa, serial)
    out = torch.empty(m, qw.shape[0], dtype=torch.float32)
    xn, on = x.numpy(), out.numpy()
    if qw.fmt in ("int8", "fp8_e4m3"):
        q = qw.data.numpy() if qw.fmt == "int8" else qw.data.view(torch.uint8).numpy()
        # e4m3 codes are widened as value * 2^-8 (see _quant_kernels); the 2^8 goes into the scale
        scales = group_view(qw.scales) if qw.fmt == "int8" else (qw.scales * 256.0).numpy()  # fp8: float32 scales
        kernels.gemv_8bit(xn, q, scales, g, on)
        return out
    halves = x.reshape(m, k // g, 2, g // 2)
    xlo, xhi = halves[:, :, 0].reshape(m, k // 2).numpy(), halves[:, :, 1].reshape(m, k // 2).numpy()
    xsum = x.reshape(m, k // g, g).sum(-1)
    offsets = qw.mins if qw.fmt == "int4_min" else qw.zeros
    kernels.gemv_int4(xlo, xhi, xsum.numpy(), qw.data.numpy(), group_view(qw.scales), group_view(offsets),
                      qw.fmt == "int4_min", g, on)
    return out


def qmatmul(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    if x.shape[0] == 0 or qw.shape[0] == 0:
        return torch.zeros(x.shape[0], qw.shape[0], dtype=x.dtype)
    xf = x.float().contiguous()
    if qw.fmt in ggml.FMT_CODES:
        return _ggml_matmul(xf, qw).to(x.dtype)
    gemv_max_m = tuned("quant_gemv_max_m", qw.fmt, gemv_max_m_default(qw.fmt))
    # the row-panel kernels beat the de-quantized bf16 tiles at every M measured (docs/kernels/quant.md)
    panels = qdot.takes_panels(qw, VNNI512) and qdot.unsupported(qw) is None and qdot.chosen_token(qw) is VNNI512
    out = _gemv(xf, qw) if panels or x.shape[0] <= gemv_max_m else _gemm_tiled(xf, qw)
    return out.to(x.dtype)


OPS = {"quantize": quantize, "dequantize": dequantize, "matmul": matmul, "qmatmul": qmatmul}
