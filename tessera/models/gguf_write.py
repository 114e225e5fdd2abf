"""Write a model as a GGUF file the way llama.cpp's converter would: its architecture's metadata keys, its tensor
names, Q/K rows interleaved for adjacent-pair RoPE, Gemma norms stored as ``1 + w``, RoPE scaling as llama.cpp reads
it (a ``rope_freqs`` tensor for the llama3 rule, LongRoPE factor tensors, yarn keys).

It is the inverse of :mod:`tessera.models.gguf` over the same name table (:mod:`tessera.models.gguf_names`), so
``load_gguf(write_gguf(...))`` gives back the model, and llama.cpp or transformers' GGUF loader read the file as
they read a converted checkpoint. Projections, experts and the embedding can be written in one type (F16, BF16, Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1 through gguf-py; Q4_K, Q5_K, Q6_K through :mod:`tessera.kernels.ggml_quantize`); norms, the
router and 1-D tensors stay F32, as in llama.cpp's converter.

>>> model = load_model("SmolLM2-135M-Instruct/")                 # a Hugging Face directory
>>> write_gguf("smollm2-q8_0.gguf", model.config, model.weights, qtype="Q8_0")
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessera.kernels.ggml_quantize import quantize_rows
from tessera.kernels.quant import QuantizedWeight, dequantize
from tessera.kernels.rope_scaling import inv_freq_f64
from tessera.models.config import ModelConfig
from tessera.models.gguf_arch import ARCHITECTURES, LAYERS_27B, SWA_PATTERN, GGUFArch, sliding_layers
from tessera.models.gguf_names import gguf_sources

#: Tessera family -> the GGUF architecture name it is written as
FAMILY_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2_moe": "qwen2moe",
               "qwen3_moe": "qwen3moe", "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3"}
#: what ``qtype`` may name: gguf-py quantizes the 32-value types, :mod:`tessera.kernels.ggml_quantize` the K-quants
WRITABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M",
                  "Q5_K_M")
#: llama.cpp's "_M" mixes: the base type, and Q6_K for attn_v / ffn_down in the layers that get more bits and for the
#: output table (llama.cpp's llama_tensor_get_type rule for these presets)
MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
#: a tensor whose rows are not whole 256-value blocks falls back as llama.cpp's quantizer falls back
_K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_QUANTIZED_LAYER_WEIGHTS = ("qkv.weight", "o.weight", "gate_up.weight", "down.weight", "experts.gate_up",
                            "experts.down", "shared.gate_up.weight", "shared.down.weight")


def write_gguf(path: str | Path, config: ModelConfig, weights: Mapping[str, torch.Tensor | QuantizedWeight], *,
               qtype: str = "F32", tokenizer: Mapping[str, Any] | None = None, name: str = "") -> Path:
    """Write ``weights`` (canonical names, as a :class:`~tessera.models.model.Model` holds them) as a GGUF file.

    Parameters
    ----------
    path : str or Path
        The file to write (replaced if it exists).
    config : ModelConfig
        The model's config; its family must be one of :data:`FAMILY_ARCH`.
    weights : mapping of str to torch.Tensor or QuantizedWeight
        Canonical weights; packed ones are de-quantized first.
    qtype : str
        The type of the projection, expert and embedding tensors, one of :data:`WRITABLE_TYPES`; ``Q4_K_M`` and
        ``Q5_K_M`` are llama.cpp's mixes (:data:`MIXES`). A tensor whose rows
        are not whole 256-value blocks falls back from Q4_K / Q5_K / Q6_K to Q5_0 / Q5_1 / Q8_0 (llama.cpp's
        rule); one whose rows are not whole blocks of the type is written F32.
    tokenizer : mapping, optional
        ``tokenizer.ggml.*`` keys (and ``tokenizer.chat_template``) to copy into the file, e.g. from a GGUF file's
        metadata. Without them the file has no tokenizer.
    name : str
        ``general.name``.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    ValueError
        A family, RoPE rule or type the GGUF format (or this writer) cannot express, naming it.
    """
    import gguf  # the writer is gguf-py's: only this function needs it

    if qtype.upper() not in WRITABLE_TYPES:
        raise ValueError(f"write_gguf: qtype {qtype!r} is not writable; choose one of {list(WRITABLE_TYPES)}")
    arch_name = FAMILY_ARCH.get(config.family)
    if arch_name is None:
        raise ValueError(f"write_gguf: family {config.family!r} has no GGUF architecture here; supported: "
                         f"{sorted(FAMILY_ARCH)}")
    arch = ARCHITECTURES[arch_name]
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch_name)
    try:
        if name:
            writer.add_name(name)
        tokenizer = dict(tokenizer or {})
        extra = _metadata(writer, config, arch_name, ids_from_tokenizer=tokenizer)
        for key, value in tokenizer.items():
            _add_value(writer, key, value)
        base = MIXES.get(qtype.upper(), qtype.upper())
        for tensor_name, array in extra.items():
            writer.add_tensor(tensor_name, array)
        for canonical, weight in weights.items():
            if canonical == "lm_head" and config.tie_embeddings:
                continue  # the loader's packed copy of a tied table
            for tensor_name, array in _split(canonical, weight, config, arch):
                chosen = _mixed_type(qtype.upper(), tensor_name, config.num_layers) or base
                qt = gguf.GGMLQuantizationType[chosen] if _quantizable(canonical) else None
                _add_tensor(writer, gguf, tensor_name, array, qt)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


def _mixed_type(qtype: str, tensor_name: str, layers: int) -> str | None:
    """The type an ``_M`` mix gives ``tensor_name`` where it differs from the base type (None: the base)."""
    if qtype not in MIXES:
        return None
    if tensor_name == "output.weight":
        return "Q6_K"
    parts = tensor_name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down", "ffn_down_exps") and more_bits(int(parts[1]), layers):
        return "Q6_K"
    return None


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _quantizable(canonical: str) -> bool:
    if canonical in ("embed", "lm_head"):
        return True
    return canonical.startswith("layers.") and canonical.split(".", 2)[2] in _QUANTIZED_LAYER_WEIGHTS


def _add_tensor(writer: Any, gguf: Any, name: str, array: np.ndarray, qt: Any) -> None:
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qt is not None and qt.name in _K_FALLBACK and array.shape[-1] % 256:
        qt = gguf.GGMLQuantizationType[_K_FALLBACK[qt.name]]
    whole_blocks = qt is not None and array.shape[-1] % gguf.GGML_QUANT_SIZES[qt][0] == 0
    if qt is None or qt == gguf.GGMLQuantizationType.F32 or array.ndim < 2 or not whole_blocks:
        writer.add_tensor(name, array)
        return
    if qt.name in _K_FALLBACK:
        blocks = quantize_rows(array.reshape(-1, array.shape[-1]), qt.name.lower())
        writer.add_tensor(name, blocks.reshape(*array.shape[:-1], blocks.shape[-1]), raw_dtype=qt)
        return
    writer.add_tensor(name, gguf.quants.quantize(array, qt), raw_dtype=qt)


def _add_value(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value) if 0 <= value < 2 ** 32 else writer.add_int64(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    else:
        raise ValueError(f"write_gguf: metadata {key!r} has a value of type {type(value).__name__}, which GGUF "
                         "cannot store")


# ---------------------------------------------------------------------------------------------- tensors
def _split(canonical: str, weight: torch.Tensor | QuantizedWeight, config: ModelConfig,
           arch: GGUFArch) -> list[tuple[str, np.ndarray]]:
    """The GGUF tensors of one canonical weight, in the file's row order and norm convention."""
    w = dequantize(weight) if isinstance(weight, QuantizedWeight) else weight
    array = w.detach().to(torch.float32).cpu().numpy()
    if canonical.endswith("norm.weight") and config.norm == "rms_gemma":
        array = array + np.float32(1.0)  # llama.cpp runs Gemma's x * (1 + w) as a plain RMSNorm over 1 + w
    target = gguf_sources(canonical, arch)
    if len(target.names) == 1:
        return [(target.names[0], array)]
    sizes = _part_sizes(canonical, config)
    parts = np.split(array, np.cumsum(sizes)[:-1], axis=target.axis)
    if arch.permuted_qk and canonical.rsplit(".", 2)[-2] == "qkv":
        parts[0] = _interleave_halves(parts[0], config.num_heads)
        parts[1] = _interleave_halves(parts[1], config.num_kv_heads)
    return list(zip(target.names, parts))


