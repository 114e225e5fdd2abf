"""The engine on any backend's device: ``LLM(backend=..., device=...)``, and no allocation that ignores the device.

CI has no GPU, so the triton backend runs under ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py``) on CPU tensors;
on a CUDA machine the same code runs with ``device="cuda"`` and no other change.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import tessera
from tessera.backends import resolve_device
from tessera.engine import LLM, SamplingParams
from tessera.engine import runner as runner_module
from tessera.kernels.quant import quantize
from tessera.models.model import to_device
from tests.engine.conftest import random_prompts

pytest.importorskip("triton")

#: torch calls that create a tensor from nothing: each one must say where (``device=``)
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "as_tensor"}
#: the modules that run an engine step above the backends; kernels choose their device from their inputs
ENGINE_FILES = tuple(str(Path(tessera.__file__).parent / part) for part in (
    "engine", "kv", "models/paged.py", "models/layers.py", "models/model.py"))


class DevicelessAllocations(TorchFunctionMode):
    """Records every factory call made directly from an engine module without a ``device=`` argument."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in FACTORIES and "device" not in kwargs:
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(ENGINE_FILES):
                self.found.append(f"torch.{name} at {caller}:{sys._getframe(1).f_lineno}")
        return func(*args, **kwargs)


def greedy_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int = 6) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_triton_engine_matches_cpu_and_mixes_prefill_with_decode(tiny_model, monkeypatch) -> None:
    # a long prompt prefills in chunks of 16 tokens while the short ones already decode: mixed steps
    prompts = random_prompts([3, 40, 5], seed=11)
    kwargs = {"page_size": 4, "num_pages": 64, "max_num_batched_tokens": 16}
    expected = greedy_tokens(LLM(tiny_model, **kwargs), prompts)

    steps: list[list[int]] = []
    forward_step = runner_module.forward_step

    def recording(model, cache, step, **kw):
        steps.append(list(step.q_lens))
        return forward_step(model, cache, step, **kw)

    monkeypatch.setattr(runner_module, "forward_step", recording)
    model = dataclasses.replace(tiny_model, backend="triton")
    llm = LLM(model, **kwargs)
    assert llm.cache.device == model.device == resolve_device("triton")
    with DevicelessAllocations() as mode:
        got = greedy_tokens(llm, prompts)
    assert got == expected
    assert any(1 in q and any(n > 1 for n in q) for q in steps), f"no step mixed prefill and decode: {steps}"
    assert mode.found == [], "engine allocations that ignore the model's device:\n" + "\n".join(mode.found)


def test_resolve_device_defaults_and_errors() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("triton") == torch.device("cpu")  # interpreted in this suite
    assert resolve_device("reference", "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"backend 'cpu' runs on cpu tensors, got device 'meta'; pass device='cpu'"):
        resolve_device("cpu", "meta")
    with pytest.raises(ValueError, match="device must be a torch device"):
        resolve_device("auto", "gpu7")
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"torch.cuda.is_available\(\) is False"):
            resolve_device("auto", "cuda")


def test_models_move_whole_to_a_device(tiny_model) -> None:
    """The meta device stands in for an accelerator: every weight, packed parts included, moves."""
    gen = torch.Generator().manual_seed(0)
    packed = quantize(torch.randn(8, 64, generator=gen), "int4_min", 32)
    model = dataclasses.replace(tiny_model, weights={**tiny_model.weights, "extra.weight": packed})
    moved = to_device(model, torch.device("meta"))
    assert moved.device.type == "meta" and model.device.type == "cpu"
    for name, w in moved.weights.items():
        parts = [w] if isinstance(w, torch.Tensor) else [w.data, w.scales, w.zeros, w.mins]
        assert all(p.device.type == "meta" for p in parts if p is not None), name
    assert to_device(model, torch.device("cpu")) is model
    llm_error = r"backend 'cpu' runs on cpu tensors"
    with pytest.raises(ValueError, match=llm_error):
        LLM(dataclasses.replace(tiny_model, backend="cpu"), device="meta", num_pages=8)
