"""``load_model``: a checkpoint (GGUF file or Hugging Face directory) as a runnable :class:`Model`."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tessera.backends import resolve_device
from tessera.dtypes import BY_NAME
from tessera.models import hf
from tessera.models.gguf import load_gguf
from tessera.models.model import Model, default_model_path, to_device


def load_model(path: str | Path | None = None, dtype: str | torch.dtype = "float32", backend: str = "auto", *,
               keep_quantized: bool | None = None, device: str | torch.device | None = None,
               timings: dict[str, float] | None = None, transform: hf.WeightHook | None = None) -> Model:
    """Load a GGUF file or a Hugging Face directory.

    Parameters
    ----------
    path : a ``.gguf`` file, a directory with ``config.json`` + safetensors, or None for SmolLM2-135M-Instruct.
    dtype : "float32", "bfloat16" or "float16" (the weights' and activations' dtype; logits are float32).
    backend : kernel/attention backend for every op ("auto", "cpu", "reference", "triton").
    keep_quantized : GGUF only. None (default): Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K projections
        stay packed (``QuantizedWeight``, exact), as llama.cpp runs the file, and other types are dequantized;
        True: every quantized projection must stay packed; False: all are dequantized to ``dtype`` (what
        transformers computes with).
    device : where the weights go: None for the backend's default device (``"cpu"`` for ``"auto"``, ``"cuda"`` for
        ``"triton"`` on a GPU), or one it runs on (``"cuda:1"``). The file is read on the host, then copied.
    timings : a dict to fill with the seconds each step took: ``header`` (GGUF metadata and tensor index, or
        ``config.json``), ``weights``, ``tokenizer`` and, when the weights are copied to another device, ``device``.
    transform : ``transform(name, weight)`` is called once per canonical weight, whole, as soon as it is read, and
        the model keeps what it returns (on the host, before any copy to ``device``). A tensor-parallel rank cuts its
        shard there (:func:`tessera.distributed.rank_local.load_shard`); the model's config stays the whole one.
    """
    target = resolve_device(backend, device)
    torch_dtype = BY_NAME.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if torch_dtype not in BY_NAME.values():
        raise ValueError(f"load_model: dtype must be one of {list(BY_NAME)}, got {dtype!r}")
    path = checkpoint_path(path)
    if path.is_file():
        model = load_gguf(path, torch_dtype, backend, keep_quantized=keep_quantized, timings=timings,
                          transform=transform)
    else:
        marks = [time.perf_counter()]
        _, family, config = hf.read_config(path)
        marks.append(time.perf_counter())
        weights = hf.load_weights(path, config, family, torch_dtype, transform)
        marks.append(time.perf_counter())
        model = Model(config, weights, hf.load_tokenizer(path), backend=backend)
        marks.append(time.perf_counter())
        if timings is not None:
            timings.update({step: b - a for step, a, b in zip(("header", "weights", "tokenizer"), marks, marks[1:])})
    start = time.perf_counter()
    moved = to_device(model, target)
    if timings is not None and moved is not model:
        timings["device"] = time.perf_counter() - start
    return moved


def checkpoint_path(path: str | Path | None) -> Path:
    """``path`` as a checkpoint :func:`load_model` reads (None: SmolLM2-135M-Instruct).

    Raises
    ------
    FileNotFoundError
        Nothing at ``path``.
    ValueError
        A file that is not ``.gguf``.
    """
    path = Path(path) if path is not None else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"load_model: {path} does not exist")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"load_model: {path} is a file but not .gguf; pass a GGUF file or a Hugging Face "
                         "directory (config.json + safetensors)")
    return path
