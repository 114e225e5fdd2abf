"""Mixtral: the Mistral layer with a sparse MoE block (top-k experts, softmax over the chosen logits).

Checkpoints (hub ones, and transformers 5's ``save_pretrained``) keep one tensor per expert
(``block_sparse_moe.experts.e.w1/w3/w2``: gate, up, down); they are stacked on load into the fused
``experts.gate_up [E, 2I, H]`` and ``experts.down [E, H, I]`` that :func:`tessera.kernels.moe_mlp` reads.
"""

from __future__ import annotations

from typing import Any

from tessera.models.config import ModelConfig
from tessera.models.families.common import (
    Family,
    WeightSpec,
    base_config,
    llama_weight_specs,
)


def _config(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"Mixtral hidden_act {hf['hidden_act']!r} is not supported: the MoE kernel "
                                  "runs SwiGLU experts only")
    window = hf.get("sliding_window")
    return base_config(hf, "mixtral", layer_windows=(window,) * hf["num_hidden_layers"],
                       num_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
                       moe_intermediate_size=hf["intermediate_size"], moe_routing="topk_softmax")


def _weight_specs(config: ModelConfig) -> list[WeightSpec]:
    specs = llama_weight_specs(config)  # attention and norms; no dense MLP since the config is MoE
    for i in range(config.num_layers):
        moe = f"model.layers.{i}.block_sparse_moe"
        experts = [f"{moe}.experts.{e}" for e in range(config.num_experts)]
        specs += [WeightSpec(f"layers.{i}.router.weight", (f"{moe}.gate.weight",)),
                  WeightSpec(f"layers.{i}.experts.gate_up",
                             tuple(f"{x}.{w}.weight" for x in experts for w in ("w1", "w3")), "stack_pairs"),
                  WeightSpec(f"layers.{i}.experts.down", tuple(f"{x}.w2.weight" for x in experts), "stack")]
    return specs


FAMILY = Family("mixtral", ("mixtral",), _config, _weight_specs)
