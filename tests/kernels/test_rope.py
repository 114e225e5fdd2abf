"""Rotary embeddings: table builders against transformers' rope rules, apply_rope on every backend against the
float64 oracle and against transformers' ``apply_rotary_pos_emb``, and the boundary's error messages."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tessera.backends.reference.ops.rope import apply_rope_f64
from tessera.kernels.rope import RotaryEmbedding, apply_rope
from tests.kernels.conftest import kernel_backends
from tests.kernels.tolerances import assert_close_to_oracle

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# rope_type -> (head_dim, max_position_embeddings, rope_parameters); lengths chosen so every rule's branches show
# (llama3: all three wavelength bands at D=128; yarn: a ramp strictly inside the dims).
HF_CASES = {
    "default": (64, 2048, {"rope_type": "default", "rope_theta": 10000.0}),
    "linear": (64, 4096, {"rope_type": "linear", "factor": 2.5, "rope_theta": 10000.0}),
    "linear_partial": (64, 4096, {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5}),
    "dynamic": (32, 1024, {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}),
    "llama3": (128, 131072, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_theta": 500000.0}),
    "yarn": (64, 16384, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                         "rope_theta": 10000.0}),
    "yarn_mscale": (64, 16384, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 24, "beta_slow": 2,
                                "truncate": False, "rope_theta": 10000.0}),
    "longrope": (16, 4096, {"rope_type": "longrope", "original_max_position_embeddings": 1024,
                            "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0, 4.0, 5.0],
                            "long_factor": [1.0, 1.5, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0], "rope_theta": 10000.0}),
}


def hf_config(name: str) -> LlamaConfig:
    head_dim, max_pos, params = HF_CASES[name]
    return LlamaConfig(head_dim=head_dim, hidden_size=4 * head_dim, num_attention_heads=4,
                       max_position_embeddings=max_pos, rope_parameters=dict(params))


def hf_inv_freq(config: LlamaConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)


@pytest.mark.parametrize("name", list(HF_CASES))
def test_tables_match_transformers_rules(name: str) -> None:
    config = hf_config(name)
    rope = RotaryEmbedding.from_hf_config(config, max_position=4096)  # the rules don't depend on the table length
    inv, attention = hf_inv_freq(config)
    assert rope.rope_type == config.rope_parameters["rope_type"]
    assert rope.rotary_dim == 2 * inv.numel()
    # transformers evaluates in float32 (base ** (2i / d) with a rounded exponent, then a blend), we in float64
    torch.testing.assert_close(rope.inv_freq, inv.double(), rtol=5e-6, atol=0.0)
    assert rope.attention_scaling == pytest.approx(attention, rel=1e-12)
    # the config.json dict path reads the same values
    same = RotaryEmbedding.from_hf_config(config.to_dict(), max_position=4096)
    assert torch.equal(same.inv_freq, rope.inv_freq) and same.attention_scaling == rope.attention_scaling


@pytest.mark.parametrize("name", list(HF_CASES))
def test_cos_sin_match_transformers_forward(name: str, gen: torch.Generator) -> None:
    config = hf_config(name)
    rope = RotaryEmbedding.from_hf_config(config, max_position=4096)
    positions = torch.cat([torch.arange(3), torch.randint(0, 2048, (29,), generator=gen)])
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])
    # transformers switches dynamic / longrope frequencies on max(position) + 1 inside its forward
    rope = rope.for_length(int(positions.max()) + 1)
    half = rope.rotary_dim // 2
    # transformers' float32 angle p * inv_freq is off by up to ~p * 6e-8 rad
    torch.testing.assert_close(rope.cos[positions], cos[0, :, :half], rtol=0, atol=3e-4)
    torch.testing.assert_close(rope.sin[positions], sin[0, :, :half], rtol=0, atol=3e-4)


def test_legacy_rope_scaling_dict() -> None:
    """transformers 4.x config.json: ``rope_scaling`` with ``type`` and a top-level ``rope_theta``."""
    cfg = {"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 4096, "rope_theta": 5e5,
           "partial_rotary_factor": 0.5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    rope = RotaryEmbedding.from_hf_config(cfg)
    assert (rope.head_dim, rope.rotary_dim, rope.rope_type, rope.base) == (64, 32, "linear", 5e5)
    expected = 1.0 / 5e5 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32) / 2.0
    torch.testing.assert_close(rope.inv_freq, expected, rtol=1e-15, atol=0)


def test_dynamic_for_length_matches_transformers() -> None:
    config = hf_config("dynamic")
    rope = RotaryEmbedding.from_hf_config(config)
    assert rope.for_length(1) is rope and rope.for_length(1024) is rope
    longer = rope.for_length(3000)
    inv, _ = hf_inv_freq(config, seq_len=3000)
    torch.testing.assert_close(longer.inv_freq, inv.double(), rtol=2e-6, atol=0.0)
    assert longer.max_position == 3000 and longer.cos.shape == (3000, 16)
    assert rope.for_length(3000) is longer  # cached for the next layer / call
    assert not torch.allclose(longer.inv_freq, rope.inv_freq)


def test_longrope_for_length_switches_factors() -> None:
    config = hf_config("longrope")
    rope = RotaryEmbedding.from_hf_config(config)
    assert rope.for_length(1024) is rope
    long = rope.for_length(1025)
    inv, attention = hf_inv_freq(config, seq_len=1025)
    torch.testing.assert_close(long.inv_freq, inv.double(), rtol=2e-6, atol=0.0)
    assert long.attention_scaling == pytest.approx(attention) and long.max_position == rope.max_position
    assert rope.for_length(4000) is long


# (tokens, num_q_heads, num_kv_heads, head_dim, partial_rotary_factor)
SHAPES = [(5, 4, 2, 64, 1.0), (13, 3, 1, 80, 0.5), (1, 7, 7, 2, 1.0), (3, 2, 3, 96, 0.25), (0, 4, 2, 64, 1.0)]


def _inputs(shape, dtype, gen, max_position=300):
    tokens, hq, hkv, d, partial = shape
    rope = RotaryEmbedding.build(d, max_position, base=10000.0, partial_rotary_factor=partial)
    q = torch.randn(tokens, hq, d, generator=gen).to(dtype)
    k = torch.randn(tokens, hkv, d, generator=gen).to(dtype)
    positions = torch.randint(0, max_position, (tokens,), generator=gen)
    return q, k, positions, rope


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_apply_rope_matches_oracle(backend, dtype, interleaved, shape, gen) -> None:
    q, k, positions, rope = _inputs(shape, dtype, gen)
    ref_q, ref_k = apply_rope_f64(q, k, positions, rope, interleaved)
    q_in, k_in = q.clone(), k.clone()
    out_q, out_k = apply_rope(q, k, positions.to(torch.int32), rope, interleaved=interleaved, backend=backend)
    assert out_q is q and out_k is k, "apply_rope must rotate in place and return its inputs"
    assert_close_to_oracle(q, ref_q, dtype, f"q {backend}")
    assert_close_to_oracle(k, ref_k, dtype, f"k {backend}")
    r = rope.rotary_dim
    assert torch.equal(q[..., r:], q_in[..., r:]) and torch.equal(k[..., r:], k_in[..., r:]), "pass-through dims"


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rope_on_views_of_a_fused_qkv(backend, dtype, gen) -> None:
    """q and k as strided views into one [tokens, (Hq + 2 Hkv) * D] projection output; v must stay untouched."""
    tokens, hq, hkv, d = 6, 4, 2, 32
    rope = RotaryEmbedding.build(d, 64, scaling={"rope_type": "linear", "factor": 2.0})
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    before = qkv.clone()
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(tokens, hkv, d)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    ref_q, ref_k = apply_rope_f64(q, k, positions, rope)
    apply_rope(q, k, positions, rope, backend=backend)
    assert_close_to_oracle(q, ref_q, dtype, "q view")
    assert_close_to_oracle(k, ref_k, dtype, "k view")
    assert torch.equal(qkv[:, (hq + hkv) * d:], before[:, (hq + hkv) * d:]), "v was written"


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("name", ["default", "yarn", "longrope"])
def test_apply_rope_matches_transformers_apply_rotary_pos_emb(backend, name, gen) -> None:
    config = hf_config(name)
    head_dim = config.head_dim
    rope = RotaryEmbedding.from_hf_config(config)
    positions = torch.randint(0, 200, (9,), generator=gen)
    q = torch.randn(9, 4, head_dim, generator=gen)
    k = torch.randn(9, 2, head_dim, generator=gen)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    # transformers' layout: [batch, heads, tokens, head_dim]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    apply_rope(q, k, positions, rope, backend=backend)
    torch.testing.assert_close(q, hf_q[0].transpose(0, 1), rtol=0, atol=2e-5)
    torch.testing.assert_close(k, hf_k[0].transpose(0, 1), rtol=0, atol=2e-5)


def test_interleaved_is_complex_multiplication(gen) -> None:
    """GPT-J layout: each (x[2i], x[2i+1]) is a complex number multiplied by exp(i * position * inv_freq[i])."""
    rope = RotaryEmbedding.build(48, 100, base=777.0, partial_rotary_factor=0.5)
    q, k = torch.randn(4, 3, 48, generator=gen), torch.randn(4, 1, 48, generator=gen)
    positions = torch.tensor([0, 1, 57, 99])
    phase = torch.polar(torch.ones(4, 12, dtype=torch.float64), positions[:, None] * rope.inv_freq[None])
    expected = torch.view_as_real(torch.view_as_complex(q.double()[..., :24].reshape(4, 3, 12, 2))
                                  * phase[:, None]).reshape(4, 3, 24)
    apply_rope(q, k, positions, rope, interleaved=True, backend="cpu")
    torch.testing.assert_close(q[..., :24].double(), expected, rtol=0, atol=1e-5)


def test_yarn_attention_factor_scales_the_rotation(gen) -> None:
    rope = RotaryEmbedding.from_hf_config(hf_config("yarn"))
    assert rope.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)
    q, k = torch.randn(2, 1, 64, generator=gen), torch.randn(2, 1, 64, generator=gen)
    norm = q.norm(dim=-1)
    apply_rope(q, k, torch.tensor([0, 9000]), rope)
    torch.testing.assert_close(q.norm(dim=-1), norm * rope.attention_scaling, rtol=1e-5, atol=0)


def _good():
    rope = RotaryEmbedding.build(64, 128)
    return torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.arange(3), rope


@pytest.mark.parametrize("change, error, match", [
    (lambda q, k, p, r: (q.double(), k, p, r), TypeError, "float32, bfloat16 or float16"),
    (lambda q, k, p, r: (q, k.half(), p, r), ValueError, "share a device and q, k a dtype"),
    (lambda q, k, p, r: (q[..., :32], k, p, r), ValueError, r"head_dim=64\], got \(3, 4, 32\)"),
    (lambda q, k, p, r: (q, k, p[:2], r), ValueError, "same number of tokens, got 3, 3 and 2"),
    (lambda q, k, p, r: (q, k, p.float(), r), TypeError, "1-D int32/int64"),
    (lambda q, k, p, r: (q, k, p + 126, r), ValueError, r"in \[0, 128\).*got \[126, 128\].*max_position >= 129"),
    (lambda q, k, p, r: (q, k, p - 1, r), ValueError, r"got \[-1, 1\]"),
    (lambda q, k, p, r: (q.transpose(1, 2).contiguous().transpose(1, 2), k, p, r), ValueError, "stride 1"),
    (lambda q, k, p, r: (q, k, p, {"rope_theta": 1e4}), TypeError, "rope must be a RotaryEmbedding"),
])
def test_apply_rope_errors(change, error, match) -> None:
    with pytest.raises(error, match=match):
        apply_rope(*change(*_good()))


def test_dynamic_out_of_range_error_suggests_for_length() -> None:
    rope = RotaryEmbedding.build(16, 64, scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"rope.for_length\(65\)"):
        apply_rope(torch.randn(1, 1, 16), torch.randn(1, 1, 16), torch.tensor([64]), rope)
    q = torch.randn(1, 1, 16)
    apply_rope(q, torch.randn(1, 1, 16), torch.tensor([64]), rope.for_length(65))


def test_unknown_backend_error() -> None:
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        apply_rope(*_good(), backend="gpu")


@pytest.mark.parametrize("kwargs, match", [
    ({"scaling": {"rope_type": "ntk-by-parts"}}, "unsupported rope_type 'ntk-by-parts'"),
    ({"scaling": {"rope_type": "linear"}}, "needs 'factor'"),
    ({"scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}, "needs 'high_freq_factor'"),
    ({"scaling": {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}},
     "rotary_dim // 2 = 8 entries, got 3"),
    ({"partial_rotary_factor": 0.35}, "must be even"),
])
def test_build_errors(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        RotaryEmbedding.build(16, 64, **kwargs)


def test_per_layer_rope_parameters_are_refused() -> None:
    cfg = {"head_dim": 16, "max_position_embeddings": 64,
           "rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}}
    with pytest.raises(ValueError, match="per-layer-type rope parameters"):
        RotaryEmbedding.from_hf_config(cfg)
