"""Each pass on hand-written IR: IR in -> expected IR out (printed text), plus the pipeline on a captured layer."""

from __future__ import annotations

import itertools
import textwrap

import pytest

from tessera.mlir import dialect as td
from tessera.mlir.capture import capture_layer
from tessera.mlir.passes import DEFAULT_PIPELINE, PASSES, AttentionLayout, parse_passes, pipeline
from tests.mlir.helpers import op_names, tiny_config


def _run(passes: str, before: str) -> str:
    """Parse ``before`` (a function body; the arguments are fixed below), run ``passes``, return the body text."""
    head = ("builtin.module {\n  func.func @f(%x: tensor<4x8xf32>, %nw: tensor<8xf32>, %w: tensor<8x8xf32>, "
            "%wgu: tensor<12x8xf32>, %wqkv: tensor<16x8xf32>, %pos: tensor<4xi64>) -> tensor<4x8xf32> {\n")
    module = td.parse_module(head + textwrap.indent(textwrap.dedent(before).strip(), "    ") + "\n  }\n}")
    pipeline(module, passes)
    lines = str(module).splitlines()[2:-2]
    return "\n".join(line.strip() for line in lines)


def _expect(text: str) -> str:
    return "\n".join(line.strip() for line in textwrap.dedent(text).strip().splitlines())


def test_fuse_norm_matmul():
    before = """
        %h = tessera.rms_norm %x, %nw {eps = 1.0e-05 : f64} : tensor<4x8xf32>, tensor<8xf32> -> tensor<4x8xf32>
        %a = tessera.matmul %h, %w : tensor<4x8xf32>, tensor<8x8xf32> -> tensor<4x8xf32>
        %b = tessera.matmul %h, %w : tensor<4x8xf32>, tensor<8x8xf32> -> tensor<4x8xf32>
        %c = tessera.residual_add %a, %b : tensor<4x8xf32>, tensor<4x8xf32> -> tensor<4x8xf32>
        func.return %c : tensor<4x8xf32>
    """
    assert _run("fuse-norm-matmul", before) == _expect("""
        %a = tessera.norm_matmul %x, %nw, %w {eps = 1.000000e-05 : f64} : tensor<4x8xf32>, tensor<8xf32>, tensor<8x8xf32> -> tensor<4x8xf32>
        %b = tessera.norm_matmul %x, %nw, %w {eps = 1.000000e-05 : f64} : tensor<4x8xf32>, tensor<8xf32>, tensor<8x8xf32> -> tensor<4x8xf32>
        %c = tessera.residual_add %a, %b : tensor<4x8xf32>, tensor<4x8xf32> -> tensor<4x8xf32>
        func.return %c : tensor<4x8xf32>
    """)  # noqa: E501


def test_fuse_norm_matmul_keeps_a_norm_with_other_uses():
    before = """
        %h = tessera.rms_norm %x, %nw {eps = 1.0e-05 : f64} : tensor<4x8xf32>, tensor<8xf32> -> tensor<4x8xf32>
        %a = tessera.matmul %h, %w : tensor<4x8xf32>, tensor<8x8xf32> -> tensor<4x8xf32>
        %c = tessera.residual_add %a, %h : tensor<4x8xf32>, tensor<4x8xf32> -> tensor<4x8xf32>
        func.return %c : tensor<4x8xf32>
    """
    assert _run("fuse-norm-matmul", before) == _expect(before.replace("1.0e-05", "1.000000e-05"))


def test_fuse_gated_mlp():
    body = """
        %gu = tessera.matmul %x, %wgu : tensor<4x8xf32>, tensor<12x8xf32> -> tensor<4x12xf32>
        %act = tessera.silu_and_mul %gu : tensor<4x12xf32> -> tensor<4x6xf32>
        %out = tessera.residual_add %act, %act : tensor<4x6xf32>, tensor<4x6xf32> -> tensor<4x6xf32>
        func.return %x : tensor<4x8xf32>
    """
    assert _run("fuse-gated-mlp", body) == _expect("""
        %act = tessera.matmul_silu_mul %x, %wgu : tensor<4x8xf32>, tensor<12x8xf32> -> tensor<4x6xf32>
        %out = tessera.residual_add %act, %act : tensor<4x6xf32>, tensor<4x6xf32> -> tensor<4x6xf32>
        func.return %x : tensor<4x8xf32>
    """)


def test_fuse_residual():
    before = """
        %o = tessera.matmul %x, %w : tensor<4x8xf32>, tensor<8x8xf32> -> tensor<4x8xf32>
        %r = tessera.residual_add %x, %o : tensor<4x8xf32>, tensor<4x8xf32> -> tensor<4x8xf32>
        func.return %r : tensor<4x8xf32>
    """
    assert _run("fuse-residual", before) == _expect("""
        %r = tessera.matmul_residual %x, %w, %x : tensor<4x8xf32>, tensor<8x8xf32>, tensor<4x8xf32> -> tensor<4x8xf32>
        func.return %r : tensor<4x8xf32>
    """)


def test_fuse_residual_keeps_a_matmul_with_other_uses():
    before = """
        %o = tessera.matmul %x, %w : tensor<4x8xf32>, tensor<8x8xf32> -> tensor<4x8xf32>
        %r = tessera.residual_add %x, %o : tensor<4x8xf32>, tensor<4x8xf32> -> tensor<4x8xf32>
        %s = tessera.residual_add %r, %o : tensor<4x8xf32>, tensor<4x8xf32> -> tensor<4x8xf32>
        func.return %s : tensor<4x8xf32>
    """
    assert _run("fuse-residual", before) == _expect(before)


