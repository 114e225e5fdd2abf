"""Mistral: the Llama layer with a sliding-window causal mask on every layer (when the config sets one)."""

from tessera.models.families.common import Family, base_config, llama_weight_specs


def _config(hf: dict):
    window = hf.get("sliding_window")
    layers = hf["num_hidden_layers"]
    return base_config(hf, "mistral", layer_windows=(window,) * layers)


FAMILY = Family("mistral", ("mistral",), _config, lambda cfg: llama_weight_specs(cfg))
