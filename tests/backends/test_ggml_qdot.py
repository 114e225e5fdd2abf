"""The int8-activation GEMV of ggml's block formats kept whole (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1), under every ``qgemv``
variant this machine runs: against the float64 product of the de-quantized weight and the kernels' own quantized
activation, with gguf-py's de-quantizer as the independent oracle of the weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tessera.backends.cpu import variants
from tessera.backends.cpu.ops import _qdot, _qdot_ggml, _qdot_kernels
from tessera.backends.reference.ops.quant import qmatmul_f64
from tessera.kernels import quant as Q
from tessera.kernels.ggml_quantize import quantize_rows
from tessera.kernels.quant import StackedWeight, from_gguf
from tessera.tuning.random_weights import random_ggml_weight
from tests.cpu_variants import skip_unless_runs
from tests.kernels.conftest import gen  # noqa: F401  (the seeded-generator fixture)
from tests.kernels.tolerances import assert_close_to_oracle

INT8_VARIANTS = [v.name for v in variants.FAMILIES["qgemv"].variants if v.name != "portable"]
FORMATS = ["q4_k", "q5_k", "q6_k", "q5_0", "q5_1"]
#: K of a few blocks: three of 256 for the K-quants, eleven of 32 (an odd count: the tail loop) for Q5_0 / Q5_1
K_OF = {"q4_k": 768, "q5_k": 768, "q6_k": 768, "q5_0": 352, "q5_1": 352}


@pytest.fixture(autouse=True)
def _fresh_choices():
    variants.reset()
    yield
    variants.reset()




def _quantized(w: torch.Tensor, fmt: str) -> tuple[Q.QuantizedWeight, torch.Tensor]:
    """``w`` in ``fmt`` as the file would hold it (Tessera's K-quant writer, gguf-py's Q5_0 / Q5_1 quantizer), and
    gguf-py's de-quantization of those bytes (float64)."""
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    values = w.numpy().astype(np.float32)
    blocks = quantize_rows(values, fmt) if fmt.endswith("_k") else gguf.quants.quantize(values, qtype)
    return (from_gguf(blocks, qtype, tuple(w.shape)),
            torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).double().reshape(w.shape))


