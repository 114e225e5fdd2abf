"""Verifiers of the tessera dialect, printing and parsing, and spec <-> attribute conversion."""

from __future__ import annotations

import pytest
from xdsl.dialects.builtin import DYNAMIC_INDEX, f16, f32, i8, i32, i64
from xdsl.utils.exceptions import VerifyException

from tessera.attention import AttentionSpec, causal, chunked, prefix_lm, sliding_window, softcap
from tessera.mlir import dialect as td
from tessera.mlir.capture import capture_layer, capture_model
from tests.mlir.helpers import module_of, tiny_config

T = td.tensor


def _attention(q=(8, 4, 16), k=(8, 2, 16), v=None, **attrs):
    base = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, mask="causal", score="none")
    base.update(attrs)
    types = [T(q, f32), T(k, f32), T(v or k, f32)]
    return module_of(types, lambda b, a: b.insert(td.make(td.AttentionOp, a, [T(q, f32)], **base)).out)


def _fails(module, *fragments: str) -> str:
    with pytest.raises(VerifyException) as info:
        module.verify()
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return str(info.value)


def test_attention_accepts_gqa_and_dynamic_tokens():
    _attention().verify()
    _attention(q=(None, 4, 16), k=(None, 2, 16)).verify()
    _attention(k=(32, 2, 16)).verify()  # keys from a cache: S != T
    _attention(mask="sliding_window", window=64, score="softcap", softcap=30.0, has_sinks=True).verify()


@pytest.mark.parametrize("kwargs, fragments", [
    (dict(num_kv_heads=3), ["num_q_heads (4) must be a multiple of num_kv_heads (3)"]),
    (dict(q=(8, 4, 32)), ["q dim 2 must be 16 (head_dim), got 32"]),
    (dict(k=(8, 4, 16)), ["k dim 1 must be 2 (num_kv_heads), got 4"]),
    (dict(v=(7, 2, 16)), ["v dim 0 must be 8 (k's token count), got 7"]),
    (dict(mask="diagonal"), ["mask must be one of", "got 'diagonal'"]),
    (dict(mask="sliding_window"), ["window (mask 'sliding_window') must be an int >= 1, got None"]),
    (dict(window=4), ["window is set but mask is 'causal'", "drop window"]),
    (dict(score="softcap"), ["softcap (score 'softcap') must be a finite float > 0"]),
    (dict(score="tanh"), ["score must be one of"]),
    (dict(kv_layout="paged"), ["kv_layout must be one of ['token', 'head'], got 'paged'"]),
])
def test_attention_rejects(kwargs, fragments):
    message = _fails(_attention(**kwargs), *fragments)
    assert message.startswith("tessera.attention: ")


def test_attention_rejects_rank_and_element_type():
    module = module_of([T([8, 64], f32), T([8, 2, 16], f32), T([8, 2, 16], f32)], lambda b, a: b.insert(
        td.make(td.AttentionOp, a, [T([8, 64], f32)], num_q_heads=4, num_kv_heads=2, head_dim=16, scale=0.25,
                mask="none", score="none")).out)
    _fails(module, "q must have rank 3, got [8, 64]")
    module = module_of([T([8, 4, 16], i32), T([8, 2, 16], i32), T([8, 2, 16], i32)], lambda b, a: b.insert(
        td.make(td.AttentionOp, a, [T([8, 4, 16], i32)], num_q_heads=4, num_kv_heads=2, head_dim=16, scale=0.25,
                mask="none", score="none")).out)
    _fails(module, "q must hold f32, bf16 or f16, got i32")


def _matmul(x, w, out):
    return module_of([T(x, f32), T(w, f32)], lambda b, a: b.insert(td.make(td.MatmulOp, a, [T(out, f32)])).out)


def test_matmul_shapes():
    _matmul((8, 32), (48, 32), (8, 48)).verify()
    _matmul((None, 32), (48, 32), (None, 48)).verify()
    _fails(_matmul((8, 32), (32, 48), (8, 32)), "w dim 1 must be 32 (x's K; w is row-major [N, K]")
    _fails(_matmul((8, 32), (48, 32), (8, 40)), "result dim 1 must be 48 (w's N), got 40")


