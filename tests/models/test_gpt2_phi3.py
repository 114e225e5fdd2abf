"""GPT-2 and Phi-3 bring-up: tiny random checkpoints written by transformers, loaded by Tessera, logits compared.

float32: max|ours - ref| / max|ref| <= 1e-4 against transformers in float32. bfloat16: our error against that float32
reference is at most twice transformers' own bfloat16 error, and top-1 agrees with transformers in bfloat16 on >= 99% of
the 2x32 positions whose float32 top-2 gap is above transformers' bf16 noise (random tiny models have near ties:
transformers' own bf16 top-1 matches its float32 top-1 on only ~97-98% of all positions), >= 90% on all of them.
"""

from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers")

from tessera.models import load_model
from tests.models.helpers import compare_with_hf_bf16
from tessera.models.families import by_model_type

VOCAB, SEQ, BATCH = 101, 32, 2


def _save(tmp_path_factory, name: str, model_cls, config) -> tuple[str, torch.nn.Module]:
    torch.manual_seed(0)
    model = model_cls(config).eval()
    directory = tmp_path_factory.mktemp(name)
    model.save_pretrained(directory)
    return str(directory), model


def _compare(directory: str, hf_model: torch.nn.Module, dtype: str, seq: int = SEQ) -> None:
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(1))
    compare_with_hf_bf16(directory, hf_model, dtype, ids)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     initializer_range=0.15, bos_token_id=0, eos_token_id=0)
    return _save(tmp_path_factory, "gpt2", transformers.GPT2LMHeadModel, config)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    # partial rotary (half of each head) and a sliding window shorter than the sequence
    config = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     partial_rotary_factor=0.5, sliding_window=8, initializer_range=0.15,
                                     pad_token_id=0, bos_token_id=0, eos_token_id=1)
    return _save(tmp_path_factory, "phi3", transformers.Phi3ForCausalLM, config)


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory):
    half = 16 // 2  # head_dim 16, full rotary
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [1.0 + 0.7 * i for i in range(half)]}
    config = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                     original_max_position_embeddings=16, rope_parameters=rope,
                                     initializer_range=0.15, pad_token_id=0, bos_token_id=0, eos_token_id=1)
    return _save(tmp_path_factory, "phi3_longrope", transformers.Phi3ForCausalLM, config)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt2_matches_transformers(gpt2, dtype):
    _compare(*gpt2, dtype)


def test_gpt2_config_is_read(gpt2):
    config = load_model(gpt2[0]).config
    assert (config.norm, config.gated_mlp, config.activation, config.learned_positions) == ("layer", False,
                                                                                            "gelu_tanh", True)
    assert config.tie_embeddings and config.qkv_bias and config.o_bias and config.mlp_bias


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_phi3_partial_rope_sliding_window_matches_transformers(phi3, dtype):
    assert load_model(phi3[0]).config.layer_windows == (8, 8)
    _compare(*phi3, dtype)


@pytest.mark.parametrize("seq", [12, SEQ])  # 12 <= original 16: short factors; 32 > 16: long factors
def test_phi3_longrope_matches_transformers(phi3_longrope, seq):
    _compare(*phi3_longrope, "float32", seq=seq)


def test_gpt2_unsupported_options_raise():
    base = {"n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": VOCAB}
    with pytest.raises(NotImplementedError, match="scale_attn_by_inverse_layer_idx"):
        by_model_type("gpt2").config_from_hf({**base, "scale_attn_by_inverse_layer_idx": True})
    with pytest.raises(NotImplementedError, match="activation_function 'relu'"):
        by_model_type("gpt2").config_from_hf({**base, "activation_function": "relu"})
