"""Phi-3: the Llama layer with q|k|v and gate|up already fused in the checkpoint, RoPE that may be partial
(``partial_rotary_factor``) or LongRoPE-scaled (short/long factors), and a sliding window when the config sets one."""

from __future__ import annotations

from typing import Any

from tessera.models.config import ModelConfig
from tessera.models.families.common import Family, WeightSpec, base_config


def _config(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"Phi-3 hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    window = hf.get("sliding_window")
    return base_config(hf, "phi3", layer_windows=(window,) * hf["num_hidden_layers"])


def _weight_specs(config: ModelConfig) -> list[WeightSpec]:
    specs = [WeightSpec("embed", ("model.embed_tokens.weight",)), WeightSpec("final_norm.weight", ("model.norm.weight",))]
    if not config.tie_embeddings:
        specs.append(WeightSpec("lm_head", ("lm_head.weight",)))
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        specs += [WeightSpec(f"layers.{i}.attn_norm.weight", (f"{p}.input_layernorm.weight",)),
                  WeightSpec(f"layers.{i}.qkv.weight", (f"{p}.self_attn.qkv_proj.weight",)),
                  WeightSpec(f"layers.{i}.o.weight", (f"{p}.self_attn.o_proj.weight",)),
                  WeightSpec(f"layers.{i}.mlp_norm.weight", (f"{p}.post_attention_layernorm.weight",)),
                  WeightSpec(f"layers.{i}.gate_up.weight", (f"{p}.mlp.gate_up_proj.weight",)),
                  WeightSpec(f"layers.{i}.down.weight", (f"{p}.mlp.down_proj.weight",))]
    return specs


FAMILY = Family("phi3", ("phi3",), _config, _weight_specs)
