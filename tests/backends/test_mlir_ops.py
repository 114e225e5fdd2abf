"""The mlir backend's kernel ops (linalg modules compiled by IREE) against the float64 oracle: odd sizes, empty
inputs, every dtype, leading batch dims, and a whole model (SmolLM2, layer by layer, is `tessera validate`'s job;
here a small random llama-style forward matches the cpu backend)."""

from __future__ import annotations

import pytest
import torch

from tessera import kernels
from tessera.backends import registered
from tessera.backends.reference.ops import activations as ref_act
from tessera.backends.reference.ops import embedding as ref_emb
from tessera.backends.reference.ops import norms as ref_norms
from tessera.backends.reference.ops import rope as ref_rope
from tessera.kernels.rope import RotaryEmbedding
from tests.kernels.tolerances import assert_close_to_oracle

mlir = registered()["mlir"]
pytestmark = pytest.mark.skipif(bool(mlir.available()), reason="; ".join(mlir.available()) or "usable")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 33), (0, 9)])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm(dtype, shape, gemma):
    gen = torch.Generator().manual_seed(hash((shape, gemma)) % 1000)
    x, w = _randn(gen, *shape, dtype=dtype), _randn(gen, shape[-1], dtype=dtype)
    out = kernels.rms_norm(x, w, 1e-5, gemma=gemma, backend="mlir")
    assert out.dtype == dtype
    assert_close_to_oracle(out, ref_norms.rms_norm_f64(x, w, 1e-5, None, gemma), dtype, "rms_norm")


def test_rms_norm_fused_residual():
    gen = torch.Generator().manual_seed(1)
    x, r, w = _randn(gen, 4, 19), _randn(gen, 4, 19), _randn(gen, 19)
    y, summed = kernels.rms_norm(x, w, 1e-6, residual=r, backend="mlir")
    ref_y, ref_sum = ref_norms.rms_norm_f64(x, w, 1e-6, r)
    assert_close_to_oracle(y, ref_y, torch.float32, "rms_norm+residual")
    assert torch.equal(summed, ref_sum.float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["silu", "gelu_tanh", "gelu"])
def test_gated_activations(dtype, kind):
    gen = torch.Generator().manual_seed(2)
    x = _randn(gen, 2, 3, 2 * 21, dtype=dtype)
    if kind == "silu":
        out, ref = kernels.silu_and_mul(x, backend="mlir"), ref_act.silu_and_mul_f64(x)
    else:
        approximate = "tanh" if kind == "gelu_tanh" else "none"
        out = kernels.gelu_and_mul(x, approximate=approximate, backend="mlir")
        ref = ref_act.gelu_and_mul_f64(x, approximate)
    assert out.dtype == dtype
    assert_close_to_oracle(out, ref, dtype, kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 1), (7, 33, 65), (0, 5, 8), (3, 4, 0), (130, 17, 300)])
def test_matmul(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = _randn(gen, m, k, dtype=dtype), _randn(gen, n, k, dtype=dtype)
    out = kernels.matmul(x, w, backend="mlir")
    assert out.shape == (m, n)
    assert_close_to_oracle(out, x.double() @ w.double().T, dtype, "matmul", reduction=True)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rope(interleaved, partial):
    gen = torch.Generator().manual_seed(3)
    head_dim = 32
    rope = RotaryEmbedding.from_hf_config({"rope_theta": 10000.0, "head_dim": head_dim,
                                           "partial_rotary_factor": partial, "max_position_embeddings": 512})
    q, k = _randn(gen, 5, 4, head_dim), _randn(gen, 5, 2, head_dim)
    positions = torch.tensor([0, 3, 17, 200, 511])
    ref_q, ref_k = ref_rope.apply_rope_f64(q, k, positions, rope, interleaved)
    kernels.apply_rope(q, k, positions, rope, interleaved=interleaved, backend="mlir")
    assert_close_to_oracle(q, ref_q, torch.float32, "rope q")
    assert_close_to_oracle(k, ref_k, torch.float32, "rope k")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embed_and_lm_head(dtype):
    gen = torch.Generator().manual_seed(4)
    table = _randn(gen, 50, 24, dtype=dtype)
    ids = torch.tensor([[3, 0], [49, 3]])
    out = kernels.embed(ids, table, scale=2.0, backend="mlir")
    assert out.shape == (2, 2, 24) and out.dtype == dtype
    assert_close_to_oracle(out, ref_emb.embed_f64(ids, table, 2.0), dtype, "embed")
    hidden = _randn(gen, 3, 24, dtype=dtype)
    logits = kernels.lm_head(hidden, table, softcap=5.0, backend="mlir")
    assert logits.dtype == torch.float32
    assert_close_to_oracle(logits, ref_emb.lm_head_f64(hidden, table, 5.0), dtype, "lm_head", reduction=True)
