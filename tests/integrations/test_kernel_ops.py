"""The kernel library's hot ops as torch custom ops: ``tessera.kernels`` functions inside torch.compile (one graph, no
break, no recompile for a new token count), torch.export (one node per op), opcheck, and equality with eager calls."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from tessera import kernels as K
from tessera.integrations import kernel_ops

HIDDEN, HQ, HKV, D, INTER = 64, 4, 2, 16, 40
ROPE = K.RotaryEmbedding.build(D, 128)
QW = K.quantize(torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(0)), "int4", group_size=32)
NORM_W = torch.linspace(0.5, 1.5, HIDDEN)


class Layerish(torch.nn.Module):
    """Every op once: fused residual norm, plain and Gemma norms, RoPE in place, SwiGLU, a packed int4 matmul."""

    def forward(self, x, residual, q, k, positions, gate_up):
        y, r = K.rms_norm(x, NORM_W, 1e-6, residual=residual)
        y_gemma = K.rms_norm(x, NORM_W, 1e-6, gemma=True)
        q, k = K.apply_rope(q, k, positions, ROPE)
        h = K.silu_and_mul(gate_up)
        return y, r, y_gemma, q + 0, k + 0, h, K.qmatmul(y, QW)


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, HIDDEN, generator=g), torch.randn(tokens, HIDDEN, generator=g),
            torch.randn(tokens, HQ, D, generator=g), torch.randn(tokens, HKV, D, generator=g),
            torch.arange(3, 3 + tokens), torch.randn(tokens, 2 * INTER, generator=g))


def test_compile_fullgraph_matches_eager_without_recompiling() -> None:
    counters.clear()
    model = Layerish()
    cnt = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=cnt)
    for tokens in (5, 11):  # token counts that are none of the static sizes (duck sizing would tie them)
        got, want = compiled(*_inputs(tokens, tokens)), model(*_inputs(tokens, tokens))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert cnt.frame_count == 1
    assert not counters["graph_break"]


def test_rope_rotates_the_callers_tensors_in_place_when_compiled() -> None:
    q, k, pos = torch.randn(3, HQ, D), torch.randn(3, HKV, D), torch.tensor([0, 5, 9])
    q_ref, k_ref = K.apply_rope(q.clone(), k.clone(), pos, ROPE)
    torch.compile(lambda a, b, p: K.apply_rope(a, b, p, ROPE), fullgraph=True, backend=CompileCounter())(q, k, pos)
    torch.testing.assert_close(q, q_ref, rtol=0, atol=0)
    torch.testing.assert_close(k, k_ref, rtol=0, atol=0)


def test_export_keeps_each_op_as_one_node() -> None:
    ep = torch.export.export(Layerish(), _inputs(6, 0))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    for op in ("tessera.fused_add_rms_norm.default", "tessera.rope.default", "tessera.silu_and_mul.default",
               "tessera.qmatmul.default"):
        assert targets.count(op) == 1, (op, targets)
    assert targets.count("tessera.rms_norm.default") == 1, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_opcheck_kernel_ops(dtype: torch.dtype) -> None:
    x, r, q, k, pos, gu = (t.to(dtype) if t.is_floating_point() else t for t in _inputs(4, 1))
    w = NORM_W
    torch.library.opcheck(torch.ops.tessera.rms_norm.default, (x, w, 1e-6, False, "auto"))
    torch.library.opcheck(torch.ops.tessera.fused_add_rms_norm.default, (x, r, w, 1e-6, True, "auto"))
    torch.library.opcheck(torch.ops.tessera.silu_and_mul.default, (gu, "auto"))
    cos, sin = ROPE.tables(q.device)
    torch.library.opcheck(torch.ops.tessera.rope.default, (q, k, pos, cos, sin, ROPE.inv_freq, 1.0, False, "auto"))
    torch.library.opcheck(torch.ops.tessera.qmatmul.default,
                          (x, QW.data, QW.scales, QW.zeros, QW.mins, QW.fmt, QW.group_size, "auto"))


def test_wrappers_equal_the_public_functions() -> None:
    x, r, q, k, pos, gu = _inputs(7, 2)
    torch.testing.assert_close(kernel_ops.rms_norm(x, NORM_W, 1e-5), K.rms_norm(x, NORM_W, 1e-5), rtol=0, atol=0)
    for a, b in zip(kernel_ops.rms_norm(x, NORM_W, 1e-5, residual=r), K.rms_norm(x, NORM_W, 1e-5, residual=r)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(kernel_ops.silu_and_mul(gu), K.silu_and_mul(gu), rtol=0, atol=0)
    torch.testing.assert_close(kernel_ops.qmatmul(x, QW), K.qmatmul(x, QW), rtol=0, atol=0)
    q1, k1 = kernel_ops.apply_rope(q.clone(), k.clone(), pos, ROPE, interleaved=True)
    q2, k2 = K.apply_rope(q.clone(), k.clone(), pos, ROPE, interleaved=True)
    torch.testing.assert_close(q1, q2, rtol=0, atol=0)
    torch.testing.assert_close(k1, k2, rtol=0, atol=0)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        kernel_ops.qmatmul(x, QW.data)
    with pytest.raises(TypeError, match="RotaryEmbedding"):
        kernel_ops.apply_rope(q, k, pos, ROPE.cos)
