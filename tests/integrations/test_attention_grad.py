"""The attention backward (dq, dk, dv, dsinks) against torch.autograd on the float64 oracle, over the conformance
variants, dense and ragged layouts, GQA ratios 1 / 2 / 3 / 4 (MQA), odd lengths and queries that are a suffix of the
kv; float32 on every variant, bfloat16 on the low-precision subset of the conformance suite."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.attention import AttentionSpec, attention, causal, custom_mask, varlen_attention
from tessera.backends import RaggedBatch
from tessera.backends.reference import varlen_attention_f64

from tests.attention.cases import VARIANTS, Layout, dense_layout, make_inputs, varlen_layout
from tests.attention.conftest import _LOW_PRECISION_VARIANTS
from tests.attention.tolerances import TOLERANCES, rel_err

LAYOUTS = [
    pytest.param(dense_layout(2, 19, 19, 4, 2, 16), id="dense_gqa2"),
    pytest.param(dense_layout(1, 5, 23, 6, 2, 8), id="dense_suffix_gqa3"),
    pytest.param(varlen_layout([7, 1, 0, 12], [7, 18, 3, 12], 4, 1, 16), id="varlen_mqa"),
    pytest.param(varlen_layout([9, 4], [9, 17], 2, 2, 8), id="varlen_mha"),
]
CASES = [pytest.param(v, torch.float32, id=f"{v.name}-float32") for v in VARIANTS] + [
    pytest.param(v, torch.bfloat16, id=f"{v.name}-bfloat16") for v in VARIANTS if v.name in _LOW_PRECISION_VARIANTS]


def _flat(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    return t.reshape(-1, *t.shape[2:]) if layout.dense else t


def _loss(out: torch.Tensor, lse: torch.Tensor, g_out: torch.Tensor, g_lse: torch.Tensor) -> torch.Tensor:
    # lse is -inf on fully masked rows without sinks; they take no part (0 * -inf would be NaN)
    return (out.double() * g_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0).double() * g_lse).sum()


def oracle_grads(q, k, v, spec: AttentionSpec, layout: Layout, g_out, g_lse) -> dict[str, torch.Tensor]:
    """torch.autograd through the float64 oracle on the same inputs upcast (the sinks too)."""
    leaves = {n: _flat(t, layout).detach().double().requires_grad_() for n, t in (("q", q), ("k", k), ("v", v))}
    if spec.sinks is not None:
        leaves["sinks"] = spec.sinks.detach().double().requires_grad_()
        spec = dataclasses.replace(spec, sinks=leaves["sinks"])
    out, lse = varlen_attention_f64(leaves["q"], leaves["k"], leaves["v"], RaggedBatch(layout.q_lens, layout.kv_lens),
                                    spec)
    _loss(out, lse, _flat(g_out, layout), _flat(g_lse, layout)).backward()
    return {n: t.grad for n, t in leaves.items()}


def tessera_grads(q, k, v, spec: AttentionSpec, layout: Layout, g_out, g_lse) -> dict[str, torch.Tensor]:
    leaves = {n: t.detach().clone().requires_grad_() for n, t in (("q", q), ("k", k), ("v", v))}
    if spec.sinks is not None:
        leaves["sinks"] = spec.sinks.detach().clone().requires_grad_()
        spec = dataclasses.replace(spec, sinks=leaves["sinks"])
    if layout.dense:
        out, lse = attention(leaves["q"], leaves["k"], leaves["v"], spec, return_lse=True)
    else:
        out, lse = varlen_attention(leaves["q"], leaves["k"], leaves["v"], list(layout.q_lens), list(layout.kv_lens),
                                    spec, return_lse=True)
    _loss(out, lse, g_out, g_lse).backward()
    return {n: _flat(t.grad, layout) if n != "sinks" else t.grad for n, t in leaves.items()}


def _cotangents(q: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(q.shape, generator=gen, dtype=torch.float64),
            torch.randn(q.shape[:-1], generator=gen, dtype=torch.float64))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("variant", "dtype"), CASES)
def test_grads_match_float64_oracle(variant, dtype: torch.dtype, layout: Layout, gen: torch.Generator) -> None:
    spec = variant.spec(layout, gen)
    q, k, v = make_inputs(layout, dtype, gen)
    g_out, g_lse = _cotangents(q, gen)
    want = oracle_grads(q, k, v, spec, layout, g_out, g_lse)
    got = tessera_grads(q, k, v, spec, layout, g_out, g_lse)
    assert set(got) == set(want)
    for name, ref in want.items():
        assert got[name] is not None, f"no gradient reached {name}"
        assert got[name].dtype == (torch.float32 if name == "sinks" else dtype), name
        assert torch.isfinite(got[name]).all(), f"non-finite d{name}"
        err = rel_err(got[name], ref)
        assert err <= TOLERANCES[dtype], f"d{name}: error {err:.3g} > {TOLERANCES[dtype]:g} ({dtype}, {spec!r})"


def test_compiled_backward_matches_eager(gen: torch.Generator) -> None:
    """Under torch.compile the backward is the tessera::attention_backward op (one node), with the same numbers."""
    spec = AttentionSpec(4, 2, 8, mask=custom_mask(lambda b, h, q_pos, kv_pos: (kv_pos <= q_pos) & (kv_pos % 4 != 1)),
                         sinks=torch.randn(4, generator=gen))
    layout = dense_layout(2, 9, 9, 4, 2, 8)
    q, k, v = make_inputs(layout, torch.float32, gen)
    g_out, g_lse = _cotangents(q, gen)
    eager = tessera_grads(q, k, v, spec, layout, g_out, g_lse)

    sinks = spec.sinks.detach().clone().requires_grad_()
    traced_spec = dataclasses.replace(spec, sinks=sinks)  # built outside the compiled function, as users must

    def plain(q, k, v):
        out, lse = attention(q, k, v, traced_spec, return_lse=True)
        return _loss(out, lse, g_out, g_lse)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.compile(plain, fullgraph=True, backend="aot_eager")(*leaves).backward()
    for name, leaf in zip("qkv", leaves):
        torch.testing.assert_close(_flat(leaf.grad, layout), eager[name], rtol=0, atol=0)
    torch.testing.assert_close(sinks.grad, eager["sinks"], rtol=0, atol=0)


def test_fully_masked_rows_get_zero_gradients_not_nan(gen: torch.Generator) -> None:
    spec = AttentionSpec(2, 1, 8, mask=causal() & custom_mask(lambda b, h, q_pos, kv_pos: q_pos >= 3))
    q = torch.randn(1, 6, 2, 8, generator=gen, requires_grad=True)
    k = torch.randn(1, 6, 1, 8, generator=gen, requires_grad=True)
    v = torch.randn(1, 6, 1, 8, generator=gen, requires_grad=True)
    out, lse = attention(q, k, v, spec, return_lse=True)
    assert torch.isneginf(lse[0, :3]).all()
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    assert (q.grad[0, :3] == 0).all(), "masked query rows have no gradient"


def test_compiled_backward_of_transposed_views(gen: torch.Generator) -> None:
    """Inputs as transformers holds them ([B, H, S, D] transposed to [B, S, H, D] views): same gradients compiled
    (aot_eager) as eager."""
    spec = AttentionSpec(4, 2, 8, mask=causal())
    heads_first = [torch.randn(2, h, 7, 8, generator=gen) for h in (4, 2, 2)]

    def loss(q, k, v):
        return attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec).square().sum()

    eager = [t.clone().requires_grad_() for t in heads_first]
    loss(*eager).backward()
    compiled = [t.clone().requires_grad_() for t in heads_first]
    torch.compile(loss, fullgraph=True, dynamic=True, backend="aot_eager")(*compiled).backward()
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
