"""The triton backend: plan work items on the host, run generated-variant kernels on the GPU (or the interpreter)."""

from __future__ import annotations

import functools
import importlib.util

import torch

from tessera.attention.spec import AttentionSpec
from tessera.backends.base import AttentionRequest, KVLayout, PlanOptions, RaggedBatch
from tessera.backends.triton.configs import interpreting
from tessera.dtypes import FLOAT_DTYPES

MAX_HEAD_DIM = 256


class TritonBackend:
    """FlashAttention-2 style prefill and flash-decoding kernels generated from the spec, for NVIDIA GPUs.

    With ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors through Triton's interpreter (slowly); that is
    how the conformance suite tests this backend on machines without a GPU.
    """

    name = "triton"

    @property
    def priority(self) -> int:
        """Above cpu on GPUs; under the interpreter (a testing aid, ~1000x slower) only chosen by name."""
        return -1 if interpreting() else 20
    #: ``run`` writes ``out`` in the output dtype and folds sinks itself (no extra passes over the output)
    fused_epilogue = True

    def available(self) -> list[str]:
        if not _triton_installed():
            return ["the triton package is not installed (pip install triton)"]
        if interpreting() or torch.cuda.is_available():
            return []
        return ["no CUDA device (torch.cuda.is_available() is False); set TRITON_INTERPRET=1 to run the kernels on "
                "the CPU through Triton's interpreter (slow, for testing)"]

    def device_types(self) -> tuple[str, ...]:
        """CUDA tensors; CPU tensors instead under ``TRITON_INTERPRET=1`` (the interpreter runs nothing else)."""
        return ("cpu",) if interpreting() else ("cuda",)

    def why_not(self, request: AttentionRequest) -> list[str]:
        reasons = []
        want = "cpu (TRITON_INTERPRET=1)" if interpreting() else "cuda"
        if request.device.type != want.split()[0]:
            reasons.append(f"runs on {want} tensors, got {request.device.type}")
        if request.dtype not in FLOAT_DTYPES:
            reasons.append(f"storage dtype {request.dtype} is not one of float32, bfloat16, float16")
        if request.spec.head_dim > MAX_HEAD_DIM:
            reasons.append(f"head_dim {request.spec.head_dim} > {MAX_HEAD_DIM} (one tile row must fit in registers)")
        untranslatable = _translation_error(request.spec)
        if untranslatable:
            reasons.append(untranslatable)
        return reasons

    def plan(self, spec: AttentionSpec, batch: RaggedBatch, layout: KVLayout, options: PlanOptions | None = None):
        from tessera.backends.triton.runner import build_plan  # imports triton; only when the backend is used

        return build_plan(spec, batch, layout)

    def reads_quantized_kv(self, plan, fmt: str) -> bool:
        """Every plan reads int8 and e4m3 KV codes itself (de-quantized per tile as loaded)."""
        return fmt in ("int8", "fp8_e4m3")

    def run(self, plan, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor) -> None:
        from tessera.backends.triton.runner import run_plan

        run_plan(plan, q, k_rows, v_rows, out, lse)


@functools.lru_cache(maxsize=1)
def _triton_installed() -> bool:
    """Whether the package is importable: asked once per process (``find_spec`` walks sys.path, ~0.1 ms, and
    ``select`` asks every backend on every un-planned attention call)."""
    return importlib.util.find_spec("triton") is not None


def _translation_error(spec: AttentionSpec) -> str:
    """Why the spec's mask or score cannot become Triton code ("" when it can); cached per spec object."""
    if spec.mask is None and spec.score is None:
        return ""
    return _cached_translation_error(spec)


@functools.lru_cache(maxsize=256)
def _cached_translation_error(spec: AttentionSpec) -> str:
    from tessera.backends.triton.codegen import UntranslatableError, generate

    try:
        generate(spec)
    except UntranslatableError as exc:
        return f"its mask or score function cannot be translated to Triton: {exc}"
    except ValueError as exc:
        return str(exc)
    return ""

