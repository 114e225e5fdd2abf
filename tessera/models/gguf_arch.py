"""What a GGUF file's ``general.architecture`` means: the Tessera family it runs as, and its metadata as a Hugging
Face ``config.json`` dict that the family reads.

llama.cpp's converter writes one ``{arch}.*`` key set per architecture and leaves out what its C++ code hard-codes
(Gemma 3's local RoPE base, Gemma's query scale, Qwen2-MoE's routing); :func:`hf_config` puts those rules back, so
a GGUF file and the checkpoint it came from build the same :class:`~tessera.models.config.ModelConfig`. The rules
follow llama.cpp's model loader (``src/models/<arch>.cpp``) at the version ``benchmarks/peers`` builds.

Metadata arrays with one entry per layer are accepted when every layer has the same value; a file whose layers
differ gets a :class:`CheckpointError` that names the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tessera.models.config import ModelConfig
from tessera.models.families import all_families
from tessera.models.families.common import Family
from tessera.models.gguf_reader import TensorInfo
from tessera.models.hf import CheckpointError


@dataclass(frozen=True)
class GGUFArch:
    """How one ``general.architecture`` maps onto a Tessera family."""

    family: str
    #: llama.cpp's converter interleaved the rotary halves of Q and K rows (architectures it runs with "normal" RoPE)
    permuted_qk: bool = False
    #: the file's norm weights are Gemma's ``1 + w`` (the converter adds the 1): run them as plain RMSNorm weights
    norm_plus_one: bool = False
    #: ``attn_qkv`` holds q|k|v and ``ffn_up`` holds gate|up ``[2 I, H]``, with no ``ffn_gate`` (Phi-3)
    fused_projections: bool = False
    #: the family when ``{arch}.expert_count`` is set (Mixtral files say "llama")
    moe_family: str | None = None


#: ``general.architecture`` -> rule; Mistral files say "llama" too (they run as Llama when no window is set)
ARCHITECTURES = {
    "llama": GGUFArch("llama", permuted_qk=True, moe_family="mixtral"),
    "qwen2": GGUFArch("qwen2"),
    "qwen3": GGUFArch("qwen3"),
    "qwen2moe": GGUFArch("qwen2_moe"),
    "qwen3moe": GGUFArch("qwen3_moe"),
    "gemma": GGUFArch("gemma", norm_plus_one=True),
    "gemma2": GGUFArch("gemma2", norm_plus_one=True),
    "gemma3": GGUFArch("gemma3", norm_plus_one=True),
    "phi3": GGUFArch("phi3", fused_projections=True),
}

# llama.cpp's defaults for keys its converter may leave out (llama-hparams.h, src/models/gemma*.cpp)
_GEMMA2_WINDOW, _GEMMA2_ATTN_CAP, _GEMMA2_FINAL_CAP = 4096, 50.0, 30.0
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # every n-th layer global, the others sliding
_LOCAL_ROPE_BASE = 10000.0  # Gemma 3's sliding layers when the file has no rope.freq_base_swa
LAYERS_27B = {"gemma2": 46, "gemma3": 62}  # the 27B models scale queries by (hidden / heads) ** -0.5


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, TensorInfo], path: str | Path = "<gguf>"
                     ) -> tuple[GGUFArch, Family, ModelConfig]:
    """The file's architecture rule, family and :class:`ModelConfig` (via an HF-style config dict)."""
    name = meta.get("general.architecture")
    if name not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {name!r} is not supported; supported: "
                              f"{sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[name]
    experts = _scalar(meta, f"{name}.expert_count", path)
    family_name = arch.family
    if experts and not arch.family.endswith("_moe"):
        if arch.moe_family is None:
            raise CheckpointError(f"{path}: {name} files with {name}.expert_count = {experts} are not supported; "
                                  f"the {name} architecture has no mixture-of-experts family here")
        family_name = arch.moe_family
    family = all_families()[family_name]
    hf = hf_config(meta, tensors, name, family_name, path)  # raises CheckpointError naming the key itself
    try:
        config = family.config_from_hf(hf)
    except (KeyError, ValueError, NotImplementedError) as err:
        raise CheckpointError(f"{path}: the {name} metadata does not describe a model Tessera can run: {err}") from err
    if arch.norm_plus_one:
        config = dataclasses.replace(config, norm="rms")
    return arch, family, config


def _scalar(meta: dict[str, Any], key: str, path: str | Path, default: Any = None) -> Any:
    """``meta[key]``; a per-layer array is accepted when all its entries are equal."""
    value = meta.get(key, default)
    if isinstance(value, list):
        if not value:
            return default
        if any(v != value[0] for v in value):
            raise CheckpointError(f"{path}: GGUF metadata key {key!r} differs per layer ({value[:8]}"
                                  f"{'...' if len(value) > 8 else ''}); Tessera runs layers of one shape only")
        return value[0]
    return value


def _getter(meta: dict[str, Any], arch: str, path: str | Path) -> Any:
    """``get(key, default=None, required=False)``: the value of ``{arch}.{key}`` (see :func:`_scalar`)."""
    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = _scalar(meta, f"{arch}.{key}", path, default)
        if required and value is None:
            raise CheckpointError(f"{path}: GGUF metadata key {arch}.{key!r} is missing; the file is incomplete")
        return value
    return get


