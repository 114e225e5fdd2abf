"""Capture of Tessera's decoder as tessera IR."""

from __future__ import annotations

import pytest

from tessera.mlir import dialect as td
from tessera.mlir.capture import capture_layer, capture_model
from tests.mlir.helpers import op_names, tiny_config

LAYER_OPS = ["tessera.rms_norm", "tessera.matmul", "tessera.split_qkv", "tessera.rope", "tessera.rope",
             "tessera.attention", "tessera.merge_heads", "tessera.matmul", "tessera.residual_add",
             "tessera.rms_norm", "tessera.matmul", "tessera.silu_and_mul", "tessera.matmul",
             "tessera.residual_add"]


def _attention(module):
    return next(op for op in module.walk() if isinstance(op, td.AttentionOp))


def test_layer_op_sequence_and_signature():
    module = capture_layer(tiny_config(), 1, 16)
    module.verify()
    assert op_names(module) == [*LAYER_OPS, "func.return"]
    fn = next(iter(module.body.block.ops))
    assert fn.sym_name.data == "layer_1"
    args = {a.name_hint: str(a.type) for a in fn.body.block.args}
    assert args == {"x": "tensor<16x32xf32>", "positions": "tensor<16xi64>", "l1_attn_norm": "tensor<32xf32>",
                    "l1_qkv": "tensor<64x32xf32>", "l1_o": "tensor<32x32xf32>", "l1_mlp_norm": "tensor<32xf32>",
                    "l1_gate_up": "tensor<96x32xf32>", "l1_down": "tensor<32x48xf32>"}
    op = _attention(module)
    assert (op.mask.data, op.score.data, op.num_q_heads.value.data, op.num_kv_heads.value.data) == \
        ("causal", "none", 4, 2)
    assert op.scale.value.data == pytest.approx(8 ** -0.5)


def test_layer_attributes_follow_the_config():
    config = tiny_config(layer_windows=(None, 6), attn_softcap=30.0, query_scale=0.2, norm_eps=1e-6,
                         rope_configs={"default": {"rope_theta": 5e5, "partial_rotary_factor": 0.5}})
    op = _attention(capture_layer(config, 1, 8))
    assert (op.mask.data, op.window.value.data, op.score.data, op.softcap.value.data, op.scale.value.data) == \
        ("sliding_window", 6, "softcap", 30.0, 0.2)
    assert _attention(capture_layer(config, 0, 8)).mask.data == "causal"
    rope = next(o for o in capture_layer(config, 0, 8).walk() if isinstance(o, td.RopeOp))
    assert (rope.theta.value.data, rope.rotary_dim.value.data) == (5e5, 4)


def test_dynamic_tokens_and_dtypes():
    text = str(capture_layer(tiny_config(), 0, None, "bf16"))
    assert "%x: tensor<?x32xbf16>" in text and "tensor<?x4x8xbf16>" in text


def test_model_forward():
    module = capture_model(tiny_config(), 8)
    names = op_names(module)
    assert names == ["tessera.embed", *LAYER_OPS, *LAYER_OPS, "tessera.rms_norm", "tessera.matmul", "func.return"]
    fn = next(iter(module.body.block.ops))
    assert [a.name_hint for a in fn.body.block.args][:3] == ["ids", "positions", "embed"]
    assert str(fn.function_type.outputs.data[0]) == "tensor<8x50xf32>"
    untied = capture_model(tiny_config(tie_embeddings=False), 8)
    assert [a.name_hint for a in next(iter(untied.body.block.ops)).body.block.args][-1] == "lm_head"


@pytest.mark.parametrize("overrides, field", [
    (dict(qkv_bias=True), "ModelConfig.qkv_bias = True"),
    (dict(qk_norm=True), "ModelConfig.qk_norm = True"),
    (dict(norm="layer"), "ModelConfig.norm = 'layer'"),
    (dict(activation="gelu_tanh"), "ModelConfig.activation = 'gelu_tanh'"),
    (dict(post_norms=True), "ModelConfig.post_norms = True"),
    (dict(rope_configs={"default": {"rope_theta": 1e4, "rope_parameters": {"rope_type": "llama3"}}}),
     "rope_type 'llama3'"),
])
def test_unsupported_switches_are_named(overrides, field):
    with pytest.raises(NotImplementedError, match=field.replace("[", r"\[")):
        capture_layer(tiny_config(**overrides), 0, 4)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"layer_index must be in \[0, 2\), got 2"):
        capture_layer(tiny_config(), 2, 4)
    with pytest.raises(ValueError, match="dtype must be one of"):
        capture_layer(tiny_config(), 0, 4, "f64")
    with pytest.raises(NotImplementedError, match="final_softcap"):
        capture_model(tiny_config(final_softcap=30.0), 4)
