"""A captured layer of a small random Llama with packed (int8, int4, int4_min) projections: capture emits
``tessera.qmatmul``, lower_graph lowers it, and the IREE module matches the layer on the de-quantized weights and
the cpu backend's packed layer."""

from __future__ import annotations

import pytest
import torch
import transformers

from tessera.backends import registered
from tessera.kernels.quant import dequantize
from tessera.models.model import Model
from tests.models.helpers import save_tiny

mlir = registered()["mlir"]
pytestmark = pytest.mark.skipif(bool(mlir.available()), reason="; ".join(mlir.available()) or "usable")
#: two layers (the last hidden state is taken after the final norm; layer 0's output is not); an odd token count;
#: head_dim 16 (lower_graph's attention needs a multiple of 16); every K a multiple of 32
TOKENS = 11
CONFIG = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
#: (format, group): requantize_model's formats at GGUF's group of 32 (K = 96 for down: three groups); other group
#: sizes are covered op by op in test_lower_graph.py
CASES = [("int8", 32), ("int4", 32), ("int4_min", 32)]
#: the cpu backend's packed layer vs the exact one: its GEMV quantizes x to int8 per block of 32 (step max|x| / 127,
#: docs/kernels/quant.md "int8 activations") and its many-row GEMM may round to bf16 (~2^-8); each moves one
#: projection's output by up to ~4e-3 of its scale, and four projections feed one layer. Measured 2026-12-05:
#: 7.1e-3 (int8), 7.4e-3 (int4) relative on this test's inputs
CPU_PACKED_TOL = 2e-2


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tessera.models import load_model

    directory = tmp_path_factory.mktemp("tiny_llama")
    save_tiny(transformers.LlamaForCausalLM, transformers.LlamaConfig(**CONFIG), directory)
    return load_model(directory, dtype="float32", backend="cpu")


def _layer_io(model: Model) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's input and output hidden states ``[T, H]`` for fixed random ids."""
    ids = torch.randint(0, model.config.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(5))
    hidden: list[torch.Tensor] = []
    model.logits(ids, hidden)
    return hidden[0][0], hidden[1][0]


@pytest.mark.parametrize("fmt,group", CASES)
def test_packed_layer_captures_qmatmul_and_matches(tiny_llama, fmt, group):
    from tessera.mlir.capture import capture_layer
    from tessera.mlir.lower_graph import lower_graph
    from tessera.mlir.packed import layer_inputs
    from tessera.mlir.passes import pipeline
    from tessera.models.requantize import requantize_model
    from tests.mlir.helpers import op_names

    packed = requantize_model(tiny_llama, fmt, group)
    module = capture_layer(packed.config, 0, TOKENS, weights=packed.weights)
    assert op_names(module).count("tessera.qmatmul") == 4 and "tessera.matmul" not in op_names(module)
    # the fusion passes match tessera.matmul only: with every projection packed, none of them fires
    fused = pipeline(module, "all")
    assert op_names(fused).count("tessera.qmatmul") == 4
    graph = lower_graph(fused)
    x, cpu_out = _layer_io(packed)
    inputs = {"x": x, "positions": torch.arange(TOKENS, dtype=torch.int64),
              **layer_inputs(graph.arg_names, packed.weights, 0)}
    out = graph.run(inputs)
    # reference: the same layer on the de-quantized weights (exact in float32 for int8 / int4), cpu backend; the
    # float32 layer test's bound (test_lowered_layer_matches_the_cpu_backend) applies
    floats = {name: dequantize(w) if name.startswith("layers.") and name.endswith(("qkv.weight", "o.weight",
              "gate_up.weight", "down.weight")) else w for name, w in packed.weights.items()}
    dense = Model(packed.config, floats, packed.tokenizer, packed.chat_template, packed.backend)
    x_ref, ref = _layer_io(dense)
    assert torch.equal(x_ref, x)  # the embedding lookup is float in both
    err = float((out.double() - ref.double()).abs().max() / ref.double().abs().max())
    assert err <= 1e-4, f"{fmt}: relative error {err:.3g} against the layer on de-quantized weights"
    err_cpu = float((out.double() - cpu_out.double()).abs().max() / cpu_out.double().abs().max())
    assert err_cpu <= CPU_PACKED_TOL, f"{fmt}: relative error {err_cpu:.3g} against the cpu backend's packed layer"


def test_packings_qmatmul_cannot_take_are_declined():
    """fp8 (no qmatmul format), a StackedWeight, and a packed weight of the wrong shape: named errors at capture."""
    from tessera.kernels.quant import StackedWeight, quantize
    from tessera.mlir.capture import capture_layer
    from tests.mlir.helpers import tiny_config

    config = tiny_config()  # o: [32, 32]
    w = torch.randn(32, 32)
    with pytest.raises(NotImplementedError, match=r"layers.0.o.weight is packed as 'fp8_e4m3'"):
        capture_layer(config, 0, 4, weights={"layers.0.o.weight": quantize(w, "fp8_e4m3")})
    stacked = StackedWeight((quantize(w[:16], "int8", 32), quantize(w[16:], "int4", 32)))
    with pytest.raises(NotImplementedError, match="StackedWeight"):
        capture_layer(config, 0, 4, weights={"layers.0.o.weight": stacked})
    with pytest.raises(ValueError, match=r"expects \(32, 32\)"):
        capture_layer(config, 0, 4, weights={"layers.0.o.weight": quantize(torch.randn(16, 32), "int8", 32)})


def test_capture_model_with_packed_projections_and_head():
    """capture_model: every layer's projections and the packed output copy of a tied table as qmatmul; a packed
    token table is declined."""
    from tessera.kernels.quant import quantize
    from tessera.mlir.capture import capture_model
    from tests.mlir.helpers import op_names, tiny_config

    config = tiny_config(vocab_size=48, intermediate_size=64)  # every K a multiple of 32
    shapes = {"qkv": (config.qkv_rows, 32), "o": (32, 32), "gate_up": (128, 32), "down": (32, 64)}
    gen = torch.Generator().manual_seed(6)
    weights = {f"layers.{i}.{part}.weight": quantize(torch.randn(*shape, generator=gen), fmt, 32)
               for i, fmt in enumerate(("int4", "int4_min")) for part, shape in shapes.items()}
    weights["lm_head"] = quantize(torch.randn(48, 32, generator=gen), "int8", 32)
    module = capture_model(config, 8, weights=weights)
    names = op_names(module)
    assert names.count("tessera.qmatmul") == 9 and names.count("tessera.matmul") == 0
    fn = next(iter(module.body.block.ops))
    assert [a.name_hint for a in fn.body.block.args][-3:] == ["final_norm", "lm_head", "lm_head_scales"]
    weights["embed"] = quantize(torch.randn(48, 32, generator=gen), "int8", 32)
    with pytest.raises(NotImplementedError, match="token table 'embed' is packed"):
        capture_model(config, 8, weights=weights)
