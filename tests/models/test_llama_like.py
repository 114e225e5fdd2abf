"""Llama, Mistral, Qwen2 and Qwen3 against transformers on tiny random checkpoints; loader errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
    Qwen3ForCausalLM,
)

from tessera.models import CheckpointError, load_model
from tests.models.helpers import check_family, save_tiny

SMALL = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("rope", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                                  {"rope_type": "linear", "factor": 2.0}], ids=["plain", "llama3", "linear"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama(tmp_path, rope, tied):
    kwargs = dict(SMALL, tie_word_embeddings=tied)
    if rope is not None:
        kwargs["rope_parameters"] = dict(rope, rope_theta=10000.0)
    check_family(LlamaForCausalLM, LlamaConfig(**kwargs), tmp_path)


def test_mistral_sliding_window(tmp_path):
    check_family(MistralForCausalLM, MistralConfig(**SMALL, sliding_window=8), tmp_path)  # 32 tokens > window


def test_qwen2_qkv_bias(tmp_path):
    check_family(Qwen2ForCausalLM, Qwen2Config(**SMALL), tmp_path)


def test_qwen3_qk_norm(tmp_path):
    check_family(Qwen3ForCausalLM, Qwen3Config(**SMALL, head_dim=16), tmp_path)


# ---- errors ------------------------------------------------------------------------------------------------------

def _tiny_llama(tmp_path):
    save_tiny(LlamaForCausalLM, LlamaConfig(**SMALL), tmp_path)
    return tmp_path


def test_missing_path_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **SMALL}))
    with pytest.raises(CheckpointError, match="pickle checkpoints"):
        load_model(tmp_path)


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "rwkv"}))
    with pytest.raises(ValueError, match=r"unknown architecture \(model_type 'rwkv'\); supported: .*llama"):
        load_model(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    d = _tiny_llama(tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.1.self_attn.k_proj.weight' is missing"):
        load_model(d)


def test_wrong_shape_names_both(tmp_path):
    d = _tiny_llama(tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.randn(64, 95)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'layers.0.down.weight' has shape \(64, 95\).*implies \(64, 96\)"):
        load_model(d)


def test_bad_token_ids(tmp_path):
    model = load_model(_tiny_llama(tmp_path))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 211\)"):
        model.logits(torch.tensor([[0, 211]]))
    with pytest.raises(TypeError, match="integer tensor"):
        model.logits(torch.zeros(1, 3))


def test_sharded_checkpoint(tmp_path):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, SMALL["vocab_size"], (1, 9))
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(load_model(tmp_path).logits(ids), ref, rtol=1e-4, atol=1e-5)
