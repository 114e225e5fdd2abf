"""What the families share: the Family record, reading common config keys, and the Llama-style weight names.

Canonical weight names (what ``layers.py`` reads), per layer ``i``:

==============================  ==============================================================================
``embed``, ``pos_embed``        token embeddings ``[V, H]``; learned positions ``[P, H]`` (GPT-2)
``layers.i.attn_norm.*``        norm before attention (``weight``, LayerNorm also ``bias``)
``layers.i.qkv.weight/bias``    fused projection ``[(Hq + 2 Hkv) D, H]``: q rows, then k, then v
``layers.i.q_norm/k_norm.weight``  per-head norms ``[D]`` (Qwen3, Gemma 3)
``layers.i.o.weight/bias``      output projection ``[H, Hq D]``
``layers.i.post_attn_norm.weight``  Gemma 2/3: norm of the attention output before the residual add
``layers.i.mlp_norm.*``         norm before the MLP
``layers.i.gate_up.weight/bias``  fused gate|up ``[2 I, H]`` (GPT-2: the plain ``fc`` ``[I, H]``)
``layers.i.down.weight/bias``   ``[H, I]``
``layers.i.post_mlp_norm.weight``  Gemma 2/3
``layers.i.router.weight``      MoE router ``[E, H]``
``layers.i.experts.gate_up``    ``[E, 2 I, H]``; ``layers.i.experts.down`` ``[E, H, I]``
``layers.i.shared.*``           shared expert ``gate_up.weight``, ``down.weight``, ``gate.weight`` ``[H]``
``final_norm.*``, ``lm_head``   final norm; output projection ``[V, H]`` (absent when tied to ``embed``)
==============================  ==============================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tessera.models.config import ModelConfig

#: how a canonical tensor is assembled from checkpoint tensors: concatenated rows, stacked experts, or transposed
Source = tuple[str, ...]


@dataclass(frozen=True)
class WeightSpec:
    """One canonical tensor: the checkpoint tensors it comes from and how they combine."""

    name: str
    sources: Source
    # "one", "cat" (rows), "stack" (experts), "transpose" (GPT-2 Conv1D), "stack_pairs" (experts' gate|up from
    # (gate_0, up_0, gate_1, up_1, ...)), "flatten" ([1, H] -> [H])
    combine: str = "one"
    optional: bool = False


@dataclass(frozen=True)
class Family:
    """A model family: how to read its Hugging Face config and which checkpoint tensor feeds which weight."""

    name: str
    hf_model_types: tuple[str, ...]
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    weight_specs: Callable[[ModelConfig], list[WeightSpec]]


def hf_get(hf: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` present in an HF config dict (families rename the same thing)."""
    for key in keys:
        if key in hf and hf[key] is not None:
            return hf[key]
    return default


def rope_dict(hf: dict[str, Any], head_dim: int, theta_key: str = "rope_theta", theta: float | None = None) -> dict:
    """An HF-style rope config for :meth:`RotaryEmbedding.from_hf_config` (transformers 4.x and 5.x keys)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    out = {key: hf[key] for key in ("max_position_embeddings", "partial_rotary_factor", "original_max_position_embeddings")
           if key in hf}
    out["head_dim"] = head_dim
    base = theta if theta is not None else hf_get(hf, theta_key, default=params.get("rope_theta", 10000.0))
    params["rope_theta"] = base
    params.setdefault("rope_type", params.pop("type", "default"))
    out["rope_parameters"] = params
    out["rope_theta"] = base
    return out


def base_config(hf: dict[str, Any], family: str, **overrides: Any) -> ModelConfig:
    """The keys every Llama-like config.json has, plus family overrides."""
    heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    head_dim = hf_get(hf, "head_dim", default=hidden // heads)
    fields: dict[str, Any] = dict(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf_get(hf, "intermediate_size", default=4 * hidden),
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf_get(hf, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        max_position=hf_get(hf, "max_position_embeddings", default=2048),
        norm_eps=hf_get(hf, "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", default=1e-6),
        tie_embeddings=bool(hf_get(hf, "tie_word_embeddings", default=False)),
        rope_configs={"default": rope_dict(hf, head_dim)},
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(_as_list(hf.get("eos_token_id"))),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def llama_weight_specs(config: ModelConfig, *, qkv_bias: bool = False, qk_norm: bool = False,
                       post_norms: bool = False) -> list[WeightSpec]:
    """Checkpoint names of the Llama layout (``model.layers.i.self_attn.q_proj`` ...), shared by most families."""
    specs = [WeightSpec("embed", ("model.embed_tokens.weight",)), WeightSpec("final_norm.weight", ("model.norm.weight",))]
    if not config.tie_embeddings:
        specs.append(WeightSpec("lm_head", ("lm_head.weight",)))
    for i in range(config.num_layers):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        specs += [
            WeightSpec(f"layers.{i}.attn_norm.weight", (f"{p}.input_layernorm.weight",)),
            WeightSpec(f"layers.{i}.qkv.weight", (f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"),
                       "cat"),
            WeightSpec(f"layers.{i}.o.weight", (f"{a}.o_proj.weight",)),
        ]
        if qkv_bias:
            specs.append(WeightSpec(f"layers.{i}.qkv.bias", (f"{a}.q_proj.bias", f"{a}.k_proj.bias",
                                                             f"{a}.v_proj.bias"), "cat"))
        if qk_norm:
            specs += [WeightSpec(f"layers.{i}.q_norm.weight", (f"{a}.q_norm.weight",)),
                      WeightSpec(f"layers.{i}.k_norm.weight", (f"{a}.k_norm.weight",))]
        if post_norms:  # Gemma 2/3 names: post_attention_layernorm is the *post* norm here
            specs += [WeightSpec(f"layers.{i}.post_attn_norm.weight", (f"{p}.post_attention_layernorm.weight",)),
                      WeightSpec(f"layers.{i}.mlp_norm.weight", (f"{p}.pre_feedforward_layernorm.weight",)),
                      WeightSpec(f"layers.{i}.post_mlp_norm.weight", (f"{p}.post_feedforward_layernorm.weight",))]
        else:
            specs.append(WeightSpec(f"layers.{i}.mlp_norm.weight", (f"{p}.post_attention_layernorm.weight",)))
        if not config.is_moe:
            specs += [WeightSpec(f"layers.{i}.gate_up.weight", (f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"),
                                 "cat"),
                      WeightSpec(f"layers.{i}.down.weight", (f"{p}.mlp.down_proj.weight",))]
    return specs
