"""Gemma (1): the Llama layer with GeGLU, ``x * (1 + w)`` RMSNorm, embeddings scaled by sqrt(hidden), tied head.

Also holds the config readers Gemma 2 and 3 share: the activation name and the per-layer sliding windows.
"""

from __future__ import annotations

from typing import Any

from tessera.models.config import ModelConfig
from tessera.models.families.common import Family, base_config, hf_get, llama_weight_specs

#: HF activation names -> ours; "gelu_new" / "gelu_fast" are the same tanh approximation written differently
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}

#: the layer types a Gemma config's ``layer_types`` may name
_SLIDING, _FULL = "sliding_attention", "full_attention"


def activation(hf: dict[str, Any], family: str, legacy_gelu_is_tanh: bool = False) -> str:
    """The gated MLP's activation from ``hidden_activation`` (Gemma 2/3) or ``hidden_act`` (Gemma 1).

    Gemma 1 configs on the Hub say ``"gelu"`` but were trained with the tanh approximation; transformers rewrites
    that value for Gemma 1 only (``legacy_gelu_is_tanh``), and so do we.
    """
    name = hf_get(hf, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh")
    if name == "gelu" and legacy_gelu_is_tanh:
        return "gelu_tanh"
    if name not in _ACTIVATIONS:
        raise ValueError(f"{family}: unsupported hidden activation {name!r}; expected one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def reject_bidirectional(hf: dict[str, Any], family: str) -> None:
    """Encoder-style Gemma configs (EmbeddingGemma) attend both ways; the shared decoder is causal only."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{family}: use_bidirectional_attention=True (an embedding model) is not supported; "
                         "Tessera runs causal decoders only")


def layer_types(hf: dict[str, Any], family: str, sliding_every: int) -> tuple[str, ...]:
    """Per layer, "sliding_attention" or "full_attention".

    ``layer_types`` when the config has it (transformers >= 4.53 writes it), else the older rule: every
    ``sliding_every``-th layer (1-based) is global, the others local (Gemma 2: 2; Gemma 3: ``sliding_window_pattern``,
    default 6).
    """
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        return tuple(_SLIDING if (i + 1) % sliding_every else _FULL for i in range(n))
    bad = sorted({t for t in types if t not in (_SLIDING, _FULL)})
    if len(types) != n or bad:
        raise ValueError(f"{family}: layer_types must list {n} entries of {_SLIDING!r} / {_FULL!r}, got "
                         f"{len(types)} entries{f' with unknown {bad}' if bad else ''}; fix config.json")
    return tuple(types)


def layer_windows(hf: dict[str, Any], types: tuple[str, ...], family: str) -> tuple[int | None, ...]:
    """The sliding window of each local layer (``None`` on global ones).

    transformers' local mask keeps ``q - window < kv <= q``: the window counts the current token, as does
    :func:`tessera.attention.sliding_window`, so the config value is used unchanged.
    """
    window = hf_get(hf, "sliding_window", "sliding_window_size")
    if window is None and _SLIDING in types:
        raise ValueError(f"{family}: layer_types has sliding layers but the config sets no sliding_window")
    return tuple(int(window) if t == _SLIDING else None for t in types)


def _config(hf: dict[str, Any]) -> ModelConfig:
    reject_bidirectional(hf, "gemma")
    bias = bool(hf.get("attention_bias", False))
    return base_config(hf, "gemma", norm="rms_gemma", activation=activation(hf, "gemma", legacy_gelu_is_tanh=True),
                       embed_scale=True, qkv_bias=bias, o_bias=bias,
                       tie_embeddings=bool(hf_get(hf, "tie_word_embeddings", default=True)))


FAMILY = Family("gemma", ("gemma",), _config, lambda cfg: llama_weight_specs(cfg, qkv_bias=cfg.qkv_bias))
