"""GPT-2: learned absolute positions, LayerNorm with bias, a plain GELU MLP, biases everywhere, tied lm_head.

Its checkpoints store Conv1D weights as ``[in, out]``; they are transposed on load into the ``nn.Linear`` layout the
shared layers read. ``c_attn`` is already the fused q|k|v projection.
"""

from __future__ import annotations

from typing import Any

from tessera.models.config import ModelConfig
from tessera.models.families.common import Family, WeightSpec

#: HF ``activation_function`` -> the shared layers' plain-MLP activation
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}


def _config(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise NotImplementedError("GPT-2 config sets scale_attn_by_inverse_layer_idx=True (per-layer attention "
                                  "scale 1/(layer+1)); the shared decoder has one scale for all layers")
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise NotImplementedError(f"GPT-2 activation_function {act!r} is not supported; supported: "
                                  f"{sorted(_ACTIVATIONS)}")
    hidden, heads = hf["n_embd"], hf["n_head"]
    if hidden % heads:
        raise ValueError(f"GPT-2 config: n_embd {hidden} is not a multiple of n_head {heads}")
    head_dim = hidden // heads
    return ModelConfig(
        family="gpt2", vocab_size=hf["vocab_size"], hidden_size=hidden,
        intermediate_size=hf.get("n_inner") or 4 * hidden, num_layers=hf["n_layer"], num_heads=heads,
        num_kv_heads=heads, head_dim=head_dim, max_position=hf.get("n_positions", 1024),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), norm="layer", activation=_ACTIVATIONS[act], gated_mlp=False,
        qkv_bias=True, o_bias=True, mlp_bias=True, learned_positions=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        # scale_attn_weights=False means raw dot products (scale 1), not the 1/sqrt(D) default
        query_scale=None if hf.get("scale_attn_weights", True) else 1.0,
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=_ids(hf.get("eos_token_id")),
    )


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _norm(name: str, source: str) -> list[WeightSpec]:
    return [WeightSpec(f"{name}.weight", (f"{source}.weight",)), WeightSpec(f"{name}.bias", (f"{source}.bias",))]


def _conv1d(name: str, source: str) -> list[WeightSpec]:
    """A Conv1D ``[in, out]`` weight transposed to ``[out, in]``, and its bias."""
    return [WeightSpec(f"{name}.weight", (f"{source}.weight",), "transpose"),
            WeightSpec(f"{name}.bias", (f"{source}.bias",))]


def _weight_specs(config: ModelConfig) -> list[WeightSpec]:
    specs = [WeightSpec("embed", ("transformer.wte.weight",)), WeightSpec("pos_embed", ("transformer.wpe.weight",)),
             *_norm("final_norm", "transformer.ln_f")]
    if not config.tie_embeddings:
        specs.append(WeightSpec("lm_head", ("lm_head.weight",)))
    for i in range(config.num_layers):
        p, h = f"layers.{i}", f"transformer.h.{i}"
        specs += [*_norm(f"{p}.attn_norm", f"{h}.ln_1"), *_conv1d(f"{p}.qkv", f"{h}.attn.c_attn"),
                  *_conv1d(f"{p}.o", f"{h}.attn.c_proj"), *_norm(f"{p}.mlp_norm", f"{h}.ln_2"),
                  # the plain MLP's first projection (fc) lives under the gate_up name the shared layers read
                  *_conv1d(f"{p}.gate_up", f"{h}.mlp.c_fc"), *_conv1d(f"{p}.down", f"{h}.mlp.c_proj")]
    return specs


FAMILY = Family("gpt2", ("gpt2",), _config, _weight_specs)