def _part_sizes(canonical: str, config: ModelConfig) -> list[int]:
    suffix = canonical.split(".", 2)[2]
    if suffix.startswith("qkv."):
        d = config.head_dim
        return [config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d]
    size = {"gate_up.weight": config.intermediate_size, "experts.gate_up": config.moe_intermediate_size,
            "shared.gate_up.weight": config.shared_expert_intermediate_size}[suffix]
    return [size, size]


def _interleave_halves(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: within each head, the two rotary halves interleaved row by row (the inverse of
    :func:`tessera.models.gguf.unpermute_rows`)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


# ---------------------------------------------------------------------------------------------- metadata
def _metadata(writer: Any, config: ModelConfig, arch: str, ids_from_tokenizer: Mapping[str, Any]
              ) -> dict[str, np.ndarray]:
    """Write the ``{arch}.*`` keys; returns the extra tensors the RoPE rule needs (``rope_freqs``, LongRoPE)."""
    rope_name = "global" if "global" in config.rope_configs else "default"
    rope = config.rope_configs[rope_name]
    d = config.head_dim
    rotary = int(d * float(rope.get("partial_rotary_factor") or 1.0))
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(config.hidden_size)
    # Mixtral files state the experts' width as the feed-forward length (there is no dense MLP)
    writer.add_feed_forward_length(config.moe_intermediate_size if config.family == "mixtral" else
                                   config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(d)
    writer.add_value_length(d)
    writer.add_rope_dimension_count(rotary)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.norm_eps))
    writer.add_vocab_size(config.vocab_size)
    if config.bos_token_id is not None and "tokenizer.ggml.bos_token_id" not in ids_from_tokenizer:
        writer.add_bos_token_id(int(config.bos_token_id))
    if config.eos_token_ids and "tokenizer.ggml.eos_token_id" not in ids_from_tokenizer:
        writer.add_eos_token_id(int(config.eos_token_ids[0]))
    tensors = _rope(writer, rope, rotary, config, arch)
    if arch.startswith("gemma"):
        _gemma(writer, config, arch)
    elif arch == "phi3":
        windows = {w for w in config.layer_windows}
        if len(windows) != 1:
            raise ValueError(f"write_gguf: phi3 files hold one sliding window for all layers, got {sorted(windows)}")
        writer.add_sliding_window(int(windows.pop() or 0))
    elif any(config.layer_windows):
        raise ValueError(f"write_gguf: the {arch} architecture has no sliding-window layers in llama.cpp; this "
                         f"model has windows {config.layer_windows}")
    if config.is_moe:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.experts_per_token)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_weights_norm(bool(config.moe_renormalize))
        if config.shared_expert_intermediate_size:
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    return tensors


