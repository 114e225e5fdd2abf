"""Load a GGUF file (llama.cpp's format) as a runnable :class:`~tessera.models.model.Model`.

The header is parsed by :mod:`tessera.models.gguf_reader` and the tensor data stays memory-mapped: only what must
be float is de-quantized (:mod:`tessera.models.gguf_dequant`), and F32 tensors loaded as float32 are views of the
mapped file. Its metadata becomes a Hugging Face-style config dict that the family module turns into a
:class:`ModelConfig` (:mod:`tessera.models.gguf_arch`), so a GGUF model and the same model's safetensors directory
share every line after the reader. Each canonical weight the family's :class:`WeightSpec` list names is gathered from
its GGUF tensors (:data:`tessera.models.gguf_names.LAYER_TENSORS`): q|k|v and gate|up fused, expert tensors stacked.

What differs from a safetensors checkpoint:

* llama.cpp's converter interleaves the two rotary halves of every Q and K head for the architectures llama.cpp
  runs with adjacent-pair RoPE (llama, Mixtral); :func:`unpermute_rows` restores Hugging Face's order.
* Gemma's norm weights are stored as ``1 + w``; the model runs them as plain RMSNorm weights, as llama.cpp does.
* Projections are usually quantized. By default those in Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K stay
  packed as :class:`QuantizedWeight` (held exactly; the un-permutation moves whole rows, so it is exact too) and the
  others are de-quantized to the requested dtype; ``keep_quantized`` chooses otherwise.

A ``transform`` hook sees each canonical weight whole, once, as soon as it is gathered, and only what it returns is
kept (a tensor-parallel rank cuts its shard there); the mapped pages read so far are then dropped layer by layer.
:func:`packed_group_size` says, from the tensor index and one row of data, which quantization group a weight will
load with, so a rank can plan its cut before anything is read.

>>> model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", torch.float32)
>>> model.tokenizer.encode("Hello world").ids
[19556, 905]
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessera.kernels.quant import QuantizedWeight, StackedWeight, from_gguf
from tessera.models.config import ModelConfig
from tessera.models.families.common import Family
from tessera.models.ggml_types import GGMLType
from tessera.models.gguf_arch import ARCHITECTURES, GGUFArch, config_from_gguf  # noqa: F401 - public here too
from tessera.models.gguf_dequant import dequantize
from tessera.models.gguf_names import assemble, expected_shape, gguf_sources
from tessera.models.gguf_reader import GGUFFile, GGUFFormatError, TensorInfo, read_gguf
from tessera.models.gguf_tokenizer import UnsupportedTokenizer, build_tokenizer_quietly
from tessera.models.hf import CheckpointError, WeightHook, check_shape, expected_shapes, layer_key
from tessera.models.model import Model

_T = GGMLType
_FLOAT_TYPES = (_T.F32, _T.F16, _T.BF16)
# what from_gguf holds without changing a value: Q4_0/Q4_1/Q8_0 split into codes and scales, the others as whole blocks
_PACKABLE = (_T.Q4_0, _T.Q4_1, _T.Q8_0, _T.Q5_0, _T.Q5_1, _T.Q4_K, _T.Q5_K, _T.Q6_K)
_STORED_AS = {_T.F32: torch.float32, _T.F16: torch.float16, _T.BF16: torch.bfloat16}


# 1-D tensors stay float. The token table stays packed when its type can (lookups de-quantize only their rows, as
# llama.cpp's get_rows does) and, tied, is the lm_head too (see _keep_packed). Of the layer weights only the
# dense projections below may stay packed: the MoE kernel, the router and the shared expert read floats.
_PACKED_LAYER_WEIGHTS = ("qkv.weight", "o.weight", "gate_up.weight", "down.weight")


def load_gguf(path: str | Path, torch_dtype: torch.dtype = torch.float32, backend: str = "auto", *,
              keep_quantized: bool | None = None, timings: dict[str, float] | None = None,
              transform: WeightHook | None = None) -> Model:
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
        (exact for Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K; float-typed projections stay float). None
        (the default, as llama.cpp runs a file): every projection whose type can stay packed does, the others are
        dequantized. True: every quantized projection must stay packed, any other type raises. False: all are
        dequantized to ``torch_dtype`` (the weights transformers computes with). Norms, experts, router and shared
        expert are always dequantized; unless False, the token table and an output table in one of those types stay
        packed (a tied model's lm_head is the packed token table). Parts fused into one weight (q|k|v, gate|up) in
        different types (a Q4_K_M file's Q4_K q and k with a Q6_K v) stay packed as a ``StackedWeight``.
    timings : dict, optional
        Filled with the seconds each step took: ``header`` (metadata and tensor index), ``weights`` and
        ``tokenizer`` (these two run at the same time).
    transform : callable, optional
        ``transform(name, weight)`` for each canonical weight, whole and shape-checked; its result is kept in place
        of the weight (:func:`load_weights`).

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
        # with a hook, each layer's pages are dropped once it is gathered, so the file never becomes resident whole
        release = reader.release_pages if transform is not None else None
        weights = _timed(steps, "weights", load_weights, tensors, config, family, arch, torch_dtype, keep_quantized,
                         transform, release)
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


def unpermute_rows(num_heads: int, head_dim: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: ``ours = file[index]``, int64 ``[num_heads * head_dim]``.

    Within each head llama.cpp stores row ``2 j + half`` what Hugging Face keeps at row ``half * head_dim / 2 + j``.
    """
    j = torch.arange(head_dim // 2)
    within = torch.cat([2 * j, 2 * j + 1])
    return (torch.arange(num_heads)[:, None] * head_dim + within).reshape(-1)


def load_weights(tensors: dict[str, TensorInfo], config: ModelConfig, family: Family, arch: GGUFArch,
                 dtype: torch.dtype, keep_quantized: bool | None = None, transform: WeightHook | None = None,
                 release: Callable[[], None] | None = None) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Canonical weights from the file's tensors, for the names the family's :class:`WeightSpec` list gives
    (``keep_quantized`` as in :func:`load_gguf`).

    ``transform(name, weight)``, when given, sees each weight whole and shape-checked, in the family's order, and
    its result is kept instead. ``release``, when given, runs whenever the next weight belongs to another layer
    than the last one (the reader's :meth:`~tessera.models.gguf_reader.GGUFFile.release_pages`: the pages read for
    earlier weights need not stay resident).
    """
    shapes = expected_shapes(config)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    group = None
    for spec in family.weight_specs(config):
        source = gguf_sources(spec.name, arch, tensors)
        missing = [n for n in source.names if n not in tensors]
        if missing and spec.optional:
            continue
        if missing:
            raise CheckpointError(f"GGUF tensor {missing[0]!r} is missing (needed for {spec.name!r} by the "
                                  f"{family.name} family); the file is incomplete or of another architecture")
        if release is not None and layer_key(spec.name) != group:
            group = layer_key(spec.name)
            release()
        parts = [tensors[n] for n in source.names]
        for t in parts:
            _check_shape(t, config, arch)
        if _keep_packed(spec.name, parts, keep_quantized):
            weight = _read_packed(spec.name, parts, config, arch)
        else:
            floats = [_read_float(t, spec.name, j, config, arch, dtype) for j, t in enumerate(parts)]
            weight = assemble(source, floats)
        check_shape(spec.name, weight, shapes)
        weights[spec.name] = weight if transform is None else transform(spec.name, weight)
        del weight  # with a hook, the whole weight goes here unless the hook kept it
    return weights


def packed_group_size(name: str, tensors: dict[str, TensorInfo], arch: GGUFArch,
                      keep_quantized: bool | None = None) -> int:
    """The quantization group canonical weight ``name`` will load with (1: float, or absent from the file), read
    from the tensor index and one row of each part, without loading the weight.

    One row goes through the same ``from_gguf`` as the whole weight, so the group is the loader's by construction;
    a weight fused from parts of several types (a ``StackedWeight``) has the largest of theirs, as
    :func:`tessera.distributed.slicing.group_size` reports. A part in a type ``keep_quantized=True`` cannot hold
    counts as 1 here: the load itself raises for it.
    """
    source = gguf_sources(name, arch, tensors)
    if any(n not in tensors for n in source.names):
        return 1
    parts = [tensors[n] for n in source.names]
    if not _keep_packed(name, parts, keep_quantized):
        return 1
    sizes = [from_gguf(t.data[:1], t.tensor_type, (1, t.shape[-1])).group_size
             for t in parts if t.tensor_type in _PACKABLE and t.data.ndim == 2]
    return max(sizes, default=1)


def _keep_packed(name: str, parts: list[TensorInfo], keep_quantized: bool | None) -> bool:
    """Whether canonical weight ``name`` stays packed. Only quantized projections and tables do, never with
    ``keep_quantized=False``. The tables (and, by default, the projections) only when every part's type can be held
    exactly; with ``keep_quantized=True`` a projection in another type goes on to raise in :func:`_read_packed`.
    A tied model's packed token table is its lm_head too (``layers`` falls back to ``embed``): the logits GEMV reads
    the file's bytes (SmolLM2's Q8_0 table: 30 MB, not 113 MB of float32), as llama.cpp runs it."""
    table = name in ("lm_head", "embed")
    projection = name.startswith("layers.") and name.split(".", 2)[2] in _PACKED_LAYER_WEIGHTS
    if keep_quantized is False or not (table or projection) or not _any_quantized(parts):
        return False
    every_type_fits = {t.tensor_type for t in parts} <= set(_PACKABLE)
    return every_type_fits if table or keep_quantized is None else True


def _any_quantized(parts: list[TensorInfo]) -> bool:
    return any(t.tensor_type not in _FLOAT_TYPES for t in parts)


def _check_shape(t: TensorInfo, config: ModelConfig, arch: GGUFArch) -> None:
    want = expected_shape(t.name, config, arch)
    if want is not None and t.shape != want:
        raise CheckpointError(f"GGUF tensor {t.name!r} has shape {t.shape} (ne = {list(t.ne)}), but the "
                              f"metadata implies {want}; the file's tensors and its {config.family} metadata disagree")


def _read_float(t: TensorInfo, name: str, part: int, config: ModelConfig, arch: GGUFArch,
                dtype: torch.dtype) -> torch.Tensor:
    """One file tensor in ``dtype``, un-permuted when needed."""
    out = _float(t, dtype)
    rows = _permutation(name, part, config, arch)
    return out if rows is None else out.index_select(0, rows)


def _read_packed(name: str, parts: list[TensorInfo], config: ModelConfig,
                 arch: GGUFArch) -> QuantizedWeight | StackedWeight:
    """The parts as one :class:`QuantizedWeight`: their block rows (un-permuted, stacked along N) are gathered from
    the mapped file in one copy, then split into codes, scales and mins by ``from_gguf``. Parts in different types
    (a Q4_K_M file's Q4_K q and k with a Q6_K v) become a :class:`StackedWeight` of one packed weight per run of
    parts sharing a type, so nothing is de-quantized."""
    for t in parts:
        if t.tensor_type not in _PACKABLE and t.tensor_type not in _FLOAT_TYPES:
            raise CheckpointError(f"GGUF tensor {t.name!r} is {t.tensor_type.name}, which keep_quantized cannot hold "
                                  f"exactly (supported: {[q.name for q in _PACKABLE]}); load with "
                                  "keep_quantized=False to dequantize it")
    types = [t.tensor_type for t in parts]
    if any(t in _FLOAT_TYPES for t in types):
        raise CheckpointError(f"{name}: keep_quantized cannot fuse float and packed parts "
                              f"({[f'{t.name} {q.name}' for t, q in zip(parts, types)]}); load with "
                              "keep_quantized=False to dequantize")
    rows = [_block_rows(t, name, j, config, arch) for j, t in enumerate(parts)]
    runs: list[tuple[GGMLType, list[np.ndarray]]] = []
    for qtype, block_rows in zip(types, rows):
        if runs and runs[-1][0] == qtype:
            runs[-1][1].append(block_rows)
        else:
            runs.append((qtype, [block_rows]))
    packed = []
    for qtype, pieces in runs:
        block_rows = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        packed.append(from_gguf(block_rows, qtype, (block_rows.shape[0], parts[0].shape[1])))
    return packed[0] if len(packed) == 1 else StackedWeight(tuple(packed))


def _block_rows(t: TensorInfo, name: str, part: int, config: ModelConfig, arch: GGUFArch) -> np.ndarray:
    """The tensor's rows of quantized blocks (uint8 ``[N, bytes per row]``), un-permuted when needed: a view of the
    mapped file, or a copy in our order. A row is whole blocks along K, so moving rows is exact. numpy, not torch:
    these are small copies, and torch would run each as a parallel region that waits on a busy core."""
    rows = _permutation(name, part, config, arch)
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


def _permutation(name: str, part: int, config: ModelConfig, arch: GGUFArch) -> torch.Tensor | None:
    """Rows that undo the converter's Q/K interleave for part ``part`` of canonical weight ``name``, or None."""
    if not arch.permuted_qk or name.rsplit(".", 2)[-2:] not in (["qkv", "weight"], ["qkv", "bias"]):
        return None
    if part == 0:
        return unpermute_rows(config.num_heads, config.head_dim)
    if part == 1:
        return unpermute_rows(config.num_kv_heads, config.head_dim)
    return None


def _tokenizer(meta: dict[str, Any]) -> tuple[Any, list[str]]:
    """The file's tokenizer (None when it cannot be rebuilt) and what to warn about."""
    try:
        return build_tokenizer_quietly(meta)
    except UnsupportedTokenizer as err:
        return None, [f"no tokenizer ({err})"]
