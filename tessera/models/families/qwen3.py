"""Qwen3: the Llama layer with per-head RMSNorm on q and k before RoPE (no q/k/v biases)."""

from tessera.models.families.common import Family, base_config, llama_weight_specs


def _config(hf: dict):
    bias = bool(hf.get("attention_bias", False))
    return base_config(hf, "qwen3", qk_norm=True, qkv_bias=bias, o_bias=bias)


FAMILY = Family("qwen3", ("qwen3",), _config, lambda cfg: llama_weight_specs(cfg, qkv_bias=cfg.qkv_bias,
                                                                               qk_norm=True))
