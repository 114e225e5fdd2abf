"""Paged attention over quantized KV pages (int8, fp8 e4m3): the KV-quantized tolerance class.

Two checks per case, both against the float64 oracle:

- on the **de-quantized** K/V (what the pages hold): within the ordinary tolerance of q's dtype. A backend that reads
  the codes itself must de-quantize exactly as :func:`tessera.kv.quantized.dequantize_kv` does.
- on the **original** K/V (what the model computed): within :data:`QUANTIZATION_BOUND` of the format, the error the
  format itself costs (norm-relative, the measure of ``tolerances.py``), measured on standard-normal K/V.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.attention import plan
from tessera.kv.quantized import KV_FORMATS, QuantizedPages, dequantize_kv, quantize_kv
from tests.attention.cases import VARIANTS, backend_params, oracle, seed_of, varlen_layout
from tests.attention.test_paged import MIXED_KV, MIXED_Q, paged_inputs
from tests.attention.tolerances import assert_matches_oracle, rel_err

BACKENDS = backend_params()
FORMATS = sorted(KV_FORMATS)
#: norm-relative error of attention on quantized K/V against the unquantized K/V (standard-normal inputs, D=64):
#: int8's grid step is absmax/127 per row, fp8 e4m3 keeps 3 mantissa bits (relative step 1/16)
QUANTIZATION_BOUND = {"int8": 2e-2, "fp8_e4m3": 8e-2}
DECODE_Q = (1, 1, 1, 4, 1)
DECODE_KV = (131, 50, 1, 64, 300)
QUANT_VARIANTS = [v for v in VARIANTS if v.name in {"causal", "window16", "alibi_causal", "sinks_causal",
                                                    "softcap_causal", "custom_dilated"}]


pytestmark = pytest.mark.usefixtures("float_qk")  # the float Q.K path (conftest.py)


def quantized(pages: torch.Tensor, fmt: str) -> QuantizedPages:
    codes, scales = quantize_kv(pages, fmt)
    return QuantizedPages(codes, scales, fmt)


def check_quantized(backend: str, fmt: str, q_lens, kv_lens, hq: int, hkv: int, d: int, variant, page_size: int,
                    dtype: torch.dtype, gen: torch.Generator) -> None:
    layout = varlen_layout(q_lens, kv_lens, hq, hkv, d)
    spec = variant.spec(layout, gen)
    q, k_pages, v_pages, table, k, v = paged_inputs(layout, page_size, dtype, gen)
    kq, vq = quantized(k_pages, fmt), quantized(v_pages, fmt)
    p = plan(spec, list(q_lens), list(kv_lens), table, page_size, backend=backend)
    out, lse = p.run(q, kq, vq, return_lse=True)
    # the same token rows, de-quantized: gather them exactly as paged_inputs gathered k and v
    kd, vd = dequantize_kv(kq.codes, kq.scales, dtype), dequantize_kv(vq.codes, vq.scales, dtype)
    rows_k, rows_v = [], []
    for s, kl in enumerate(kv_lens):
        n = -(-kl // page_size)
        rows_k.append(kd[table[s, :n].long()].reshape(-1, hkv, d)[:kl])
        rows_v.append(vd[table[s, :n].long()].reshape(-1, hkv, d)[:kl])
    ref_out, ref_lse = oracle(q, torch.cat(rows_k), torch.cat(rows_v), layout, spec)
    context = f"{backend} {fmt} ps={page_size} {spec!r} {layout}"
    assert_matches_oracle(out, lse, ref_out, ref_lse, dtype, context)
    raw_out, _ = oracle(q, k, v, layout, spec)
    err = rel_err(out, raw_out)
    assert err <= QUANTIZATION_BOUND[fmt], f"{context}: error against unquantized K/V {err:.3g}"


@pytest.mark.parametrize("variant", [pytest.param(v, id=v.name) for v in QUANT_VARIANTS])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_over_quantized_pages(backend: str, fmt: str, variant, request) -> None:
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    check_quantized(backend, fmt, DECODE_Q, DECODE_KV, 8, 2, 64, variant, 16, torch.float32, gen)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_step_over_quantized_pages(backend: str, fmt: str, request) -> None:
    """Prefill, prefix, decode and verification rows in one step: backends that read codes only in decode
    kernels de-quantize the pages the plan reads."""
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    causal = next(v for v in VARIANTS if v.name == "causal")
    check_quantized(backend, fmt, MIXED_Q, MIXED_KV, 8, 2, 64, causal, 16, torch.float32, gen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_queries_over_quantized_pages(backend: str, fmt: str, dtype: torch.dtype, request) -> None:
    gen = torch.Generator().manual_seed(seed_of(request.node.nodeid))
    causal = next(v for v in VARIANTS if v.name == "causal")
    check_quantized(backend, fmt, DECODE_Q, DECODE_KV, 8, 2, 64, causal, 16, dtype, gen)


@settings(max_examples=25, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    kv_lens=st.lists(st.integers(1, 90), min_size=1, max_size=4),
    q_len=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    hkv=st.integers(1, 2),
    d=st.sampled_from([16, 40, 64]),
    page_size=st.sampled_from([1, 5, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantized_decode_property(fmt, kv_lens, q_len, group, hkv, d, page_size, seed) -> None:
    """Shuffled pages, partial last pages, every GQA ratio, odd head dims: the default backend against the oracle
    on the de-quantized pages."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = [min(q_len, kl) for kl in kv_lens]
    causal = next(v for v in VARIANTS if v.name == "causal")
    check_quantized("auto", fmt, q_lens, kv_lens, hkv * group, hkv, d, causal, page_size, torch.float32, gen)


def test_quantize_round_trip_and_zero_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, 33, generator=gen) * torch.logspace(-3, 3, 3).view(1, 3, 1)
    x[2, 1] = 0.0
    for fmt in FORMATS:
        codes, scales = quantize_kv(x, fmt)
        assert codes.dtype == KV_FORMATS[fmt][0] and scales.dtype == torch.float16 and scales.shape == (7, 3)
        back = dequantize_kv(codes, scales)
        assert torch.equal(back[2, 1], torch.zeros(33))
        # per-row error relative to the row's range: half a grid step (int8) or half an ulp of 3 mantissa bits
        row_err = (back - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30)
        assert float(row_err.max()) <= (0.5 / 127 + 1e-3 if fmt == "int8" else 1 / 16 + 1e-3), fmt
        assert float(codes.float().abs().max()) == KV_FORMATS[fmt][1]  # the largest value takes the top code


def test_mismatched_pages_are_refused() -> None:
    gen = torch.Generator().manual_seed(1)
    causal = next(v for v in VARIANTS if v.name == "causal")
    layout = varlen_layout((1,), (20,), 4, 2, 16)
    q, k_pages, v_pages, table, _, _ = paged_inputs(layout, 8, torch.float32, gen)
    p = plan(causal.spec(layout, gen), [1], [20], table, 8)
    with pytest.raises(TypeError, match="both be QuantizedPages of one format or both tensors"):
        p.run(q, quantized(k_pages, "int8"), v_pages)
    with pytest.raises(TypeError, match="one format"):
        p.run(q, quantized(k_pages, "int8"), quantized(v_pages, "fp8_e4m3"))
