"""Qwen2: the Llama layer with biases on the q/k/v projections."""

from tessera.models.families.common import Family, base_config, llama_weight_specs


def _config(hf: dict):
    layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    first_windowed = hf.get("max_window_layers", layers)
    windows = tuple(window if i >= first_windowed else None for i in range(layers))
    return base_config(hf, "qwen2", qkv_bias=True, layer_windows=windows)


FAMILY = Family("qwen2", ("qwen2",), _config, lambda cfg: llama_weight_specs(cfg, qkv_bias=True))