def _qmatmul(fmt, w_shape, s_shape, group=32, k=64, n=16, offsets=None):
    """A qmatmul of ``fmt``; ``offsets`` = ``(shape, element)`` of its zeros or mins operand, if any."""
    types = [T([4, k], f32), T(w_shape, i8), T(s_shape, f32)] + ([T(*offsets)] if offsets else [])
    return module_of(types, lambda b, a: b.insert(
        td.make(td.QMatmulOp, [a[0], a[1], a[2], list(a[3:])], [T([4, n], f32)], format=fmt,
                group_size=group)).out)


def test_qmatmul_packed_shapes():
    _qmatmul("int8", [16, 64], [16, 2]).verify()
    _qmatmul("int4", [16, 32], [16, 2], offsets=([16, 2], i8)).verify()
    _qmatmul("int4_min", [16, 32], [16, 2], offsets=([16, 2], f32)).verify()
    _fails(_qmatmul("int4", [16, 64], [16, 2], offsets=([16, 2], i8)),
           "packed weight dim 1 must be 32 (K / 2 for int4), got 64")
    _fails(_qmatmul("int8", [16, 64], [16, 4]), "scales dim 1 must be 2 (K / group_size = 64 / 32), got 4")
    _fails(_qmatmul("int8", [16, 64], [16, 2], group=48), "K = 64 must be a multiple of group_size 48")
    _fails(_qmatmul("int2", [16, 64], [16, 2]), "format must be one of ['int8', 'int4', 'int4_min'], got 'int2'")
    bad = module_of([T([4, 64], f32), T([16, 64], i32), T([16, 2], f32)], lambda b, a: b.insert(
        td.make(td.QMatmulOp, [*a, []], [T([4, 16], f32)], format="int8", group_size=32)).out)
    _fails(bad, "packed weight must hold i8 (packed weights), got i32")


def test_qmatmul_offsets_follow_the_format():
    _fails(_qmatmul("int4", [16, 32], [16, 2]), "format 'int4' takes an offsets operand (zero points, i8")
    _fails(_qmatmul("int8", [16, 64], [16, 2], offsets=([16, 2], f32)), "format 'int8' takes no offsets operand")
    _fails(_qmatmul("int4", [16, 32], [16, 2], offsets=([16, 4], i8)), "offsets dim 1 must be 2")
    _fails(_qmatmul("int4", [16, 32], [16, 2], offsets=([16, 2], f32)), "offsets must hold i8")
    _fails(_qmatmul("int4_min", [16, 32], [16, 2], offsets=([16, 2], i8)), "offsets must hold f32, bf16 or f16")
    _fails(_qmatmul("int4_min", [16, 32], [16, 2], offsets=([16, 2], f16)), "mins must hold the scales' element type")
    _fails(_qmatmul("int4", [16, 15], [16, 2], k=30, group=15, offsets=([16, 2], i8)),
           "group_size must be even for int4")


def test_small_ops_reject_bad_shapes():
    norm = module_of([T([8, 32], f32), T([16], f32)], lambda b, a: b.insert(
        td.make(td.RmsNormOp, a, [T([8, 32], f32)], eps=1e-6)).out)
    _fails(norm, "weight dim 0 must be 32 (x's last dim), got 16")
    rope = module_of([T([8, 4, 16], f32), T([8], i64)], lambda b, a: b.insert(
        td.make(td.RopeOp, a, [T([8, 4, 16], f32)], theta=1e4, rotary_dim=20)).out)
    _fails(rope, "rotary_dim must be even and <= head_dim (16), got 20")
    rope = module_of([T([8, 4, 16], f32), T([8], f32)], lambda b, a: b.insert(
        td.make(td.RopeOp, a, [T([8, 4, 16], f32)], theta=1e4, rotary_dim=16)).out)
    _fails(rope, "positions must hold i32 or i64, got f32")
    act = module_of([T([8, 30], f32)], lambda b, a: b.insert(td.make(td.SiluAndMulOp, a, [T([8, 16], f32)])).out)
    _fails(act, "result dim 1 must be 15 (half of x's last dim), got 16")
    emb = module_of([T([8], i64), T([50, 32], f32)], lambda b, a: b.insert(
        td.make(td.EmbedOp, a, [T([8, 16], f32)])).out)
    _fails(emb, "result dim 1 must be 32 (the table's hidden size), got 16")
    add = module_of([T([8, 32], f32), T([8, 16], f32)], lambda b, a: b.insert(
        td.make(td.ResidualAddOp, a, [T([8, 32], f32)])).out)
    _fails(add, "a, b and the result must have one type")
    split = module_of([T([8, 60], f32)], lambda b, a: b.insert(td.make(
        td.SplitQkvOp, a, [T([8, 4, 8], f32), T([8, 2, 8], f32), T([8, 2, 8], f32)], num_q_heads=4,
        num_kv_heads=2, head_dim=8)).results[0])
    _fails(split, "qkv dim 1 must be 64 ((num_q_heads + 2 num_kv_heads) head_dim")


