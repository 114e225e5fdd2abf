"""Llama 1/2/3 (and SmolLM2): RMSNorm, SwiGLU, RoPE with any HF scaling rule, GQA."""

from tessera.models.families.common import Family, base_config, llama_weight_specs

FAMILY = Family(
    name="llama",
    hf_model_types=("llama",),
    config_from_hf=lambda hf: base_config(hf, "llama", qkv_bias=bool(hf.get("attention_bias", False)),
                                          o_bias=bool(hf.get("attention_bias", False)),
                                          mlp_bias=bool(hf.get("mlp_bias", False))),
    weight_specs=lambda cfg: llama_weight_specs(cfg, qkv_bias=cfg.qkv_bias),
)
