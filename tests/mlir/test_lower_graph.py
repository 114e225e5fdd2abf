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
                       lambda b, a: b.insert(build(td.QMatmulOp, [*a, []], [td.tensor([t, n], Float32Type())],
                                                   format="int8", group_size=group)).out)
    module.verify()
    graph = lower_graph(module)
    assert "arith.sitofp %q : i8 to f32" in graph.text and "affine_map<(n, g, i) -> (n, g)>" in graph.text
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, k, generator=gen)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) / 64).to(torch.float32 if scale_type == "f32" else torch.float16)
    out = graph.run(dict(zip(graph.arg_names, (x, w, scales))))
    ref = x.double() @ (w.double() * scales.double().repeat_interleave(group, 1)).T
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err < 1e-5, f"relative error {err:.3g}"


def _qmatmul_module(fmt: str, t: int, qw):
    """``f(x, codes, scales[, zeros or mins]) = tessera.qmatmul`` for packed weight ``qw``, through capture's
    operand mapping (:mod:`tessera.mlir.packed`)."""
    from xdsl.dialects.builtin import Float32Type

    from tessera.mlir import dialect as td
    from tessera.mlir.packed import operand_types
    from tests.mlir.helpers import build, module_of

    n, k = qw.shape
    types = [t for _, t in operand_types(qw, "w", (n, k))]

    def body(b, a):
        return b.insert(build(td.QMatmulOp, [a[0], a[1], a[2], list(a[3:])], [td.tensor([t, n], Float32Type())],
                              format=fmt, group_size=qw.group_size)).out

    module = module_of([td.tensor([t, k], Float32Type()), *types], body)
    module.verify()
    return module


def _check_packed(qw, t: int, seed: int) -> float:
    """Relative error of the lowered qmatmul against ``x @ dequantize(qw).T`` in float64."""
    from tessera.backends.reference.ops.quant import dequantize_f64
    from tessera.mlir.lower_graph import lower_graph
    from tessera.mlir.packed import operand_tensors

    graph = lower_graph(_qmatmul_module(qw.fmt, t, qw))
    x = torch.randn(t, qw.shape[1], generator=torch.Generator().manual_seed(seed))
    out = graph.run(dict(zip(graph.arg_names, (x, *operand_tensors(qw).values()))))
    ref = x.double() @ dequantize_f64(qw).T
    return float((out.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("fmt,group,scale_dtype", [("int4", 32, torch.float32), ("int4_min", 64, torch.float16),
                                                   ("int4", 128, torch.float16)])
def test_int4_qmatmul_unpacks_nibbles_and_matches_dequantize(fmt, group, scale_dtype):
    """int4 / int4_min: the nibbles unpacked in a linalg.generic (shift and mask on i8, the group's scale and zero
    point or min), then the float matmul; odd T and N, K a multiple of the group."""
    from tessera.kernels.quant import QuantizedWeight, quantize
    from tessera.mlir.lower_graph import lower_graph

    t, n, k = 7, 37, 2 * group + 128
    qw = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(1)), fmt, group)
    if scale_dtype == torch.float16:  # what a GGUF file stores (from_gguf keeps its f16 scales and mins)
        halve = (lambda v: None if v is None else v.half())  # noqa: E731
        qw = QuantizedWeight(fmt, qw.shape, group, qw.data, qw.scales.half(), qw.zeros, halve(qw.mins))
    text = lower_graph(_qmatmul_module(fmt, t, qw)).text
    assert "arith.shrui %p, %sh : i8" in text and "arith.andi %hi, %c15 : i8" in text
    assert f"tensor.expand_shape %arg1 [[0], [1, 2]] output_shape [{n}, {k // group}, {group // 2}]" in text
    assert ("arith.subi %q, %o : i8" in text) == (fmt == "int4")
    assert ("arith.addf %m, " in text) == (fmt == "int4_min")
    err = _check_packed(qw, t, seed=2)
    # float32 de-quantization is exact for int4 ((q - z) * s rounds once, like float64 -> float32) and one extra
    # rounding for int4_min; the rest is the float32 matmul's accumulation over K <= 384
    assert err < 1e-5, f"{fmt} group {group}: relative error {err:.3g}"


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_lower_as_their_split_formats(ggml_type):
    """GGUF Q8_0 / Q4_0 / Q4_1 rows, split by from_gguf into int8 / int4 (zero point 8) / int4_min with f16 scales,
    lower through the same generics and match dequantize."""
    import numpy as np

    from tessera.kernels.quant import from_gguf

    n, k = 19, 96
    rng = np.random.default_rng(3)
    block = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[ggml_type]
    raw = rng.integers(0, 256, (n, k // 32, block), dtype=np.uint8)
    halves = 2 if ggml_type != "Q4_1" else 4  # d (and m for Q4_1) as finite float16 values
    raw[..., :halves] = (rng.standard_normal((n, k // 32, halves // 2)) / 50).astype(np.float16).view(np.uint8)
    qw = from_gguf(raw, ggml_type, (n, k))
    assert qw.fmt == {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4_min"}[ggml_type]
    err = _check_packed(qw, 5, seed=4)
    assert err < 1e-5, f"{ggml_type}: relative error {err:.3g}"


def test_per_channel_int8_lowers():
    """int8 with one scale per row (group_size = K, what quantize makes with group_size=None)."""
    from tessera.kernels.quant import quantize

    qw = quantize(torch.randn(29, 160, generator=torch.Generator().manual_seed(7)), "int8", None)
    assert qw.group_size == 160
    err = _check_packed(qw, 3, seed=8)
    assert err < 1e-5, f"relative error {err:.3g}"


def test_packings_without_a_qmatmul_format_are_named():
    from tessera.kernels.quant import quantize
    from tessera.mlir.packed import qmatmul_format

    qw = quantize(torch.randn(8, 64), "fp8_e4m3")
    with pytest.raises(NotImplementedError, match="packed as 'fp8_e4m3'; tessera.qmatmul lowers"):
        qmatmul_format(qw, "layers.0.o.weight")