def _rope(writer: Any, rope: Mapping[str, Any], rotary: int, config: ModelConfig, arch: str) -> dict[str, np.ndarray]:
    params = dict(rope.get("rope_parameters") or {})
    kind = params.get("rope_type", "default")
    original = params.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    if kind == "default":
        return {}
    if kind == "linear":
        writer.add_rope_scaling_type(_scaling_type("LINEAR"))
        writer.add_rope_scaling_factor(float(params["factor"]))
        return {}
    if kind == "yarn":
        writer.add_rope_scaling_type(_scaling_type("YARN"))
        writer.add_rope_scaling_factor(float(params["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(original or config.max_position))
        for key, add in (("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if params.get(key) is not None:
                add(float(params[key]))
        return {}
    if kind in ("llama3", "freq_factors"):  # llama.cpp's converter bakes the rule into per-frequency divisors
        base = float(rope["rope_theta"])
        scaled, _ = inv_freq_f64(rotary, base, params, config.max_position)
        plain, _ = inv_freq_f64(rotary, base, {"rope_type": "default"}, config.max_position)
        return {"rope_freqs.weight": (plain / scaled).astype(np.float32)}
    if kind == "longrope" and arch == "phi3":
        writer.add_rope_scaling_type(_scaling_type("LONGROPE"))
        writer.add_rope_scaling_orig_ctx_len(int(original or config.max_position))
        if params.get("attention_factor") is not None:
            writer.add_rope_scaling_attn_factors(float(params["attention_factor"]))
        return {"rope_factors_long.weight": np.asarray(params["long_factor"], np.float32),
                "rope_factors_short.weight": np.asarray(params["short_factor"], np.float32)}
    raise ValueError(f"write_gguf: rope_type {kind!r} cannot be written for {arch} (supported: default, linear, yarn, "
                     "llama3 / freq_factors, and longrope for phi3)")


def _scaling_type(name: str) -> Any:
    import gguf

    return gguf.RopeScalingType[name]


def _gemma(writer: Any, config: ModelConfig, arch: str) -> None:
    implied = (config.hidden_size // config.num_heads if config.num_layers == LAYERS_27B.get(arch)
               else config.head_dim) ** -0.5
    scale = config.query_scale if config.query_scale is not None else config.head_dim ** -0.5
    if abs(scale - implied) > 1e-12 * implied:
        writer.add_float32(f"{arch}.attention.scale", float(scale))  # llama.cpp derives it from the model size
    if arch == "gemma":
        return
    if config.final_softcap:
        writer.add_final_logit_softcapping(float(config.final_softcap))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(float(config.attn_softcap or 0.0))
    windows = [w for w in config.layer_windows if w]
    if not windows:
        return
    if len(set(windows)) != 1:
        raise ValueError(f"write_gguf: {arch} files hold one sliding window, got {sorted(set(windows))}")
    writer.add_sliding_window(int(windows[0]))
    sliding = [w is not None for w in config.layer_windows]
    if sliding != sliding_layers(SWA_PATTERN[arch], config.num_layers):
        writer.add_array(f"{arch}.attention.sliding_window_pattern", sliding)
    if arch == "gemma3":
        writer.add_rope_freq_base_swa(float(config.rope_configs["local"]["rope_theta"]))
