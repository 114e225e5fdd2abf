"""Gemma 3 (text): Gemma 2's layer without the attention soft-cap, plus per-head q/k norms (Gemma form) and two
RoPE tables: local layers use ``rope_local_base_freq`` unscaled, global layers ``rope_theta`` with the config's
scaling (e.g. linear x8 on the 4B+ models)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tessera.models.config import ModelConfig
from tessera.models.families.common import Family, base_config, hf_get, llama_weight_specs, rope_dict
from tessera.models.families.gemma import activation, layer_types, layer_windows, reject_bidirectional

#: transformers' defaults when a config names no base
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0


def _rope_params(hf: dict[str, Any]) -> tuple[dict, dict]:
    """(global, local) rope dicts from transformers-5 ``rope_parameters`` (keyed by layer type) or the older
    top-level ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` (scaling on global layers only)."""
    params = hf.get("rope_parameters") or {}
    if params and all(isinstance(v, Mapping) for v in params.values()):
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full, local = dict(params or hf.get("rope_scaling") or {}), {}
    full.setdefault("rope_theta", hf_get(hf, "rope_theta", default=_GLOBAL_THETA))
    local.setdefault("rope_theta", hf_get(hf, "rope_local_base_freq", default=_LOCAL_THETA))
    for p in (full, local):
        p.setdefault("rope_type", p.pop("type", "default"))
    return full, local


def _config(hf: dict[str, Any]) -> ModelConfig:
    reject_bidirectional(hf, "gemma3")
    bias = bool(hf.get("attention_bias", False))
    types = layer_types(hf, "gemma3", sliding_every=int(hf_get(hf, "sliding_window_pattern", default=6)))
    head_dim = hf_get(hf, "head_dim", default=hf["hidden_size"] // hf["num_attention_heads"])
    full, local = _rope_params(hf)
    # rope_dict reads the scaling from rope_parameters, falling back to rope_scaling: hide the legacy key
    ropes = {name: rope_dict({**hf, "rope_parameters": p, "rope_scaling": None}, head_dim, theta=p["rope_theta"])
             for name, p in (("global", full), ("local", local))}
    return base_config(
        hf, "gemma3", norm="rms_gemma", activation=activation(hf, "gemma3"), embed_scale=True, post_norms=True,
        qk_norm=True, qkv_bias=bias, o_bias=bias, tie_embeddings=bool(hf_get(hf, "tie_word_embeddings", default=True)),
        query_scale=float(hf_get(hf, "query_pre_attn_scalar", default=256)) ** -0.5,
        # transformers 5 keeps attn_logit_softcapping on the config but never passes it to attention: no score cap
        final_softcap=hf.get("final_logit_softcapping"),
        layer_windows=layer_windows(hf, types, "gemma3"),
        layer_rope=tuple("local" if t == "sliding_attention" else "global" for t in types), rope_configs=ropes,
    )


FAMILY = Family("gemma3", ("gemma3_text",), _config,
                lambda cfg: llama_weight_specs(cfg, qkv_bias=cfg.qkv_bias, qk_norm=True, post_norms=True))