@pytest.mark.parametrize("variant", INT8_VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n", [(0, 5), (1, 1), (1, 37), (3, 37), (8, 70), (16, 9)])
def test_ggml_qgemv_matches_gguf_py(variant: str, fmt: str, m: int, n: int, monkeypatch,
                                    gen: torch.Generator) -> None:
    """``Q.qmatmul`` on the cpu backend under each int8-activation variant equals gguf-py's de-quantized weight times
    the kernels' quantized activation (fp32 tolerance), for one to sixteen rows of x (the GEMV's range)."""
    skip_unless_runs("qgemv", variant)
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", f"qgemv={variant}")
    k = K_OF[fmt]
    qw, w_gguf = _quantized(torch.randn(n, k, generator=gen) * 0.05, fmt)
    x = torch.randn(m, k, generator=gen)
    out = Q.qmatmul(x, qw, backend="cpu")
    want = _qdot.quantized_activation(x).double() @ w_gguf.T
    assert_close_to_oracle(out, want, torch.float32, f"{variant} {fmt} M={m} N={n}", reduction=True)


@pytest.mark.parametrize("variant", INT8_VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_ggml_kernels_write_every_output(variant: str, fmt: str, gen: torch.Generator) -> None:
    """The raw kernels on random block bytes (every code, scale and 5th/6th-bit pattern), into a NaN-poisoned
    output, serial and parallel: one format, and two row blocks in different formats split at a row that is not a
    multiple of the parallel chunk (a Q4_K_M q|k|v with its Q6_K v)."""
    skip_unless_runs("qgemv", variant)
    token = _qdot._TOKENS[variant]
    k = K_OF[fmt]
    other = {"q5_0": "q5_1", "q5_1": "q5_0", "q4_k": "q6_k"}.get(fmt, "q4_k")
    first = random_ggml_weight(fmt, _qdot_kernels.ROWS + 3, k, gen)
    for w in (first, StackedWeight((first, random_ggml_weight(other, 2 * _qdot_kernels.ROWS + 5, k, gen)))):
        parts = w.parts if isinstance(w, StackedWeight) else (w,)
        for m in (1, 5):
            x = torch.randn(m, k, generator=gen)
            want = torch.cat([qmatmul_f64(_qdot.quantized_activation(x), p) for p in parts], dim=1)
            xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
            for kernel in (_qdot_ggml.gemv_ggml_serial, _qdot_ggml.gemv_ggml):
                got = np.full((m, w.shape[0]), np.nan, np.float32)
                kernel(token, xq, xd, xs, *_qdot.weight_arrays(w), got)
                assert_close_to_oracle(torch.from_numpy(got), want, torch.float32,
                                       f"{variant} {[p.fmt for p in parts]} M={m} {kernel.__name__}", reduction=True)


@pytest.mark.parametrize("variant", INT8_VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_ggml_qgemv_every_block_count(variant: str, fmt: str, gen: torch.Generator) -> None:
    """Rows of one to five blocks (Q5_0 / Q5_1 take blocks two at a time and finish an odd one alone)."""
    skip_unless_runs("qgemv", variant)
    token = _qdot._TOKENS[variant]
    values = 256 if fmt.endswith("_k") else 32
    for blocks in range(1, 6):
        w = random_ggml_weight(fmt, 7, values * blocks, gen)
        x = torch.randn(2, values * blocks, generator=gen)
        got = _qdot.qmatmul(x, w, token, serial=True)
        want = qmatmul_f64(_qdot.quantized_activation(x), w)
        assert_close_to_oracle(got, want, torch.float32, f"{variant} {fmt} {blocks} blocks", reduction=True)


def test_ggml_weights_are_taken_by_the_int8_kernels() -> None:
    """Every ggml block format, and two row blocks of them, run on the int8 dot products; three row blocks, or a
    block of another packed format, are declined with the reason."""
    g = torch.Generator().manual_seed(3)
    for fmt in FORMATS:
        assert _qdot.unsupported(random_ggml_weight(fmt, 2, K_OF[fmt], g)) is None
    a, b = random_ggml_weight("q4_k", 3, 256, g), random_ggml_weight("q6_k", 2, 256, g)
    assert _qdot.unsupported(StackedWeight((a, b))) is None
    assert "row blocks" in _qdot.unsupported(StackedWeight((a, b, a)))
    assert "row blocks" in _qdot.unsupported(StackedWeight((a, Q.quantize(torch.randn(2, 256, generator=g), "int4",
                                                                          32))))


def test_self_check_covers_ggml_formats() -> None:
    """The self-check a variant passes before a model's ggml weights run on it (random blocks, one and two row
    blocks, serial and parallel)."""
    best = variants.available("qgemv")[0]
    if _qdot._TOKENS[best] is None:
        pytest.skip("no int8-activation qgemv variant on this CPU")
    for fmt in FORMATS:
        assert _qdot.self_check(_qdot._TOKENS[best], (fmt, torch.uint8)) is None


@pytest.mark.parametrize("variant", [v.name for v in variants.FAMILIES["qgemm"].variants])
@pytest.mark.parametrize("fmt", FORMATS)
def test_ggml_prefill_tiles_under_every_qgemm_variant(variant: str, fmt: str, monkeypatch,
                                                      gen: torch.Generator) -> None:
    """Past the GEMV's rows (a prefill chunk) the weight is de-quantized tile by tile: float32 tiles and NumPy's
    sgemm, or tiles rounded to bf16 and torch's bf16 GEMM (bf16 tolerance). Q4_K and Q6_K under ``vnni512`` run
    their row panels at every M instead, on the quantized activation (fp32 tolerance)."""
    skip_unless_runs("qgemm", variant)
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", f"qgemm={variant}")
    k = K_OF[fmt]
    qw, w_gguf = _quantized(torch.randn(37, k, generator=gen) * 0.05, fmt)
    x = torch.randn(20, k, generator=gen)
    if _qdot.takes_panels(qw, _qdot.chosen_token(qw)):
        want, dtype = _qdot.quantized_activation(x).double() @ w_gguf.T, torch.float32
    else:
        want, dtype = x.double() @ w_gguf.T, torch.float32 if variant == "fp32" else torch.bfloat16
    assert_close_to_oracle(Q.qmatmul(x, qw, backend="cpu"), want, dtype, f"qgemm={variant} {fmt}", reduction=True)
