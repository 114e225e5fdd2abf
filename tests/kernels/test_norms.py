"""rms_norm (Llama / Gemma, fused residual), layer_norm and qk_norm on every backend against the float64 oracle, plus
Hugging Face's modules and the error messages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.backends.reference.ops.norms import layer_norm_f64, qk_norm_f64, rms_norm_f64
from tessera.kernels.norms import layer_norm, qk_norm, rms_norm
from tests.kernels.conftest import kernel_backends
from tests.kernels.tolerances import TOLERANCES, assert_close_to_oracle

DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.float32, torch.bfloat16, torch.float16)]
# [..., H]: a single element, odd widths, several leading dims, no rows, a Llama-sized row
SHAPES = [(1, 1), (3, 37), (2, 5, 300), (0, 64), (9, 4096)]


def _rand(gen: torch.Generator, shape, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_rms_norm_matches_oracle(backend, dtype, shape, gemma, gen):
    x, w = _rand(gen, shape, dtype, 3.0), _rand(gen, shape[-1:], dtype)
    y = rms_norm(x, w, 1e-6, gemma=gemma, backend=backend)
    assert y.dtype == dtype
    assert_close_to_oracle(y, rms_norm_f64(x, w, 1e-6, None, gemma), dtype, f"rms_norm {shape}", reduction=True)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_residual_add(backend, dtype, shape, gen):
    """``r`` is exactly ``x + residual`` in the storage dtype (what the model would have added), ``y`` its norm."""
    x, res, w = _rand(gen, shape, dtype), _rand(gen, shape, dtype, 4.0), _rand(gen, shape[-1:], dtype)
    y, r = rms_norm(x, w, 1e-5, residual=res, backend=backend)
    assert torch.equal(r, x + res), "the new residual stream must equal x + residual rounded to the storage dtype"
    y_ref, _ = rms_norm_f64(x, w, 1e-5, res)
    assert_close_to_oracle(y, y_ref, dtype, f"rms_norm+residual {shape}", reduction=True)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (4, 33), (2, 3, 768)], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_layer_norm_matches_oracle(backend, dtype, shape, with_bias, gen):
    x = _rand(gen, shape, dtype, 2.0) + 5.0  # an offset mean: a one-pass variance would cancel
    w, b = _rand(gen, shape[-1:], dtype), _rand(gen, shape[-1:], dtype) if with_bias else None
    y = layer_norm(x, w, b, 1e-5, backend=backend)
    assert_close_to_oracle(y, layer_norm_f64(x, w, b, 1e-5), dtype, f"layer_norm {shape}", reduction=True)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 128), (5, 3, 64), (7, 4, 17)], ids=str)
@pytest.mark.parametrize("gemma", [False, True], ids=["qwen3", "gemma3"])
def test_qk_norm_matches_oracle(backend, dtype, shape, gemma, gen):
    q, w = _rand(gen, shape, dtype, 2.0), _rand(gen, shape[-1:], dtype)
    out = qk_norm(q, w, 1e-6, gemma=gemma, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close_to_oracle(out, qk_norm_f64(q, w, 1e-6, gemma), dtype, f"qk_norm {shape}")


def test_qk_norm_is_rms_norm_per_head(gen):
    q, w = _rand(gen, (6, 4, 32), torch.float32), _rand(gen, (32,), torch.float32)
    per_head = torch.stack([rms_norm(q[:, h], w, 1e-6) for h in range(4)], dim=1)
    torch.testing.assert_close(qk_norm(q, w, 1e-6), per_head, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", kernel_backends())
def test_mixed_weight_dtype_and_strided_input(backend, gen):
    """A float32 weight on bf16 activations, a transposed (non-contiguous) x, an nn.Parameter weight."""
    x = _rand(gen, (40, 6), torch.bfloat16).T  # [6, 40], strided
    w = torch.nn.Parameter(_rand(gen, (40,), torch.float32))
    y = rms_norm(x, w, 1e-6, backend=backend)
    assert_close_to_oracle(y, rms_norm_f64(x, w.detach(), 1e-6), torch.bfloat16, "strided rms_norm")
    b = _rand(gen, (40,), torch.float16)
    assert_close_to_oracle(layer_norm(x, w, b, backend=backend), layer_norm_f64(x, w.detach(), b, 1e-5),
                           torch.bfloat16, "mixed-dtype layer_norm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_matches_torch(dtype, gen):
    x, w, b = _rand(gen, (8, 768), dtype), _rand(gen, (768,), dtype), _rand(gen, (768,), dtype)
    ours, theirs = layer_norm(x, w, b, 1e-5), F.layer_norm(x, (768,), w, b, 1e-5)
    assert_close_to_oracle(ours, theirs.double(), dtype, "layer_norm vs torch")


def _hf_norm_classes():
    try:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError as exc:  # pragma: no cover - transformers is a test dependency
        pytest.skip(f"transformers unavailable: {exc}")
    return LlamaRMSNorm, GemmaRMSNorm


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_matches_hugging_face_modules(backend, dtype, gen):
    """LlamaRMSNorm (``w * normalized.to(dtype)``) and GemmaRMSNorm (``(x_norm * (1 + w.float())).to(dtype)``), after
    the decoder layer's residual add in the model dtype."""
    llama_cls, gemma_cls = _hf_norm_classes()
    hidden = 256
    x, res = _rand(gen, (5, hidden), dtype), _rand(gen, (5, hidden), dtype)
    for cls, gemma in ((llama_cls, False), (gemma_cls, True)):
        module = cls(hidden, eps=1e-6).to(dtype)
        with torch.no_grad():
            module.weight.copy_(_rand(gen, (hidden,), dtype, 0.5))
            expected = module(res + x)
        y, r = rms_norm(x, module.weight, 1e-6, residual=res, gemma=gemma, backend=backend)
        assert torch.equal(r, res + x)
        # Llama rounds the normalized value before the weight multiply (two roundings, ours is one): <= 1 ulp apart
        assert_close_to_oracle(y, expected.double(), dtype, f"{cls.__name__} {dtype}")
        if gemma:
            assert (y.double() - expected.double()).abs().max() <= TOLERANCES[dtype] * expected.abs().max()


# ---- errors ------------------------------------------------------------------------------------------------------


def test_errors_name_the_problem():
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(ValueError, match=r"weight must be \[H\] = \[8\]"):
        rms_norm(x, torch.randn(7))
    with pytest.raises(ValueError, match="eps must be > 0"):
        rms_norm(x, w, 0.0)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        rms_norm(x.to(torch.int32), w)
    with pytest.raises(ValueError, match="residual must match x"):
        rms_norm(x, w, residual=torch.randn(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"q must be \[tokens, heads, head_dim\]"):
        qk_norm(x, w)
    with pytest.raises(ValueError, match=r"bias must be \[H\]"):
        layer_norm(x, w, torch.randn(3))
    with pytest.raises(ValueError, match="H >= 1"):
        rms_norm(torch.randn(2, 0), torch.randn(0))
    with pytest.raises(ValueError, match="unknown backend"):
        rms_norm(x, w, backend="tpu")
