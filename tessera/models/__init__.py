"""Model bring-up: checkpoints (GGUF, Hugging Face safetensors) into one normalized config and the shared decoder.

>>> from tessera.models import load_model
>>> model = load_model("path/to/hf_dir_or.gguf", dtype="float32")
>>> logits = model.logits(torch.tensor([[1, 2, 3]]))   # float32 [1, 3, vocab]
"""

from tessera.models.config import ModelConfig
from tessera.models.hf import CheckpointError
from tessera.models.load import load_model
from tessera.models.model import Model, default_model_path

__all__ = ["CheckpointError", "Model", "ModelConfig", "default_model_path", "load_model"]
