"""Qwen2-MoE (Qwen1.5-MoE): the Qwen2 layer (q/k/v biases) with a sparse MoE block plus a sigmoid-gated shared expert.

Routing is softmax over all experts, then top-k, renormalized only when ``norm_topk_prob`` is set. Layers listed in
``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, run a dense SwiGLU MLP of ``intermediate_size``
instead (``ModelConfig.dense_layers``).
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


def dense_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    step = hf.get("decoder_sparse_step", 1)
    if step < 1:
        raise ValueError(f"Qwen2-MoE config: decoder_sparse_step must be >= 1, got {step}")
    only = set(hf.get("mlp_only_layers") or ())
    return tuple(i for i in range(hf["num_hidden_layers"]) if i in only or (i + 1) % step)


def sliding_windows(hf: dict[str, Any]) -> tuple[int | None, ...]:
    layers = hf["num_hidden_layers"]
    if not hf.get("use_sliding_window"):
        return (None,) * layers
    window = hf["sliding_window"]
    # transformers 5 writes layer_types; without it, its default rule (odd-numbered layers below max_window_layers)
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 and i < hf.get("max_window_layers", layers)
                                      else "full_attention" for i in range(layers)]
    return tuple(window if t == "sliding_attention" else None for t in types)


def _config(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"Qwen2-MoE hidden_act {hf['hidden_act']!r} is not supported: the MoE kernel "
                                  "runs SwiGLU experts only")
    return base_config(hf, "qwen2_moe", qkv_bias=bool(hf.get("qkv_bias", True)), layer_windows=sliding_windows(hf),
                       num_experts=hf["num_experts"], experts_per_token=hf["num_experts_per_tok"],
                       moe_intermediate_size=hf["moe_intermediate_size"], moe_routing="softmax_topk",
                       moe_renormalize=bool(hf.get("norm_topk_prob", False)),
                       shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
                       dense_layers=dense_layers(hf))


def _moe_specs(config: ModelConfig, i: int) -> list[WeightSpec]:
    mlp = f"model.layers.{i}.mlp"
    experts = [f"{mlp}.experts.{e}" for e in range(config.num_experts)]
    specs = [WeightSpec(f"layers.{i}.router.weight", (f"{mlp}.gate.weight",)),
             WeightSpec(f"layers.{i}.experts.gate_up",
                        tuple(f"{x}.{w}.weight" for x in experts for w in ("gate_proj", "up_proj")), "stack_pairs"),
             WeightSpec(f"layers.{i}.experts.down", tuple(f"{x}.down_proj.weight" for x in experts), "stack")]
    if config.shared_expert_intermediate_size:
        s = f"{mlp}.shared_expert"
        specs += [WeightSpec(f"layers.{i}.shared.gate_up.weight", (f"{s}.gate_proj.weight", f"{s}.up_proj.weight"),
                             "cat"),
                  WeightSpec(f"layers.{i}.shared.down.weight", (f"{s}.down_proj.weight",)),
                  # the sigmoid gate is a [1, H] linear; the kernel's SharedExpert takes its row as [H]
                  WeightSpec(f"layers.{i}.shared.gate.weight", (f"{mlp}.shared_expert_gate.weight",), "flatten")]
    return specs


def _weight_specs(config: ModelConfig) -> list[WeightSpec]:
    specs = llama_weight_specs(config, qkv_bias=config.qkv_bias)  # attention and norms only (the config is MoE)
    for i in range(config.num_layers):
        if config.is_moe_layer(i):
            specs += _moe_specs(config, i)
        else:
            mlp = f"model.layers.{i}.mlp"
            specs += [WeightSpec(f"layers.{i}.gate_up.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"),
                                 "cat"),
                      WeightSpec(f"layers.{i}.down.weight", (f"{mlp}.down_proj.weight",))]
    return specs


FAMILY = Family("qwen2_moe", ("qwen2_moe",), _config, _weight_specs)