_QKV = """
    %qkv = tessera.matmul %x, %wqkv : tensor<4x8xf32>, tensor<16x8xf32> -> tensor<4x16xf32>
    %q, %k, %v = tessera.split_qkv %qkv {num_q_heads = 2 : i64, num_kv_heads = 1 : i64, head_dim = 4 : i64} : tensor<4x16xf32> -> tensor<4x2x4xf32>, tensor<4x1x4xf32>, tensor<4x1x4xf32>
    %qr = tessera.rope %q, %pos {theta = 1.0e+04 : f64, rotary_dim = 4 : i64} : tensor<4x2x4xf32>, tensor<4xi64> -> tensor<4x2x4xf32>
    %kr = tessera.rope %k, %pos {theta = 1.0e+04 : f64, rotary_dim = 4 : i64} : tensor<4x1x4xf32>, tensor<4xi64> -> tensor<4x1x4xf32>
    %a = tessera.attention %qr, %kr, %v {num_q_heads = 2 : i64, num_kv_heads = 1 : i64, head_dim = 4 : i64, scale = 5.000000e-01 : f64, mask = "causal", score = "none"} : tensor<4x2x4xf32>, tensor<4x1x4xf32>, tensor<4x1x4xf32> -> tensor<4x2x4xf32>
    %m = tessera.merge_heads %a : tensor<4x2x4xf32> -> tensor<4x8xf32>
    func.return %m : tensor<4x8xf32>
"""  # noqa: E501


def test_fuse_rope():
    assert _run("fuse-rope", _QKV) == _expect("""
        %q_rot, %k_rot, %v = tessera.matmul_rope %x, %wqkv, %pos {num_q_heads = 2 : i64, num_kv_heads = 1 : i64, head_dim = 4 : i64, theta = 1.000000e+04 : f64, rotary_dim = 4 : i64} : tensor<4x8xf32>, tensor<16x8xf32>, tensor<4xi64> -> tensor<4x2x4xf32>, tensor<4x1x4xf32>, tensor<4x1x4xf32>
        %a = tessera.attention %q_rot, %k_rot, %v {num_q_heads = 2 : i64, num_kv_heads = 1 : i64, head_dim = 4 : i64, scale = 5.000000e-01 : f64, mask = "causal", score = "none"} : tensor<4x2x4xf32>, tensor<4x1x4xf32>, tensor<4x1x4xf32> -> tensor<4x2x4xf32>
        %m = tessera.merge_heads %a : tensor<4x2x4xf32> -> tensor<4x8xf32>
        func.return %m : tensor<4x8xf32>
    """)  # noqa: E501


def test_fuse_rope_needs_matching_ropes():
    other_theta = _QKV.replace("%k, %pos {theta = 1.0e+04", "%k, %pos {theta = 5.0e+05")
    assert "tessera.matmul_rope" not in _run("fuse-rope", other_theta)


def test_fuse_rope_takes_the_norm_prologue():
    normed = _QKV.replace("tessera.matmul %x, %wqkv : tensor<4x8xf32>, tensor<16x8xf32>",
                          "tessera.norm_matmul %x, %nw, %wqkv {eps = 1.0e-05 : f64} : tensor<4x8xf32>, "
                          "tensor<8xf32>, tensor<16x8xf32>")
    out = _run("fuse-rope", normed)
    assert ("%q_rot, %k_rot, %v = tessera.matmul_rope %x, %wqkv, %pos norm(%nw : tensor<8xf32>) {" in out
            and "eps = 1.000000e-05 : f64}" in out)


@pytest.mark.parametrize("kv", ["token", "head"])
def test_attention_layout(kv):
    out = _run(f"attention-layout{{kv={kv}}}", _QKV)
    assert f'mask = "causal", score = "none", kv_layout = "{kv}"}}' in out


def test_attention_layout_rejects_unknown_layouts():
    with pytest.raises(ValueError, match=r"kv must be one of \['token', 'head'\], got 'paged'"):
        AttentionLayout(kv="paged")
    with pytest.raises(ValueError, match="known passes: fuse-norm-matmul"):
        parse_passes("fuse-everything")


def test_pipeline_on_a_captured_layer():
    module = capture_layer(tiny_config(), 1, 16)
    seen = []
    pipeline(module, "all", lambda p, m: seen.append(p.name))
    assert seen == DEFAULT_PIPELINE.split(",") == [*PASSES]
    assert op_names(module) == ["tessera.matmul_rope", "tessera.attention", "tessera.merge_heads",
                                "tessera.matmul_residual", "tessera.matmul_silu_mul", "tessera.matmul_residual",
                                "func.return"]
    attention = next(op for op in module.walk() if op.name == "tessera.attention")
    assert attention.kv_layout.data == "token" and attention.schedule_row_ptr.get_values() == (0, 1)
    rope = next(iter(next(iter(module.body.block.ops)).body.block.ops))
    assert rope.norm_weight is not None and rope.norm_weight.name_hint == "l1_attn_norm"


def test_fusions_commute():
    fusions = DEFAULT_PIPELINE.split(",")[:-2]  # the last two annotate attention
    results = {str(pipeline(capture_layer(tiny_config(), 0, 8), list(order)))
               for order in itertools.permutations(fusions)}
    assert len(results) == 1


def test_no_passes_leaves_the_module_alone():
    module = capture_layer(tiny_config(), 0, 8)
    text = str(module)
    assert str(pipeline(module, "none")) == text
