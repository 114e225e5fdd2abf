"""A captured SmolLM2 layer, fused by the passes and lowered to one IREE module, against the cpu backend's layer."""

from __future__ import annotations

import pytest
import torch

from tessera.backends import registered
from tessera.models.model import default_model_path

mlir = registered()["mlir"]
pytestmark = [pytest.mark.skipif(bool(mlir.available()), reason="; ".join(mlir.available()) or "usable"),
              pytest.mark.skipif(not default_model_path().is_file(), reason="SmolLM2's GGUF is not installed")]
TOKENS = 16


@pytest.fixture(scope="module")
def smollm2():
    from tessera.models import load_model

    model = load_model(dtype="float32", backend="cpu", keep_quantized=False)
    ids = torch.randint(0, model.config.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    hidden: list[torch.Tensor] = []
    model.logits(ids, hidden)
    return model, hidden


@pytest.mark.parametrize("passes", ["none", "all"])
def test_lowered_layer_matches_the_cpu_backend(smollm2, passes):
    from tessera.mlir.capture import capture_layer
    from tessera.mlir.lower_graph import lower_graph
    from tessera.mlir.passes import pipeline

    model, hidden = smollm2
    module = pipeline(capture_layer(model.config, 0, TOKENS), None if passes == "none" else "all")
    graph = lower_graph(module)
    assert "func.call @attention" in graph.text and "flow.dispatch.workgroups" in graph.text
    inputs = {"x": hidden[0][0], "positions": torch.arange(TOKENS, dtype=torch.int64)}
    for name in graph.arg_names[2:]:  # l0_qkv -> layers.0.qkv.weight
        inputs[name] = model.weights[f"layers.0.{name.split('_', 1)[1]}.weight"]
    out, ref = graph.run(inputs), hidden[1][0]
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err <= 1e-4, f"passes={passes}: relative error {err:.3g} against the cpu backend's layer 0"


def test_what_is_not_lowered_is_named():
    from xdsl.dialects.builtin import ModuleOp

    from tessera.mlir.capture import capture_layer, capture_model
    from tessera.mlir.lower_graph import lower_graph
    from tests.mlir.helpers import tiny_config

    with pytest.raises(ValueError, match="no func.func"):
        lower_graph(ModuleOp([]))
    with pytest.raises(NotImplementedError, match="tessera.embed has no lowering"):
        lower_graph(capture_model(tiny_config(), 8))
    with pytest.raises(NotImplementedError, match="only static float32"):
        lower_graph(capture_layer(tiny_config(), 0, None))


@pytest.mark.parametrize("scale_type", ["f32", "f16"])
def test_int8_qmatmul_lowers_to_dequant_and_matmul(scale_type):
    """``tessera.qmatmul`` with int8 weights: a de-quantizing linalg.generic in front of the float matmul."""
    from xdsl.dialects.builtin import Float16Type, Float32Type, IntegerType

    from tessera.mlir import dialect as td
    from tessera.mlir.lower_graph import lower_graph
    from tests.mlir.helpers import build, module_of

    t, k, n, group = 5, 64, 24, 32
    el = Float32Type() if scale_type == "f32" else Float16Type()
    module = module_of([td.tensor([t, k], Float32Type()), td.tensor([n, k], IntegerType(8)),
                        td.tensor([n, k // group], el)],
                       lambda b, a: b.insert(build(td.QMatmulOp, a, [td.tensor([t, n], Float32Type())],
                                                   format="int8", group_size=group)).out)
    module.verify()
    graph = lower_graph(module)
    assert "arith.sitofp %q : i8 to f32" in graph.text and "(n, k floordiv 32)" in graph.text
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, k, generator=gen)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) / 64).to(torch.float32 if scale_type == "f32" else torch.float16)
    out = graph.run(dict(zip(graph.arg_names, (x, w, scales))))
    ref = x.double() @ (w.double() * scales.double().repeat_interleave(group, 1)).T
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err < 1e-5, f"relative error {err:.3g}"


def test_qmatmul_formats_without_a_lowering_are_named():
    from xdsl.dialects.builtin import Float32Type, IntegerType

    from tessera.mlir import dialect as td
    from tessera.mlir.lower_graph import lower_graph
    from tests.mlir.helpers import build, module_of

    module = module_of([td.tensor([2, 64], Float32Type()), td.tensor([8, 32], IntegerType(8)),
                        td.tensor([8, 2], Float32Type())],
                       lambda b, a: b.insert(build(td.QMatmulOp, a, [td.tensor([2, 8], Float32Type())],
                                                   format="int4", group_size=32)).out)
    module.verify()
    with pytest.raises(NotImplementedError, match="qmatmul format 'int4' has no lowering yet"):
        lower_graph(module)
