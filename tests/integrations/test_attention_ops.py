"""``tessera::attention`` / ``tessera::varlen_attention`` as torch custom ops: torch.compile without graph breaks or
recompiles, torch.export as one node, the spec handle table, opcheck.

Compiles are few and tiny (torch.compile is slow on two cores): one inductor compile for the headline case, the
rest through Dynamo's counting backend, which traces exactly as inductor's front end does but runs the graph eagerly.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

from tessera.attention import AttentionSpec, attention, causal, custom_mask, custom_score, sliding_window, softcap
from tessera.attention import varlen_attention
from tessera.integrations import spec_handles
from tessera.integrations.torch_ops import register_spec

from tests.attention.tolerances import TOLERANCES, rel_err


def dilated_causal(b, h, q_pos, kv_pos):
    """Causal, skipping every third distance (a pattern no built-in mask has)."""
    return (kv_pos <= q_pos) & ((q_pos - kv_pos) % 3 != 1)


def head_bias(score, b, h, q_pos, kv_pos):
    """A per-head temperature and distance bias."""
    return score * (0.5 + 0.25 * h) - 0.02 * (q_pos - kv_pos)


class Block(torch.nn.Module):
    """Projection -> Tessera attention with a custom mask, a score function and sinks -> projection."""

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.hq, self.hkv, self.d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
        width = (self.hq + 2 * self.hkv) * self.d
        gen = torch.Generator().manual_seed(0)
        self.qkv = torch.nn.Parameter(torch.randn(width, 32, generator=gen) * 0.2)
        self.out = torch.nn.Parameter(torch.randn(32, self.hq * self.d, generator=gen) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (x @ self.qkv.T).split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        o = attention(q.view(b, s, self.hq, self.d), k.view(b, s, self.hkv, self.d),
                      v.view(b, s, self.hkv, self.d), self.spec)
        return o.reshape(b, s, -1) @ self.out.T


def _spec(sinks: bool = True) -> AttentionSpec:
    return AttentionSpec(4, 2, 8, mask=custom_mask(dilated_causal), score=custom_score(head_bias),
                         sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]) if sinks else None)


def _x(seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, seq, 32, generator=torch.Generator().manual_seed(seed))


def test_inductor_fullgraph_no_graph_break_no_recompile_matches_eager() -> None:
    counters.clear()
    block = Block(_spec())
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=cnt)
    with torch.no_grad():
        for seq in (7, 12):  # the second length must reuse the first graph
            x = _x(seq, seq)
            got, want = compiled(x), block(x)
            err = rel_err(got, want)
            assert err <= TOLERANCES[torch.float32], f"S={seq}: compiled vs eager error {err:.3g}"
    assert cnt.frame_count == 1, f"expected one compiled graph, got {cnt.frame_count} (a recompile)"
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"


def test_mark_dynamic_also_avoids_the_recompile() -> None:
    block = Block(_spec(sinks=False))
    cnt = CompileCounter()
    compiled = torch.compile(block, fullgraph=True, backend=cnt)
    with torch.no_grad():
        for seq in (5, 9, 14):
            x = _x(seq)
            torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(compiled(x), block(x), rtol=0, atol=0)
    assert cnt.frame_count == 1


def test_spec_objects_are_guarded_a_new_spec_recompiles_and_is_used() -> None:
    block = Block(_spec(sinks=False))
    cnt = CompileCounter()
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=cnt)
    x = _x(6)
    with torch.no_grad():
        first = compiled(x)
        block.spec = AttentionSpec(4, 2, 8, mask=sliding_window(2), score=softcap(3.0))
        second = compiled(x)
        torch.testing.assert_close(second, block(x), rtol=0, atol=0)
    assert not torch.equal(first, second)
    assert cnt.frame_count == 2


def test_varlen_compiles_with_tensor_lengths_without_recompiling() -> None:
    spec = AttentionSpec(4, 1, 8, mask=causal() & custom_mask(dilated_causal))
    cnt = CompileCounter()

    def fn(q, k, v, q_lens, kv_lens):
        return varlen_attention(q, k, v, q_lens, kv_lens, spec) * 2

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=cnt)
    gen = torch.Generator().manual_seed(1)
    # Totals avoid the head counts and head_dim: Dynamo's duck sizing gives equal sizes one symbol, and the heads'
    # static value would then pin the token count too (docs/integrations.md says so).
    for q_lens, kv_lens in (([3, 2], [5, 9]), ([2, 4, 1], [2, 7, 11])):
        q = torch.randn(sum(q_lens), 4, 8, generator=gen)
        k, v = (torch.randn(sum(kv_lens), 1, 8, generator=gen) for _ in range(2))
        ql, kl = torch.tensor(q_lens), torch.tensor(kv_lens)
        torch.testing.assert_close(compiled(q, k, v, ql, kl), fn(q, k, v, q_lens, kv_lens), rtol=0, atol=0)
    assert cnt.frame_count == 1


def test_export_keeps_dense_and_varlen_attention_as_single_nodes() -> None:
    spec = _spec()

    class Both(torch.nn.Module):
        def forward(self, q, k, v, qr, kr, vr, q_lens, kv_lens):
            return attention(q, k, v, spec), varlen_attention(qr, kr, vr, q_lens, kv_lens, spec)

    gen = torch.Generator().manual_seed(2)
    args = (torch.randn(1, 5, 4, 8, generator=gen), torch.randn(1, 9, 2, 8, generator=gen),
            torch.randn(1, 9, 2, 8, generator=gen), torch.randn(4, 4, 8, generator=gen),
            torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen),
            torch.tensor([3, 1]), torch.tensor([4, 2]))
    ep = torch.export.export(Both(), args)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count("tessera.attention.default") == 1, targets
    assert targets.count("tessera.varlen_attention.default") == 1, targets
    assert not any("aten.matmul" in t or "aten.bmm" in t or "softmax" in t for t in targets), targets
    got = ep.module()(*args)
    want = Both()(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_handles_dedupe_by_structure_and_keep_custom_specs_by_identity() -> None:
    a = register_spec(AttentionSpec(8, 2, 64, mask=causal(), score=softcap(30.0)))
    b = register_spec(AttentionSpec(8, 2, 64, mask=causal(), score=softcap(30.0), sinks=torch.zeros(8)))
    assert a == b, "specs of one structure (sinks travel separately) share a handle"
    assert spec_handles.lookup_spec(b).sinks is None
    custom = _spec(sinks=False)
    h = register_spec(custom)
    assert register_spec(custom) == h
    assert register_spec(_spec(sinks=False)) != h, "a different object holding callables gets its own entry"
    before = spec_handles.num_registered()
    for _ in range(3):
        register_spec(AttentionSpec(8, 2, 64, mask=causal(), score=softcap(30.0)))
    assert spec_handles.num_registered() == before
    sinks = torch.ones(4)
    assert spec_handles.lookup_spec(h, sinks).sinks is sinks
    spec_handles.release(h)
    with pytest.raises(KeyError, match="no AttentionSpec is registered under handle"):
        spec_handles.lookup_spec(h)


def test_eager_calls_do_not_grow_the_table() -> None:
    spec = _spec()
    before = spec_handles.num_registered()
    q = torch.randn(1, 4, 4, 8, requires_grad=True)
    k, v = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    for _ in range(3):
        attention(q, k, v, _spec()).sum().backward()  # a fresh spec with callables per call
        with torch.no_grad():
            attention(q, k, v, spec)
    assert spec_handles.num_registered() == before


@pytest.mark.parametrize("sinks", [False, True], ids=["no_sinks", "sinks"])
def test_opcheck_attention_ops(sinks: bool) -> None:
    spec = _spec(sinks=False)
    handle = register_spec(spec)
    gen = torch.Generator().manual_seed(3)
    s = torch.randn(4, generator=gen, requires_grad=True) if sinks else None
    q = torch.randn(2, 3, 4, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 5, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    torch.library.opcheck(torch.ops.tessera.attention.default, (q, k, v, s, handle, "auto"))
    cu_q, cu_kv = torch.tensor([0, 2, 3]), torch.tensor([0, 4, 9])
    torch.library.opcheck(torch.ops.tessera.varlen_attention.default,
                          (q[0].detach().requires_grad_(), k.reshape(10, 2, 8)[:9].detach().requires_grad_(),
                           v.reshape(10, 2, 8)[:9].detach().requires_grad_(), cu_q, cu_kv, s, handle, "auto"))


def test_op_errors_say_what_was_expected() -> None:
    handle = register_spec(AttentionSpec(4, 2, 8, mask=causal()))
    q, k = torch.randn(3, 4, 8), torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match="start at 0 and never decrease"):
        torch.ops.tessera.varlen_attention(q, k, k, torch.tensor([1, 3]), torch.tensor([0, 5]), None, handle, "auto")
    with pytest.raises(TypeError, match="1-D integer tensor"):
        torch.ops.tessera.varlen_attention(q, k, k, torch.tensor([0.0, 3.0]), torch.tensor([0, 5]), None, handle,
                                           "auto")
    with pytest.raises(KeyError, match="register_spec"):
        torch.ops.tessera.attention(q[None], k[None], k[None], None, 10**9, "auto")
    with FakeTensorMode(), pytest.raises(ValueError, match="do not match"):  # caught while tracing, not at run time
        fake_q, fake_k = torch.empty(1, 3, 4, 16), torch.empty(1, 5, 2, 16)
        torch.ops.tessera.attention(fake_q, fake_k, fake_k, None, handle, "auto")
