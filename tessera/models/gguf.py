"""Load a GGUF file (llama.cpp's format) as a runnable :class:`~tessera.models.model.Model`.

The header is parsed by :mod:`tessera.models.gguf_reader` and the tensor data stays memory-mapped: only what must
be float is de-quantized (:mod:`tessera.models.gguf_dequant`), and F32 tensors loaded as float32 are views of the
mapped file. Its metadata becomes a Hugging Face-style config dict that the family module turns into a
:class:`ModelConfig`, so a GGUF model and the same model's safetensors directory share every line after the reader.
Tensors are renamed to the Hugging Face checkpoint names the family's :class:`WeightSpec` list asks for and assembled
the same way (q|k|v and gate|up fused).

Two things differ from a safetensors checkpoint:

* llama.cpp's converter interleaves the two rotary halves of every Q and K head (llama.cpp rotates adjacent pairs,
  Hugging Face rotates the halves); :func:`unpermute_rows` restores the order for the architectures it applies to.
* Projections are usually quantized. By default those in Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K stay
  packed as :class:`QuantizedWeight` (held exactly; the un-permutation moves whole rows, so it is exact too) and the
  others are de-quantized to the requested dtype; ``keep_quantized`` chooses otherwise.

>>> model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", torch.float32)
>>> model.tokenizer.encode("Hello world").ids
[19556, 905]
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessera.kernels.quant import QuantizedWeight, from_gguf
from tessera.models.config import ModelConfig
from tessera.models.families import all_families
from tessera.models.families.common import Family, WeightSpec
from tessera.models.ggml_types import GGMLType
from tessera.models.gguf_dequant import dequantize
from tessera.models.gguf_reader import GGUFFile, GGUFFormatError, TensorInfo, read_gguf
from tessera.models.gguf_tokenizer import UnsupportedTokenizer, build_tokenizer_quietly
from tessera.models.hf import CheckpointError, check_shapes
from tessera.models.model import Model

_T = GGMLType
_FLOAT_TYPES = (_T.F32, _T.F16, _T.BF16)
# what from_gguf holds without changing a value: Q4_0/Q4_1/Q8_0 split into codes and scales, the others as whole blocks
_PACKABLE = (_T.Q4_0, _T.Q4_1, _T.Q8_0, _T.Q5_0, _T.Q5_1, _T.Q4_K, _T.Q5_K, _T.Q6_K)
_STORED_AS = {_T.F32: torch.float32, _T.F16: torch.float16, _T.BF16: torch.bfloat16}


@dataclass(frozen=True)
class GGUFArch:
    """How one ``general.architecture`` maps onto a Tessera family."""

    family: str
    permuted_qk: bool  # llama.cpp's converter interleaved the rotary halves of Q and K rows


#: ``general.architecture`` -> rule; Mistral files say "llama" too (they run as Llama when no window is set)
ARCHITECTURES = {"llama": GGUFArch("llama", permuted_qk=True),
                 "qwen2": GGUFArch("qwen2", permuted_qk=False),
                 "qwen3": GGUFArch("qwen3", permuted_qk=False)}

# Hugging Face module path -> GGUF tensor name, per layer ("blk.{i}.<name>") and global
_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# The embedding table and 1-D tensors stay float: lookups and norms read floats. A packable output table also goes to
# the lm_head packed (see _add_packed_output).
_ALWAYS_FLOAT = ("model.embed_tokens.weight", "lm_head.weight")


def load_gguf(path: str | Path, torch_dtype: torch.dtype = torch.float32, backend: str = "auto", *,
              keep_quantized: bool | None = None, timings: dict[str, float] | None = None) -> Model:
    """Read a GGUF file: config, weights under canonical names, tokenizer and chat template.

    Parameters
    ----------
    path : str or Path
        A ``.gguf`` file whose ``general.architecture`` is one of :data:`ARCHITECTURES`.
    torch_dtype : torch.dtype
        float32, bfloat16 or float16: the dtype float weights are dequantized / cast to.
    backend : str
        Kernel backend the returned model runs on ("auto", "cpu", "reference", "triton").
    keep_quantized : bool or None
        Whether the 2-D projections (``qkv``, ``o``, ``gate_up``, ``down``) stay packed as :class:`QuantizedWeight`
        (exact for Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K; float-typed projections stay float). None (the default, as llama.cpp runs a
        file): every projection whose type can stay packed does, the others are dequantized. True: every quantized
        projection must stay packed, any other type raises. False: all are dequantized to ``torch_dtype`` (the
        weights transformers computes with). The embedding table and norms are always dequantized; unless False, an
        output table (the embedding, when tied) in one of those types is also kept packed for the lm_head. Parts
        fused into one weight (q|k|v, gate|up) stay packed only when they share a type: a Q4_K_M file's q|k|v in
        the layers whose v is Q6_K is de-quantized.
    timings : dict, optional
        Filled with the seconds each step took: ``header`` (metadata and tensor index), ``weights`` and
        ``tokenizer`` (these two run at the same time).

    Returns
    -------
    Model
        ``tokenizer`` is a ``tokenizers.Tokenizer`` for byte-level BPE files (None with a warning otherwise);
        ``chat_template`` is ``tokenizer.chat_template`` when present.

    Raises
    ------
    FileNotFoundError, CheckpointError
        Missing file, not a GGUF file or a malformed header (the message names the field), unsupported
        architecture / quantization type, missing or misshapen tensor.
    """
    steps: dict[str, float] = {}
    start = time.perf_counter()
    reader = open_reader(path)
    meta = read_metadata(reader)
    tensors = reader.tensor_index
    steps["header"] = time.perf_counter() - start
    arch, family, config = config_from_gguf(meta, tensors, path)
    # The tokenizer builds on a thread while the weights are gathered: tokenizers works in Rust and numpy copies
    # without the GIL, so the two overlap (SmolLM2: ~0.1 s each).
    with ThreadPoolExecutor(1, thread_name_prefix="gguf-tokenizer") as pool:
        building = pool.submit(_timed, steps, "tokenizer", _tokenizer, meta)
        weights = _timed(steps, "weights", load_weights, tensors, config, family, arch, torch_dtype, keep_quantized)
        tokenizer, notes = building.result()
    # the file's pages that were read to build copies (fused q|k|v and gate|up, un-permuted rows, de-quantized
    # tensors) would otherwise stay resident beside the copies: a second model's worth for a packed file
    reader.release_pages()
    for note in notes:  # warned here, on the caller's thread, and only once the weights loaded
        warnings.warn(f"{path}: {note}", stacklevel=2)
    if timings is not None:
        timings.update(steps)
    return Model(config, weights, tokenizer, meta.get("tokenizer.chat_template"), backend)


def _timed(steps: dict[str, float], name: str, fn: Callable[..., Any], *args: Any) -> Any:
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        steps[name] = time.perf_counter() - start


def open_reader(path: str | Path) -> GGUFFile:
    """The file's parsed header and memory-mapped tensor index (:func:`~tessera.models.gguf_reader.read_gguf`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_gguf: {path} does not exist (or is not a file); pass the path of a .gguf file")
    try:
        return read_gguf(path)
    except GGUFFormatError as err:
        hint = " Pass a .gguf file, or a Hugging Face directory to load_model" if "not a GGUF file" in str(err) else ""
        raise CheckpointError(f"{err}.{hint}" if hint else str(err)) from err


