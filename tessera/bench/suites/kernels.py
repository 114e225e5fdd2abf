"""The kernel-library suite: every op family's cases (``tessera.bench.kernel_cases``) against torch eager."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator

import torch

import tessera.bench.kernel_cases as families
from tessera.bench.harness import Case

_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16"}


def _dtype_of(name: str) -> str:
    """Kernel case names carry their dtype ("rms_norm 64x4096 bfloat16"); fp32 unless a half type is named."""
    return next((tag for word, tag in _DTYPES.items() if word in name.split()), "fp32")


def cases(quick: bool) -> Iterator[Case]:
    torch.manual_seed(0)
    for info in sorted(pkgutil.iter_modules(families.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{families.__name__}.{info.name}")
        for kc in module.cases(quick):
            yield Case("kernels", f"{kc.family}: {kc.name}", kc.ours, kc.torch_eager, "torch", float(kc.flops),
                       float(kc.bytes_moved), _dtype_of(kc.name), {"family": kc.family}, kc.target)
