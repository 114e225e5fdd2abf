"""Conformance of the quant family: formats round-trip, GGUF blocks match gguf's own dequantizer, and every backend's
matmul/qmatmul matches the float64 oracle on the dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.backends.reference.ops.quant import dequantize_f64, matmul_f64, qmatmul_f64
from tessera.kernels import quant as Q
from tests.kernels.conftest import kernel_backends
from tests.kernels.tolerances import assert_close_to_oracle

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (format, group_size): per channel and every group size across the formats
FORMATS = [("int8", None), ("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128), ("int4_min", 32),
           ("int4_min", 128), ("fp8_e4m3", None)]


@pytest.fixture(autouse=True)
def _float_activations(monkeypatch):
    """These tests hold qmatmul to weight-only semantics (float x, float32 tiles); the cpu backend's int8-activation
    qgemv and bf16-tile qgemm variants are checked against their own oracles in tests/backends/test_cpu_variants.py."""
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "qgemv=portable,qgemm=fp32")


def _weight(gen: torch.Generator, n: int, k: int) -> torch.Tensor:
    # rows of different magnitudes, so per-row/per-group scales matter
    return torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1)


def _k_for(group_size: int | None) -> int:
    return 3 * (group_size or 32)  # an odd number of groups: exercises the cpu kernels' tails


@pytest.mark.parametrize("backend", ["reference", "cpu"])  # triton: bit-identical to reference (test below)
@pytest.mark.parametrize("fmt,group_size", FORMATS)
def test_round_trip_error_bound(backend: str, fmt: str, group_size: int | None, gen: torch.Generator) -> None:
    n, k = 37, _k_for(group_size)
    w = _weight(gen, n, k)
    qw = Q.quantize(w, fmt, group_size, backend=backend)
    assert qw.fmt == fmt and qw.shape == (n, k) and qw.group_size == (group_size or (128 if fmt.startswith("int4") else k))
    deq = Q.dequantize(qw, backend=backend)
    assert deq.dtype == torch.float32 and deq.shape == (n, k)
    # float32 rounding of q * s + m, relative to the weight's range
    torch.testing.assert_close(deq.double(), dequantize_f64(qw), rtol=1e-6, atol=1e-6 * float(w.abs().max()))
    s = qw.scales.double().repeat_interleave(qw.group_size, dim=1)
    err = (deq.double() - w.double()).abs()
    if fmt == "fp8_e4m3":  # 3 mantissa bits: half an ulp is 2^-4 relative; subnormal steps are 2^-9 * s
        bound = w.double().abs() * 2.0**-4 + s * 2.0**-10
    else:  # round to nearest: half a step
        bound = s / 2
    assert bool((err <= bound * (1 + 1e-5) + 1e-7).all()), f"max excess {(err - bound).max():.3g}"


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """Raw bits, so -0.0 / +0.0 and NaN payloads count as differences."""
    if t is None:
        return None
    return t.view({torch.float32: torch.int32, torch.float8_e4m3fn: torch.uint8}.get(t.dtype, t.dtype))


def _assert_same_packing(got: Q.QuantizedWeight, want: Q.QuantizedWeight, what: str) -> None:
    assert (got.fmt, got.shape, got.group_size) == (want.fmt, want.shape, want.group_size), what
    for part in ("data", "scales", "zeros", "mins"):
        a, b = _bits(getattr(got, part)), _bits(getattr(want, part))
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"{what}: {part} differs"


@pytest.mark.parametrize("backend", kernel_backends()[2:])  # triton (skipped where it cannot run)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt,group_size", FORMATS)
def test_triton_quantize_dequantize_bit_identical(backend: str, fmt: str, group_size: int | None, dtype: torch.dtype,
                                                  gen: torch.Generator) -> None:
    """triton's quantize packs the reference's bytes and scales; its dequantize returns the reference's floats."""
    n, k = 3, _k_for(group_size)
    w = _weight(gen, n, k).to(dtype)
    w[1, : group_size or k] = 0  # an all-zero group: scale 0
    w[2, 3] = -0.0
    qw = Q.quantize(w, fmt, group_size, backend=backend)
    want = Q.quantize(w, fmt, group_size, backend="reference")
    _assert_same_packing(qw, want, f"{fmt}/{group_size} {dtype}")
    deq = Q.dequantize(want, backend=backend)
    assert deq.dtype == torch.float32 and torch.equal(_bits(deq), _bits(Q.dequantize(want, backend="reference")))


