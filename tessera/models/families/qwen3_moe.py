"""Qwen3-MoE: the Qwen3 layer (per-head q/k RMSNorm, no q/k/v bias) with a sparse MoE block and no shared expert.

Routing is softmax over all experts, then top-k, renormalized when ``norm_topk_prob`` is set (every released
Qwen3-MoE sets it). Layers in ``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, run a dense SwiGLU MLP
of ``intermediate_size`` (:attr:`ModelConfig.dense_layers`), as in Qwen2-MoE.
"""

from __future__ import annotations

from typing import Any

from tessera.models.config import ModelConfig
from tessera.models.families.common import Family, WeightSpec, base_config, hf_get, llama_weight_specs
from tessera.models.families.qwen2_moe import dense_layers, sliding_windows


def _config(hf: dict[str, Any]) -> ModelConfig:
    # transformers 5 writes the expert count as num_local_experts, 4.x as num_experts
    if hf.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"Qwen3-MoE hidden_act {hf['hidden_act']!r} is not supported: the MoE kernel "
                                  "runs SwiGLU experts only")
    bias = bool(hf.get("attention_bias", False))
    return base_config(hf, "qwen3_moe", qk_norm=True, qkv_bias=bias, o_bias=bias, layer_windows=sliding_windows(hf),
                       num_experts=hf_get(hf, "num_experts", "num_local_experts"),
                       experts_per_token=hf["num_experts_per_tok"],
                       moe_intermediate_size=hf["moe_intermediate_size"], moe_routing="softmax_topk",
                       moe_renormalize=bool(hf.get("norm_topk_prob", False)), dense_layers=dense_layers(hf))


def _weight_specs(config: ModelConfig) -> list[WeightSpec]:
    specs = llama_weight_specs(config, qkv_bias=config.qkv_bias, qk_norm=True)  # attention and norms only
    for i in range(config.num_layers):
        mlp = f"model.layers.{i}.mlp"
        if config.is_moe_layer(i):
            experts = [f"{mlp}.experts.{e}" for e in range(config.num_experts)]
            specs += [WeightSpec(f"layers.{i}.router.weight", (f"{mlp}.gate.weight",)),
                      WeightSpec(f"layers.{i}.experts.gate_up",
                                 tuple(f"{x}.{w}.weight" for x in experts for w in ("gate_proj", "up_proj")),
                                 "stack_pairs"),
                      WeightSpec(f"layers.{i}.experts.down", tuple(f"{x}.down_proj.weight" for x in experts),
                                 "stack")]
        else:
            specs += [WeightSpec(f"layers.{i}.gate_up.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"),
                                 "cat"),
                      WeightSpec(f"layers.{i}.down.weight", (f"{mlp}.down_proj.weight",))]
    return specs


FAMILY = Family("qwen3_moe", ("qwen3_moe",), _config, _weight_specs)
