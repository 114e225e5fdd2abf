"""Gemma 2: Gemma with post norms, alternating local (sliding-window) / global layers and tanh soft-capping of the
attention scores and of the final logits; queries scaled by ``query_pre_attn_scalar ** -0.5``."""

from __future__ import annotations

from typing import Any

from tessera.models.config import ModelConfig
from tessera.models.families.common import Family, base_config, hf_get, llama_weight_specs
from tessera.models.families.gemma import activation, layer_types, layer_windows, reject_bidirectional


def _config(hf: dict[str, Any]) -> ModelConfig:
    reject_bidirectional(hf, "gemma2")
    bias = bool(hf.get("attention_bias", False))
    types = layer_types(hf, "gemma2", sliding_every=2)  # before layer_types existed: even layers local
    return base_config(
        hf, "gemma2", norm="rms_gemma", activation=activation(hf, "gemma2"), embed_scale=True, post_norms=True,
        qkv_bias=bias, o_bias=bias, tie_embeddings=bool(hf_get(hf, "tie_word_embeddings", default=True)),
        query_scale=float(hf_get(hf, "query_pre_attn_scalar", default=256)) ** -0.5,
        attn_softcap=hf.get("attn_logit_softcapping"), final_softcap=hf.get("final_logit_softcapping"),
        layer_windows=layer_windows(hf, types, "gemma2"),
    )


FAMILY = Family("gemma2", ("gemma2",), _config,
                lambda cfg: llama_weight_specs(cfg, qkv_bias=cfg.qkv_bias, post_norms=True))