def test_fused_ops_verify():
    x, w, nw, pos = T([8, 32], f32), T([64, 32], f32), T([32], f32), T([8], i64)
    ok = module_of([x, nw, w], lambda b, a: b.insert(td.make(td.NormMatmulOp, a, [T([8, 64], f32)], eps=1e-5)).out)
    ok.verify()
    gated = module_of([x, w, nw], lambda b, a: b.insert(td.make(
        td.MatmulSiluMulOp, [a[0], a[1], [a[2]]], [T([8, 32], f32)], eps=1e-5)).out)
    gated.verify()
    no_norm = module_of([x, w], lambda b, a: b.insert(td.make(
        td.MatmulSiluMulOp, [a[0], a[1], []], [T([8, 32], f32)], eps=1e-5)).out)
    _fails(no_norm, "eps is set but there is no norm operand")
    res = module_of([x, w, T([8, 32], f32)], lambda b, a: b.insert(td.make(
        td.MatmulResidualOp, a, [T([8, 64], f32)])).out)
    _fails(res, "residual must have the result's type tensor<8x64xf32>")
    rope = module_of([x, w, pos], lambda b, a: b.insert(td.make(
        td.MatmulRopeOp, [*a, []], [T([8, 4, 8], f32), T([8, 2, 8], f32), T([8, 2, 8], f32)], num_q_heads=4,
        num_kv_heads=2, head_dim=8, theta=1e4, rotary_dim=8)).results[0])
    rope.verify()
    bad = module_of([x, T([80, 32], f32), pos], lambda b, a: b.insert(td.make(
        td.MatmulRopeOp, [*a, []], [T([8, 4, 8], f32), T([8, 2, 8], f32), T([8, 2, 8], f32)], num_q_heads=4,
        num_kv_heads=2, head_dim=8, theta=1e4, rotary_dim=8)).results[0])
    _fails(bad, "w dim 0 must be 64 ((num_q_heads + 2 num_kv_heads) head_dim")


def test_print_parse_round_trip():
    for module in (capture_layer(tiny_config(), 1, 16), capture_model(tiny_config(), None),
                   capture_layer(tiny_config(), 0, 4, "bf16")):
        text = str(module)
        again = td.parse_module(text)
        assert str(again) == text
        assert again.is_structurally_equivalent(module)
    assert "tensor<?x32xf32>" in str(capture_model(tiny_config(), None))
    assert DYNAMIC_INDEX < 0


def test_parse_rejects_invalid_ir_with_the_verifier_message():
    text = str(capture_layer(tiny_config(), 0, 8)).replace('mask = "causal"', 'mask = "diagonal"')
    with pytest.raises(VerifyException, match="tessera.attention: mask must be one of"):
        td.parse_module(text)


@pytest.mark.parametrize("spec", [
    AttentionSpec(4, 2, 16, mask=causal()),
    AttentionSpec(4, 2, 16, mask=causal() & sliding_window(64), score=softcap(20.0), scale=0.5),
    AttentionSpec(4, 4, 16, mask=chunked(32)),
    AttentionSpec(4, 1, 16, mask=prefix_lm(5)),
    AttentionSpec(4, 2, 16),
])
def test_spec_attributes_round_trip(spec):
    shapes = dict(q=(8, spec.num_q_heads, spec.head_dim), k=(8, spec.num_kv_heads, spec.head_dim))
    module = _attention(**shapes, **td.attention_attrs(spec))
    module.verify()
    op = next(o for o in module.walk() if isinstance(o, td.AttentionOp))
    assert td.attention_spec(op).structure_key() == spec.structure_key()


def test_spec_attributes_of_a_model_window_and_runtime_values():
    spec = AttentionSpec(4, 2, 16, mask=causal() & sliding_window(8))
    assert td.attention_attrs(spec)["mask"] == "sliding_window" and td.attention_attrs(spec)["window"] == 8
    module = _attention(has_sinks=True)
    op = next(o for o in module.walk() if isinstance(o, td.AttentionOp))
    with pytest.raises(ValueError, match="sinks are runtime values"):
        td.attention_spec(op)
    assert td.attention_spec(op, placeholders=True).sinks is not None