@pytest.mark.parametrize("backend", kernel_backends()[2:])
def test_triton_quantize_rounding_ties(backend: str) -> None:
    """Exact halves (power-of-two scales) round half to even, and fp8 midpoints of every code (float64 -> float32 ->
    fp8, as torch converts) land where the reference puts them."""
    halves = torch.arange(-127, 129, dtype=torch.float32).reshape(1, -1) / 16  # q = w / s = n / 2
    halves[0, 0] = 127 / 8  # s = 1/8
    cases = [("int8", halves, None), ("int8", halves, 32),
             ("int4", (torch.arange(-16, 16, 0.5).reshape(1, 64).clamp(-7, 7)), 32),
             ("int4_min", torch.arange(0, 64, dtype=torch.float32).reshape(1, 64) / 2, 32)]
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    c = codes[torch.isfinite(codes)].unique()
    mids = (c[1:] + c[:-1]) / 2
    vals = torch.cat([c, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    row = torch.zeros(1, 32 * (len(vals) // 32 + 1))
    row[0, : len(vals)], row[0, -1] = vals, 448.0  # s = 1
    cases.append(("fp8_e4m3", row, None))
    for fmt, w, g in cases:
        _assert_same_packing(Q.quantize(w, fmt, g, backend=backend), Q.quantize(w, fmt, g, backend="reference"), fmt)
    # every fp8 code, NaNs included, dequantizes as the reference does
    qw = Q.QuantizedWeight("fp8_e4m3", (1, 256), 256, torch.arange(256, dtype=torch.uint8)
                           .view(torch.float8_e4m3fn).reshape(1, 256), torch.tensor([[0.37]]))
    got, want = Q.dequantize(qw, backend=backend), Q.dequantize(qw, backend="reference")
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(_bits(got)[~want.isnan()], _bits(want)[~want.isnan()])


def test_all_zero_group_dequantizes_to_zero(gen: torch.Generator) -> None:
    w = _weight(gen, 4, 64)
    w[1, :32] = 0
    for fmt in ("int8", "int4", "int4_min"):
        deq = Q.dequantize(Q.quantize(w, fmt, 32))
        assert bool((deq[1, :32] == 0).all()), fmt


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt,group_size", FORMATS)
@pytest.mark.parametrize("m", [0, 1, 3, 17, 150])  # cpu: 17 takes the GEMV's many-row path, 150 the tiled GEMM
def test_qmatmul_matches_oracle(backend: str, dtype: torch.dtype, fmt: str, group_size: int | None, m: int,
                                gen: torch.Generator) -> None:
    if backend == "triton" and (m in (3, 150) or (fmt, group_size) in (("int4", 64), ("int4_min", 128))):
        pytest.skip("interpreter time: triton covers M=0/1/17 and one group size per int4 format")
    n, k = 37, _k_for(group_size)
    qw = Q.quantize(_weight(gen, n, k), fmt, group_size)
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = Q.qmatmul(x, qw, backend=backend)
    assert out.dtype == dtype
    assert_close_to_oracle(out, qmatmul_f64(x, qw), dtype, f"{backend} {fmt}/{group_size} m={m}", reduction=True)


@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("fmt,group_size", FORMATS)
def test_cpu_kernel_paths_long_k(fmt: str, group_size: int | None, m: int, gen: torch.Generator) -> None:
    """The Numba GEMV at a decode-like K (many groups, fp32 accumulation over 2k terms)."""
    n, k = 41, 2048 + (group_size or 32)
    qw = Q.quantize(_weight(gen, n, k), fmt, group_size)
    x = torch.randn(m, k, generator=gen)
    assert_close_to_oracle(Q.qmatmul(x, qw, backend="cpu"), qmatmul_f64(x, qw), torch.float32, fmt, reduction=True)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [0, 1, 17])
def test_matmul_matches_oracle(backend: str, dtype: torch.dtype, m: int, gen: torch.Generator) -> None:
    x = torch.randn(m, 75, generator=gen).to(dtype)
    w = torch.randn(33, 75, generator=gen).to(dtype)
    out = Q.matmul(x, w, backend=backend)
    assert out.dtype == dtype
    assert_close_to_oracle(out, matmul_f64(x, w), dtype, f"{backend} matmul m={m}", reduction=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 8, 9])
@pytest.mark.parametrize("n,k", [(37, 75), (4099, 2051)])
def test_cpu_matmul_gemv_paths(dtype: torch.dtype, m: int, n: int, k: int, gen: torch.Generator) -> None:
    """cpu float matmul: the Numba GEMV (M <= 8; serial for the small shape, parallel for the large one, row tails
    not a multiple of 4 or of the block) and BLAS (M = 9), against the oracle; the lm_head reuses the GEMV."""
    from tessera.backends.cpu.ops import quant as cpu_quant
    from tessera.kernels.embedding import lm_head

    assert (m * n * k < cpu_quant.SERIAL_WORK) == (n == 37)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    out = Q.matmul(x, w, backend="cpu")
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close_to_oracle(out, matmul_f64(x, w), dtype, f"cpu matmul {n}x{k} m={m}", reduction=True)
    logits = lm_head(x, w, backend="cpu")
    assert logits.dtype == torch.float32
    assert_close_to_oracle(logits, matmul_f64(x, w), torch.float32, f"cpu lm_head {n}x{k} m={m}", reduction=True)


def test_cpu_matmul_keeps_autograd(gen: torch.Generator) -> None:
    x = torch.randn(1, 16, generator=gen, requires_grad=True)
    w = torch.randn(8, 16, generator=gen)
    Q.matmul(x, w, backend="cpu").sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0, keepdim=True))