def hf_config(meta: dict[str, Any], tensors: dict[str, TensorInfo], arch: str, model_type: str,
              path: str | Path = "<gguf>") -> dict[str, Any]:
    """The Hugging Face ``config.json`` keys the family ``model_type`` reads, from ``{arch}.*`` and
    ``tokenizer.ggml.*`` keys and the tensor index."""
    get = _getter(meta, arch, path)
    hidden, heads = get("embedding_length", required=True), get("attention.head_count", required=True)
    head_dim = get("attention.key_length", hidden // heads)
    rope_dim = get("rope.dimension_count", head_dim)
    embed = tensors.get("token_embd.weight")  # its rows are the model's vocabulary (ne = [hidden, vocab])
    vocab = get("vocab_size") or (int(embed.ne[-1]) if embed is not None else None) or len(
        meta.get("tokenizer.ggml.tokens", ()))
    layers = get("block_count", required=True)
    hf: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length", required=True),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if rope_dim != head_dim:
        hf["partial_rotary_factor"] = rope_dim / head_dim
    scaling = rope_scaling(meta, tensors, arch, rope_dim, path)
    if scaling:
        hf["rope_scaling"] = scaling
    extra = _FAMILY_KEYS.get(model_type)
    if extra is not None:
        extra(hf, meta, tensors, arch, path)
    return hf


def rope_scaling(meta: dict[str, Any], tensors: dict[str, TensorInfo], arch: str, rope_dim: int,
                 path: str | Path = "<gguf>") -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``{arch}.rope.scaling.*`` and the ``rope_freqs`` / ``rope_factors_*`` tensors.

    Supported: none, linear, yarn (without DeepSeek's log multiplier), ``rope_freqs`` (per-frequency divisors, how
    Llama 3.1+ files state the llama3 rule) and LongRoPE's factor tensors (Phi-3). Anything else raises, naming
    the key.
    """
    get = _getter(meta, f"{arch}.rope", path)
    linear = get("scale_linear")  # the key older converters wrote for linear scaling
    kind = get("scaling.type", "linear" if linear else None)
    factor = get("scaling.factor", linear)
    original = get("scaling.original_context_length")
    if "rope_freqs.weight" in tensors:
        if kind not in (None, "none"):
            raise CheckpointError(f"{path}: the file has both a rope_freqs tensor and {arch}.rope.scaling.type = "
                                  f"{kind!r}; llama.cpp applies both, Tessera supports one at a time")
        return {"rope_type": "freq_factors", "factors": _float_list(tensors["rope_freqs.weight"], rope_dim, path)}
    if "rope_factors_long.weight" in tensors:  # LongRoPE (Phi-3 128k): short below the original context
        if original is None:
            raise CheckpointError(f"{path}: LongRoPE factor tensors need {arch}.rope.scaling.original_context_length")
        out = {"rope_type": "longrope", "original_max_position_embeddings": int(original),
               "long_factor": _float_list(tensors["rope_factors_long.weight"], rope_dim, path),
               "short_factor": _float_list(tensors["rope_factors_short.weight"], rope_dim, path)}
        attention = get("scaling.attn_factor")
        if attention is not None:
            out["attention_factor"] = float(attention)
        return out
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        return _yarn(get, factor, original, arch, path)
    raise CheckpointError(f"{path}: GGUF {arch}.rope.scaling.type {kind!r} is not supported; supported: "
                          "['none', 'linear', 'yarn'], and rope_freqs / rope_factors_long tensors")


def _yarn(get: Any, factor: Any, original: Any, arch: str, path: str | Path) -> dict[str, Any]:
    if factor is None or original is None:
        raise CheckpointError(f"{path}: yarn RoPE needs {arch}.rope.scaling.factor and "
                              f"{arch}.rope.scaling.original_context_length")
    if get("scaling.yarn_log_multiplier", 0.0):
        raise CheckpointError(f"{path}: {arch}.rope.scaling.yarn_log_multiplier (DeepSeek's mscale) is not supported")
    if get("scaling.yarn_ext_factor") not in (None, -1.0, 1.0):
        raise CheckpointError(f"{path}: {arch}.rope.scaling.yarn_ext_factor = {get('scaling.yarn_ext_factor')} is "
                              "not supported (only the default 1)")
    out = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    for gguf_key, hf_key in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                             ("yarn_beta_slow", "beta_slow")):
        value = get(f"scaling.{gguf_key}")
        if value is not None:
            out[hf_key] = float(value)
    return out


def _float_list(t: TensorInfo, rope_dim: int, path: str | Path) -> list[float]:
    values = np.asarray(t.data, dtype=np.float64).reshape(-1)
    if values.size != rope_dim // 2:
        raise CheckpointError(f"{path}: tensor {t.name!r} has {values.size} entries; RoPE over {rope_dim} dims needs "
                              f"{rope_dim // 2}")
    return values.tolist()


# ---------------------------------------------------------------------------------------------- per family
def _gemma(hf: dict[str, Any], meta: dict[str, Any], tensors: dict[str, TensorInfo], arch: str,
           path: str | Path) -> None:
    get = _getter(meta, arch, path)
    hf["hidden_activation"] = "gelu_pytorch_tanh"  # every Gemma runs tanh-approximated GELU in llama.cpp
    scale = get("attention.scale")
    if scale:
        hf["query_pre_attn_scalar"] = 1.0 / float(scale) ** 2
    elif hf["num_hidden_layers"] == LAYERS_27B.get(arch):
        hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"]
    else:
        hf["query_pre_attn_scalar"] = hf["head_dim"]
    if arch == "gemma":
        return
    window = get("attention.sliding_window", _GEMMA2_WINDOW if arch == "gemma2" else None)
    if window:
        hf["sliding_window"] = int(window)
        key = f"{arch}.attention.sliding_window_pattern"
        hf["layer_types"] = _layer_types(meta.get(key), hf["num_hidden_layers"], SWA_PATTERN[arch], key, path)
    else:
        hf["layer_types"] = ["full_attention"] * hf["num_hidden_layers"]
    final_cap = get("final_logit_softcapping", _GEMMA2_FINAL_CAP if arch == "gemma2" else None)
    hf["final_logit_softcapping"] = float(final_cap) if final_cap else None
    if arch == "gemma2":
        attn_cap = get("attn_logit_softcapping", _GEMMA2_ATTN_CAP)
        hf["attn_logit_softcapping"] = float(attn_cap) if attn_cap else None  # 0: no cap
        local = get("rope.freq_base_swa")
        if local is not None and float(local) != float(hf["rope_theta"]):
            raise CheckpointError(f"{path}: gemma2.rope.freq_base_swa ({local}) differs from rope.freq_base; the "
                                  "gemma2 family runs one RoPE base")
        return
    full = {"rope_theta": hf["rope_theta"], **(hf.pop("rope_scaling", None) or {"rope_type": "default"})}
    local = {"rope_theta": float(get("rope.freq_base_swa", _LOCAL_ROPE_BASE)), "rope_type": "default"}
    hf["rope_parameters"] = {"full_attention": full, "sliding_attention": local}


def _layer_types(pattern: Any, layers: int, default_every: int, key: str, path: str | Path) -> list[str]:
    """llama.cpp's sliding-window layer pattern: ``attention.sliding_window_pattern`` is either n (layer ``il`` is
    sliding unless ``il % n == n - 1``; 0 = all sliding) or one bool per layer (true = sliding)."""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise CheckpointError(f"{path}: {key} lists {len(pattern)} layers; the model has {layers}")
        return ["sliding_attention" if bool(p) else "full_attention" for p in pattern]
    every = default_every if pattern is None else int(pattern)
    return ["sliding_attention" if s else "full_attention" for s in sliding_layers(every, layers)]


def sliding_layers(every: int, layers: int) -> list[bool]:
    """llama.cpp's ``set_swa_pattern(n)``: layer ``il`` is sliding unless ``il % n == n - 1`` (n = 0: all sliding)."""
    return [every == 0 or i % every < every - 1 for i in range(layers)]


