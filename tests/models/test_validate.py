"""`tessera validate`: the per-layer table, the logits verdict and the exit status."""

from __future__ import annotations

import pytest
from transformers import Qwen3Config, Qwen3ForCausalLM

from tessera.cli import main
from tessera.tools import validate as V
from tests.models.helpers import save_tiny

CONFIG = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16)


def test_validate_prints_every_layer_and_passes(tmp_path, capsys):
    save_tiny(Qwen3ForCausalLM, Qwen3Config(**CONFIG), tmp_path)
    assert main(["validate", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("embeddings", "layer 0", "layer 1", "last layer + final norm", "logits", "KL", "PASS"):
        assert name in out


def test_validate_fails_past_tolerance(tmp_path, monkeypatch, capsys):
    save_tiny(Qwen3ForCausalLM, Qwen3Config(**CONFIG), tmp_path)
    monkeypatch.setitem(V.TOLERANCES, "float32", (0.0, 0.0, 1.0))  # nothing but bit-exact passes
    assert main(["validate", "--model", str(tmp_path)]) == 1
    assert "FAIL" in capsys.readouterr().out


# One tiny checkpoint per family: `tessera validate` must print its table and pass for each (the family tests check
# the numbers in more configurations; this checks the tool end to end on every architecture).
_ATTN = dict(vocab_size=211, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_ATTN, intermediate_size=96, num_hidden_layers=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_ATTN, intermediate_size=96, num_hidden_layers=2,
                                                              sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_ATTN, intermediate_size=96, num_hidden_layers=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_ATTN, intermediate_size=96, num_hidden_layers=2, head_dim=16)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_ATTN, intermediate_size=96, num_hidden_layers=2, head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_ATTN, intermediate_size=96, num_hidden_layers=2, head_dim=16,
                                                         sliding_window=8, query_pre_attn_scalar=16)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_ATTN, intermediate_size=96, num_hidden_layers=2,
                                                             head_dim=16, sliding_window=8, query_pre_attn_scalar=16)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=211, n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_ATTN, intermediate_size=96, num_hidden_layers=2, pad_token_id=0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_ATTN, intermediate_size=48, num_hidden_layers=2,
                                                            num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(_ATTN, intermediate_size=96, num_hidden_layers=2,
                                                                moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                                num_experts=4, num_experts_per_tok=2)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_validate_every_family(family, tmp_path):
    import transformers

    config_cls, model_cls, kwargs = FAMILIES[family]
    save_tiny(getattr(transformers, model_cls), getattr(transformers, config_cls)(**kwargs), tmp_path)
    report = V.validate(tmp_path, seq=24)
    assert report["ok"], report
    assert len(report["rows"]) == 4  # embeddings, layer 0, layer 1 + final norm, logits


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "phi3"])
def test_validate_on_the_mlir_backend(family, tmp_path):
    """Every op of these families' forward, attention included, compiled through MLIR and IREE (docs/mlir.md)."""
    import transformers

    from tessera.backends import registered

    reasons = registered()["mlir"].available()
    if reasons:
        pytest.skip("; ".join(reasons))
    config_cls, model_cls, kwargs = FAMILIES[family]
    save_tiny(getattr(transformers, model_cls), getattr(transformers, config_cls)(**kwargs), tmp_path)
    report = V.validate(tmp_path, seq=24, backend="mlir")
    assert report["ok"], report
