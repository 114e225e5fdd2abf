"""The floating-point storage dtypes, in one table for every layer (API checks, kernels, backends, the KV cache).

float64 is not among them: it is the reference backend's compute type, not a dtype Tessera stores tensors in.
"""

from __future__ import annotations

import torch

#: dtypes activations, weights and K/V may be stored in
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
#: the names a user may pass for them (``load_model(dtype="bfloat16")``, ``tessera serve --dtype``)
BY_NAME: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