@pytest.mark.parametrize("name,fmt", [("Q4_0", "int4"), ("Q4_1", "int4_min"), ("Q8_0", "int8")])
def test_from_gguf_matches_gguf_dequantize(name: str, fmt: str, gen: torch.Generator) -> None:
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[name]
    n, k = 7, 160
    w = _weight(gen, n, k).numpy()
    raw = gguf.quants.quantize(w, qtype)
    qw = Q.from_gguf(raw, qtype, (n, k))
    assert qw.fmt == fmt and qw.group_size == 32
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k))
    assert torch.equal(Q.dequantize(qw), expected.float())  # bit-exact: the same formulas, no conversion
    assert Q.from_gguf(raw.tobytes(), name, (n, k)).data.equal(qw.data)
    x = torch.randn(2, k, generator=gen)
    assert_close_to_oracle(Q.qmatmul(x, qw), x.double() @ expected.double().T, torch.float32, name, reduction=True)


def test_nbytes_counts_packed_parts(gen: torch.Generator) -> None:
    qw = Q.quantize(_weight(gen, 8, 256), "int4", 128)
    assert qw.nbytes == 8 * 128 + 8 * 2 * 4 + 8 * 2


@pytest.mark.parametrize("name,block_bytes", [("Q4_0", 16 + 2 + 1), ("Q4_1", 16 + 2 + 2), ("Q8_0", 32 + 2)])
def test_from_gguf_keeps_float16_scales(name: str, block_bytes: int, gen: torch.Generator) -> None:
    """A packed GGUF weight holds the file's float16 scales and mins, not float32 copies: Q4_1 and Q8_0 take exactly
    the file's bytes per block, Q4_0 one more (its zero point)."""
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[name]
    raw = gguf.quants.quantize(_weight(gen, 4, 96).numpy(), qtype)
    qw = Q.from_gguf(raw, qtype, (4, 96))
    assert qw.scales.dtype == torch.float16 and (qw.mins is None or qw.mins.dtype == torch.float16)
    assert qw.nbytes == 4 * 3 * block_bytes


@pytest.mark.parametrize("call,exc,match", [
    (lambda w: Q.quantize(w[:, :80], "int4", 32), ValueError, "multiple of group_size"),
    (lambda w: Q.quantize(w, "int3"), ValueError, "unknown quantized format"),
    (lambda w: Q.quantize(w, "int4", 48), ValueError, "group_size must be one of"),
    (lambda w: Q.quantize(w, "fp8_e4m3", 32), ValueError, "per channel only"),
    (lambda w: Q.quantize(w.to(torch.int32), "int8"), TypeError, "float32, bfloat16 or float16"),
    (lambda w: Q.quantize(w.masked_fill(w > 1, float("nan")), "int8"), ValueError, "NaN"),
    (lambda w: Q.qmatmul(w[:, :32], Q.quantize(w, "int8")), ValueError, "K differs"),
    (lambda w: Q.qmatmul(w[0], Q.quantize(w, "int8")), ValueError, "must be 2-D"),
    (lambda w: Q.qmatmul(w, w), TypeError, "QuantizedWeight"),
    (lambda w: Q.matmul(w, w.half()), TypeError, "cast one of them"),
    (lambda w: Q.qmatmul(w, Q.quantize(w, "int8"), backend="nope"), ValueError, "unknown backend"),
    (lambda w: Q.from_gguf(np.zeros(10, np.uint8), "Q4_0", (1, 32)), ValueError, "expected 18 bytes"),
    (lambda w: Q.from_gguf(np.zeros(10, np.uint8), "Q2_K", (1, 256)), ValueError, "not supported"),
    (lambda w: Q.from_gguf(np.zeros(10, np.uint8), "Q6_K", (1, 256)), ValueError, "expected 210 bytes"),
    (lambda w: Q.QuantizedWeight("int4", (2, 64), 32, torch.zeros(2, 32, dtype=torch.uint8), torch.ones(2, 2)),
     ValueError, "zeros must be given"),
    (lambda w: Q.QuantizedWeight("int8", (2, 64), 32, torch.zeros(2, 64, dtype=torch.int8),
                                 torch.ones(2, 2, dtype=torch.bfloat16)),
     ValueError, "scales must be a contiguous torch.float32 or torch.float16 tensor"),
    (lambda w: Q.QuantizedWeight("int4_min", (2, 64), 32, torch.zeros(2, 32, dtype=torch.uint8),
                                 torch.ones(2, 2, dtype=torch.float16), mins=torch.zeros(2, 2)),
     ValueError, "mins must be a contiguous torch.float16 tensor"),
    (lambda w: Q.QuantizedWeight("fp8_e4m3", (2, 64), 64, torch.zeros(2, 64, dtype=torch.float8_e4m3fn),
                                 torch.ones(2, 1, dtype=torch.float16)),
     ValueError, "scales must be a contiguous torch.float32 tensor"),
])
def test_errors(call, exc: type, match: str, gen: torch.Generator) -> None:
    with pytest.raises(exc, match=match):
        call(torch.randn(6, 96, generator=gen))
