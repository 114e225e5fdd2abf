"""RoPE frequency rules: the inverse frequencies and attention factor of each Hugging Face ``rope_type``, in float64.

Same formulas as transformers' ``ROPE_INIT_FUNCTIONS`` (``modeling_rope_utils.py``) and the models' default rule,
evaluated in float64 (transformers evaluates them in float32). Every rule returns ``(inv_freq, attention_factor)``:
``inv_freq`` float64 ``[rotary_dim // 2]`` (``angle = position * inv_freq[i]``) and the factor that multiplies
both cos and sin (1 except for ``yarn`` and ``longrope``).

One rule is not Hugging Face's: ``freq_factors`` divides each frequency by a given factor, which is how a GGUF file's
``rope_freqs`` tensor states its scaling (llama.cpp's converter bakes the llama3 rule into it).

``params`` is the flat ``rope_parameters`` dict of a config (``rope_type`` plus that type's keys);
``max_position_embeddings`` is the config's value of that name, which several rules fall back on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "freq_factors")


def _base_inv_freq(rotary_dim: int, base: float) -> np.ndarray:
    """``base ** (-2i / rotary_dim)`` for ``i < rotary_dim // 2``: the unscaled RoPE frequencies."""
    return 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def _need(params: Mapping[str, Any], key: str) -> Any:
    if params.get(key) is None:
        raise ValueError(f"rope_type {params.get('rope_type')!r} needs {key!r} in its rope parameters; "
                         f"got keys {sorted(params)}. Add it to the rope_scaling / rope_parameters dict.")
    return params[key]


def _original_max(params: Mapping[str, Any], max_position_embeddings: int) -> int:
    # transformers fills the pretraining length from max_position_embeddings when the dict lacks it
    return int(params.get("original_max_position_embeddings") or max_position_embeddings)


def _linear(rotary_dim, base, params, max_position_embeddings, seq_len):
    # dividing the frequencies by `factor` is the same as dividing the positions by it
    return _base_inv_freq(rotary_dim, base) / float(_need(params, "factor")), 1.0


def _dynamic(rotary_dim, base, params, max_position_embeddings, seq_len):
    """NTK-aware base growth once the sequence passes max_position_embeddings (no change below it)."""
    factor = float(_need(params, "factor"))
    length = max(seq_len or max_position_embeddings, max_position_embeddings)
    grown = base * (factor * length / max_position_embeddings - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    return _base_inv_freq(rotary_dim, grown), 1.0


def _llama3(rotary_dim, base, params, max_position_embeddings, seq_len):
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a linear blend in 1/wavelength between."""
    inv_freq = _base_inv_freq(rotary_dim, base)
    factor = float(_need(params, "factor"))
    low, high = float(_need(params, "low_freq_factor")), float(_need(params, "high_freq_factor"))
    old_len = _original_max(params, max_position_embeddings)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, blended, out), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rotary_dim, base, params, max_position_embeddings, seq_len):
    """YaRN: interpolate (divide by ``factor``) the low frequencies, keep the high ones, ramp between the dims that
    make ``beta_slow`` and ``beta_fast`` turns over the original context; cos/sin scaled by ``attention_factor``."""
    old_len = _original_max(params, max_position_embeddings)
    factor = params.get("factor")
    factor = float(max_position_embeddings / old_len if factor is None else factor)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else _yarn_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def dim_of(turns: float) -> float:  # the dim index whose wavelength fits `turns` times in old_len
        return rotary_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolated = _base_inv_freq(rotary_dim, base)
    return extrapolated / factor * ramp + extrapolated * (1 - ramp), float(attention)


def _longrope(rotary_dim, base, params, max_position_embeddings, seq_len):
    """LongRoPE (Phi-3): per-frequency divisors, ``long_factor`` past the original context, ``short_factor`` below."""
    old_len = _original_max(params, max_position_embeddings)
    factor = params.get("factor")
    factor = float(max_position_embeddings / old_len if factor is None else factor)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    key = "long_factor" if seq_len and seq_len > old_len else "short_factor"
    ext = np.asarray(_need(params, key), dtype=np.float64)
    if ext.shape != (rotary_dim // 2,):
        raise ValueError(f"longrope {key} must have rotary_dim // 2 = {rotary_dim // 2} entries, got {ext.size}")
    return _base_inv_freq(rotary_dim, base) / ext, float(attention)


def _freq_factors(rotary_dim, base, params, max_position_embeddings, seq_len):
    """llama.cpp's ``rope_freqs`` tensor: one divisor per frequency, whatever rule produced it (GGUF files of Llama
    3.1+ carry the llama3 rule this way and no rope_scaling keys)."""
    factors = np.asarray(_need(params, "factors"), dtype=np.float64)
    if factors.shape != (rotary_dim // 2,):
        raise ValueError(f"freq_factors needs rotary_dim // 2 = {rotary_dim // 2} factors, got shape "
                         f"{factors.shape}")
    if not np.all(factors > 0):
        raise ValueError("freq_factors must all be > 0 (they divide the frequencies)")
    return _base_inv_freq(rotary_dim, base) / factors, 1.0


_RULES = {"default": lambda d, b, p, m, s: (_base_inv_freq(d, b), 1.0), "linear": _linear, "dynamic": _dynamic,
          "llama3": _llama3, "yarn": _yarn, "longrope": _longrope, "freq_factors": _freq_factors}


def inv_freq_f64(rotary_dim: int, base: float, params: Mapping[str, Any], max_position_embeddings: int,
                 seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies and attention factor of one rope_type.

    Parameters
    ----------
    rotary_dim : int
        Rotated dims per head (even).
    base : float
        ``rope_theta``.
    params : Mapping
        ``{"rope_type": ..., <that type's keys>}``; a legacy ``"type"`` key is read as ``rope_type``.
    max_position_embeddings : int
        The config's ``max_position_embeddings``.
    seq_len : int or None
        Current sequence length; only ``dynamic`` and ``longrope`` read it (``None``: as at model load).

    Returns
    -------
    (numpy.ndarray float64 ``[rotary_dim // 2]``, float)
    """
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _RULES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {list(ROPE_TYPES)}")
    return _RULES[rope_type](rotary_dim, float(base), params, int(max_position_embeddings), seq_len)