def read_metadata(reader: GGUFFile) -> dict[str, Any]:
    """GGUF key -> Python value (str, int, float, bool or list), every key of the file."""
    return reader.metadata


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, TensorInfo], path: str | Path = "<gguf>"
                     ) -> tuple[GGUFArch, Family, ModelConfig]:
    """The file's architecture rule, family and :class:`ModelConfig` (via an HF-style config dict)."""
    name = meta.get("general.architecture")
    if name not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {name!r} is not supported; supported: "
                              f"{sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[name]
    family = all_families()[arch.family]
    if meta.get(f"{name}.expert_count"):
        raise CheckpointError(f"{path}: mixture-of-experts GGUF files ({name}.expert_count = "
                              f"{meta[f'{name}.expert_count']}) are not supported yet; load the Hugging Face "
                              "checkpoint instead")
    if "rope_freqs.weight" in tensors:
        raise CheckpointError(f"{path} has a rope_freqs tensor (Llama 3.1-style per-frequency RoPE factors), which "
                              "the GGUF loader does not read yet; load the Hugging Face checkpoint instead")
    return arch, family, family.config_from_hf(hf_config(meta, tensors, name, arch.family, path))


def hf_config(meta: dict[str, Any], tensors: dict[str, TensorInfo], arch: str, model_type: str,
              path: str | Path = "<gguf>") -> dict[str, Any]:
    """The Hugging Face ``config.json`` keys the families read, from ``{arch}.*`` and ``tokenizer.ggml.*`` keys."""
    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if required and value is None:
            raise CheckpointError(f"{path}: GGUF metadata key {arch}.{key!r} is missing; the file is incomplete")
        if isinstance(value, list):
            raise CheckpointError(f"{path}: {arch}.{key} is a per-layer list {value[:4]}...; Tessera needs one "
                                  "value for every layer")
        return value

    hidden, heads = get("embedding_length", required=True), get("attention.head_count", required=True)
    head_dim = get("attention.key_length", hidden // heads)
    rope_dim = get("rope.dimension_count", head_dim)
    embed = tensors.get("token_embd.weight")  # its rows are the model's vocabulary (ne = [hidden, vocab])
    vocab = get("vocab_size") or (int(embed.ne[-1]) if embed is not None else None) or len(
        meta.get("tokenizer.ggml.tokens", ()))
    hf = {
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length", required=True),
        "num_hidden_layers": get("block_count", required=True),
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
    linear = get("rope.scale_linear")  # the key older converters wrote for linear scaling
    scaling = rope_scaling(get("rope.scaling.type", "linear" if linear else None),
                           get("rope.scaling.factor", linear), path)
    if scaling:
        hf["rope_scaling"] = scaling
    return hf


def rope_scaling(kind: str | None, factor: float | None, path: str | Path = "<gguf>") -> dict[str, Any] | None:
    """HF ``rope_scaling`` for GGUF's ``rope.scaling.type``: none or linear (others change more than the factor)."""
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise CheckpointError(f"{path}: GGUF rope.scaling.type {kind!r} is not supported; supported: ['none', 'linear']")


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name of a Hugging Face checkpoint name (``model.layers.3.mlp.up_proj.weight`` ->
    ``blk.3.ffn_up.weight``)."""
    match = _HF_LAYER.match(hf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"blk.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    module, _, suffix = hf_name.rpartition(".")
    if module in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[module]}.{suffix}"
    raise CheckpointError(f"no GGUF name is known for checkpoint tensor {hf_name!r}; the GGUF loader maps "
                          f"{sorted(_LAYER_NAMES)} per layer and {sorted(_GLOBAL_NAMES)}")


def unpermute_rows(num_heads: int, head_dim: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: ``ours = file[index]``, int64 ``[num_heads * head_dim]``.

    Within each head llama.cpp stores row ``2 j + half`` what Hugging Face keeps at row ``half * head_dim / 2 + j``.
    """
    j = torch.arange(head_dim // 2)
    within = torch.cat([2 * j, 2 * j + 1])
    return (torch.arange(num_heads)[:, None] * head_dim + within).reshape(-1)


def load_weights(tensors: dict[str, TensorInfo], config: ModelConfig, family: Family, arch: GGUFArch,
                 dtype: torch.dtype, keep_quantized: bool | None = None) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Canonical weights from the file's tensors, by the family's :class:`WeightSpec` list (``keep_quantized`` as
    in :func:`load_gguf`)."""
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for spec in family.weight_specs(config):
        names = [gguf_name(s) for s in spec.sources]
        missing = [n for n in names if n not in tensors]
        if missing and spec.optional:
            continue
        if missing:
            raise CheckpointError(f"GGUF tensor {missing[0]!r} is missing (needed for {spec.name!r} by the "
                                  f"{family.name} family); the file is incomplete or of another architecture")
        packed = keep_quantized is not False and len(tensors[names[0]].shape) == 2 \
            and spec.sources[0] not in _ALWAYS_FLOAT
        if spec.name == "lm_head" and keep_quantized is not False:
            packed = tensors[names[0]].tensor_type in _PACKABLE  # an untied output table may stay packed
        if packed and keep_quantized is None:  # auto: pack only what can stay packed, parts fused in one format
            types = {tensors[n].tensor_type for n in names}
            packed = len(types) == 1 and types <= set(_PACKABLE)
        parts = [tensors[n] for n in names]
        weights[spec.name] = (_read_packed(spec, parts, config, arch) if packed and _any_quantized(parts) else
                              _assemble(spec, [_read_float(t, hf, config, arch, dtype)
                                               for t, hf in zip(parts, spec.sources)]))
    if keep_quantized is not False and "lm_head" not in weights:
        _add_packed_output(tensors, config, arch, weights)
    check_shapes(config, weights)
    return weights


def _add_packed_output(tensors: dict[str, TensorInfo], config: ModelConfig, arch: GGUFArch,
                       weights: dict[str, torch.Tensor | QuantizedWeight]) -> None:
    """A tied output table (the embedding) in a packable type also goes to the lm_head packed, as llama.cpp runs it:
    the logits GEMV then reads the file's bytes (SmolLM2's Q8_0 table: 30 MB) instead of the de-quantized float table
    (113 MB in fp32), the largest read of a small model's decode step. The float table stays for token lookups."""
    name = gguf_name("model.embed_tokens.weight")
    t = tensors.get(name)
    if t is None or t.tensor_type not in _PACKABLE:
        return
    weights["lm_head"] = _packed_rows(t, "lm_head.weight", config, arch)


def _expected_shape(hf_name: str, config: ModelConfig) -> tuple[int, ...] | None:
    """The shape the config implies for a checkpoint tensor (``(N, K)`` for a projection; None when unknown)."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    kind = hf_name.rsplit(".", 2)[-2]
    shapes = {"input_layernorm": (h,), "post_attention_layernorm": (h,), "norm": (h,), "q_norm": (d,), "k_norm": (d,),
              "q_proj": (config.num_heads * d, h), "k_proj": (config.num_kv_heads * d, h),
              "v_proj": (config.num_kv_heads * d, h), "o_proj": (h, config.num_heads * d), "gate_proj": (i, h),
              "up_proj": (i, h), "down_proj": (h, i), "embed_tokens": (config.vocab_size, h),
              "lm_head": (config.vocab_size, h)}
    want = shapes.get(kind)
    return want if want is None or hf_name.endswith(".weight") else want[:1]


def _any_quantized(parts: list[TensorInfo]) -> bool:
    return any(t.tensor_type not in _FLOAT_TYPES for t in parts)


def _check_shape(t: TensorInfo, hf_name: str, config: ModelConfig, arch: GGUFArch) -> None:
    want = _expected_shape(hf_name, config)
    if want is not None and t.shape != want:
        raise CheckpointError(f"GGUF tensor {t.name!r} has shape {t.shape} (ne = {list(t.ne)}), but the "
                              f"metadata implies {want}; the file's tensors and its {arch.family} metadata disagree")


def _read_float(t: TensorInfo, hf_name: str, config: ModelConfig, arch: GGUFArch,
                dtype: torch.dtype) -> torch.Tensor:
    """One file tensor in ``dtype``, shape-checked and un-permuted when needed."""
    _check_shape(t, hf_name, config, arch)
    out = _float(t, dtype)
    rows = _permutation(hf_name, config, arch)
    return out if rows is None else out.index_select(0, rows)


def _read_packed(spec: WeightSpec, parts: list[TensorInfo], config: ModelConfig,
                 arch: GGUFArch) -> QuantizedWeight:
    """The spec's tensors as one :class:`QuantizedWeight`: their block rows (un-permuted, stacked along N) are
    gathered from the mapped file in one copy, then split into codes, scales and mins by ``from_gguf``."""
    for t in parts:
        if t.tensor_type not in _PACKABLE and t.tensor_type not in _FLOAT_TYPES:
            raise CheckpointError(f"GGUF tensor {t.name!r} is {t.tensor_type.name}, which keep_quantized cannot hold "
                                  f"exactly (supported: {[q.name for q in _PACKABLE]}); load with "
                                  "keep_quantized=False to dequantize it")
    types = [t.tensor_type.name for t in parts]
    if len(set(types)) != 1:
        raise CheckpointError(f"{spec.name}: keep_quantized needs {list(spec.sources)} in one format to fuse them, "
                              f"got {types}; load with keep_quantized=False to dequantize")
    if len(parts) == 1:
        return _packed_rows(parts[0], spec.sources[0], config, arch)
    rows = [_block_rows(t, hf, config, arch) for t, hf in zip(parts, spec.sources)]
    shape = (sum(r.shape[0] for r in rows), parts[0].shape[1])
    return from_gguf(np.concatenate(rows), parts[0].tensor_type, shape)


def _packed_rows(t: TensorInfo, hf_name: str, config: ModelConfig, arch: GGUFArch) -> QuantizedWeight:
    return from_gguf(_block_rows(t, hf_name, config, arch), t.tensor_type, t.shape)


def _block_rows(t: TensorInfo, hf_name: str, config: ModelConfig, arch: GGUFArch) -> np.ndarray:
    """The tensor's rows of quantized blocks (uint8 ``[N, bytes per row]``), un-permuted when needed: a view of the
    mapped file, or a copy in our order. A row is whole blocks along K, so moving rows is exact. numpy, not torch:
    these are small copies, and torch would run each as a parallel region that waits on a busy core."""
    _check_shape(t, hf_name, config, arch)
    rows = _permutation(hf_name, config, arch)
    return t.data if rows is None else np.take(t.data, rows.numpy(), axis=0)


def _float(t: TensorInfo, dtype: torch.dtype) -> torch.Tensor:
    """The tensor in ``dtype``: a view of the mapped file when it is stored in that dtype, else de-quantized."""
    if _STORED_AS.get(t.tensor_type) == dtype:
        # the reader's views are copy-on-write pages: the weight shares the page cache until something writes to it
        return torch.from_numpy(t.data).view(dtype).reshape(t.shape)
    try:
        values = dequantize(t.data, t.tensor_type, t.shape)
    except NotImplementedError as err:
        raise CheckpointError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which cannot be dequantized "
                              f"({err}); re-quantize the model to a supported type (F16, Q8_0, Q4_K, ...)") from err
    return values.to(dtype)


def _permutation(hf_name: str, config: ModelConfig, arch: GGUFArch) -> torch.Tensor | None:
    if not arch.permuted_qk:
        return None
    if ".self_attn.q_proj." in hf_name:
        return unpermute_rows(config.num_heads, config.head_dim)
    if ".self_attn.k_proj." in hf_name:
        return unpermute_rows(config.num_kv_heads, config.head_dim)
    return None


def _assemble(spec: WeightSpec, parts: list[torch.Tensor]) -> torch.Tensor:
    if spec.combine == "one":
        return parts[0].contiguous()
    if spec.combine != "cat":
        raise CheckpointError(f"{spec.name}: combine rule {spec.combine!r} is not supported for GGUF files")
    return torch.cat(parts, dim=0)


def _tokenizer(meta: dict[str, Any]) -> tuple[Any, list[str]]:
    """The file's tokenizer (None when it cannot be rebuilt) and what to warn about."""
    try:
        return build_tokenizer_quietly(meta)
    except UnsupportedTokenizer as err:
        return None, [f"no tokenizer ({err})"]