def _phi3(hf: dict[str, Any], meta: dict[str, Any], tensors: dict[str, TensorInfo], arch: str,
          path: str | Path) -> None:
    get = _getter(meta, arch, path)
    window = get("attention.sliding_window")
    hf["sliding_window"] = int(window) if window else None  # 0: no window (Phi-4)
    original = get("rope.scaling.original_context_length")
    if original:
        hf["original_max_position_embeddings"] = int(original)


def _moe(hf: dict[str, Any], meta: dict[str, Any], tensors: dict[str, TensorInfo], arch: str,
         path: str | Path) -> None:
    get = _getter(meta, arch, path)
    experts, used = get("expert_count", required=True), get("expert_used_count", required=True)
    layers = hf["num_hidden_layers"]
    hf["num_experts_per_tok"] = used
    if hf["model_type"] == "mixtral":
        hf["num_local_experts"] = experts
        hf["intermediate_size"] = get("expert_feed_forward_length", hf["intermediate_size"])
        return
    hf["num_experts"] = experts
    hf["moe_intermediate_size"] = get("expert_feed_forward_length", required=True)
    # llama.cpp renormalizes the top-k weights for qwen3moe and not for qwen2moe, unless the file says
    hf["norm_topk_prob"] = bool(get("expert_weights_norm", hf["model_type"] == "qwen3_moe"))
    hf["mlp_only_layers"] = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if hf["model_type"] == "qwen2_moe":
        shared = get("expert_shared_feed_forward_length")
        if shared is None and "blk.0.ffn_up_shexp.weight" in tensors:
            shared = tensors["blk.0.ffn_up_shexp.weight"].shape[0]
        hf["shared_expert_intermediate_size"] = int(shared or 0)
        hf["qkv_bias"] = "blk.0.attn_q.bias" in tensors


_FAMILY_KEYS = {"gemma": _gemma, "gemma2": _gemma, "gemma3": _gemma, "phi3": _phi3, "mixtral": _moe,
                "qwen2_moe": _moe, "qwen3_moe": _moe}
