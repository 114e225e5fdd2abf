"""Compile-only checks: the same MLIR reaches GPU targets (cuda, rocm) and Vulkan from a machine that has none.

The kernel library's linalg modules and the attention kernel compile for every target IREE was built with (a target
this IREE build lacks is skipped with the reason). Attention reaches GPUs in its linalg form
(:mod:`tessera.mlir.attention_linalg`, chosen per target by :mod:`tessera.backends.mlir.targets`): the loop kernel the
CPU runs is a sequential loop per work item, which IREE's GPU pipelines refuse. tests/backends/test_mlir_linalg.py
runs that same linalg text on llvm-cpu against the float64 oracle.
"""

from __future__ import annotations

import subprocess

import pytest

from tessera.backends import registered

mlir = registered()["mlir"]
pytestmark = pytest.mark.skipif(bool(mlir.available()), reason="; ".join(mlir.available()) or "usable")
GPU_TARGETS = ["cuda", "rocm", "vulkan-spirv"]
_BACKEND_NAME = {"cuda": "cuda", "rocm": "rocm", "vulkan-spirv": "vulkan-spirv"}


def _built_targets() -> set[str]:
    from iree.compiler.tools import binaries

    out = subprocess.run([binaries.find_tool("iree-compile"), "--iree-hal-list-target-backends"], capture_output=True,
                         text=True, check=True).stdout
    return {line.strip() for line in out.splitlines()[1:] if line.strip()}


def _require(target: str) -> None:
    if _BACKEND_NAME[target] not in _built_targets():
        pytest.skip(f"this IREE build has no {target} target (iree-compile --iree-hal-list-target-backends)")


def _op_modules() -> dict[str, str]:
    from tessera.mlir import op_kernels as K

    return {"rms_norm": K.rms_norm(), "silu_and_mul": K.gated_activation("silu"), "matmul_softcap": K.matmul(True),
            "rope": K.rope(False), "embed": K.embed()}


@pytest.mark.parametrize("target", GPU_TARGETS)
def test_kernel_ops_compile_for_gpu_targets(target, tmp_path, monkeypatch):
    from tessera.mlir import iree_compile

    _require(target)
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    for name, text in _op_modules().items():
        binary = iree_compile.compile_module(text, target)
        assert len(binary) > 1000, f"{target} {name}: {len(binary)} bytes"
        assert list((tmp_path / "mlir").glob(f"{target}-*.vmfb"))


def _attention_cases() -> dict:
    """name -> (spec, linalg options): every mask path (built-in, gathered table), sinks, and both linalg forms."""
    import torch

    from tessera.attention import AttentionSpec, causal, document, sliding_window, softcap

    return {"causal_gqa": (AttentionSpec(8, 2, 64, mask=causal()), {}),
            "causal_gqa_tiled": (AttentionSpec(8, 2, 64, mask=causal()), {"kv_tile": 64}),
            "window_softcap_sinks": (AttentionSpec(4, 1, 48, mask=sliding_window(8), score=softcap(20.0),
                                                   sinks=torch.zeros(4)), {}),
            "document": (AttentionSpec(4, 2, 32, mask=document(torch.tensor([0, 0, 1, 1, 2])) & causal()), {})}


@pytest.mark.parametrize("target", GPU_TARGETS)
def test_attention_kernel_compiles_for_gpu_targets(target, tmp_path, monkeypatch):
    from tessera.backends.mlir.targets import lower_attention_for
    from tessera.mlir import iree_compile
    from tessera.mlir.attention_linalg import LinalgAttentionKernel

    _require(target)
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    cases = _attention_cases()
    for name, (spec, options) in cases.items():
        kernel = lower_attention_for(spec, target, **options)
        assert isinstance(kernel, LinalgAttentionKernel), f"{target} must get the linalg lowering"
        binary = iree_compile.compile_module(kernel.text, target)
        assert len(binary) > 1000, f"{target} {name}: {len(binary)} bytes"
    assert len(list((tmp_path / "mlir").glob(f"{target}-*.vmfb"))) == len(cases)
