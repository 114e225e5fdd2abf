"""``tessera::paged_attention``: plan + run as one op, compiled once for every step's lengths and page table."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

from tessera.attention import AttentionSpec, causal, plan
from tessera.integrations import spec_handles
from tessera.integrations.torch_ops import paged_attention
from tests.attention.cases import varlen_layout
from tests.attention.test_paged import paged_inputs
from tests.attention.tolerances import assert_matches_oracle

PAGE = 8
SPEC = AttentionSpec(4, 2, 16, mask=causal())


def step(q_lens, kv_lens, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k_pages, v_pages, table, _, _ = paged_inputs(varlen_layout(q_lens, kv_lens, 4, 2, 16), PAGE, torch.float32,
                                                    gen)
    return q, k_pages, v_pages, torch.tensor(q_lens), torch.tensor(kv_lens), table


def test_op_equals_plan_run():
    q, k, v, ql, kl, table = step([1, 3, 1], [20, 9, 33], 0)
    out, lse = paged_attention(q, k, v, ql, kl, table, SPEC, PAGE, return_lse=True)
    ref_out, ref_lse = plan(SPEC, ql.tolist(), kl.tolist(), table, PAGE).run(q, k, v, return_lse=True)
    assert_matches_oracle(out, lse, ref_out.double(), ref_lse.double(), torch.float32, "op vs plan.run")
    assert torch.equal(out, ref_out)


def test_compiled_once_for_every_step():
    """New lengths, a new page table and a new number of sequences run the same graph: they are tensors."""
    counters.clear()
    cnt = CompileCounter()

    @torch.compile(backend=cnt, fullgraph=True, dynamic=True)
    def layer(q, k, v, ql, kl, table):
        return paged_attention(q * 1.0, k, v, ql, kl, table, SPEC, PAGE)

    # (sizes chosen so no two dims coincide: Dynamo's duck sizing would tie them and recompile when they part)
    steps = [([1, 3, 1], [20, 9, 41]), ([2, 1], [17, 40]), ([1, 1, 1, 1], [5, 6, 7, 64])]
    for seed, (q_lens, kv_lens) in enumerate(steps):
        q, k, v, ql, kl, table = step(q_lens, kv_lens, seed)
        got = layer(q, k, v, ql, kl, table)
        want = plan(SPEC, q_lens, kv_lens, table, PAGE).run(q, k, v)
        assert torch.equal(got, want)
    assert cnt.frame_count == 1, f"compiled {cnt.frame_count} times"
    assert not counters["graph_break"]


def test_export_keeps_one_node_and_fake_shapes_are_checked():
    q, k, v, ql, kl, table = step([1, 2], [12, 30], 3)

    class Layer(torch.nn.Module):
        def forward(self, q, k, v, ql, kl, table):
            return paged_attention(q, k, v, ql, kl, table, SPEC, PAGE)

    graph = torch.export.export(Layer(), (q, k, v, ql, kl, table)).graph
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert targets.count("tessera.paged_attention.default") == 1
    torch.library.opcheck(torch.ops.tessera.paged_attention.default,
                          (q, k, v, ql, kl, table, None, spec_handles.register_spec(SPEC), PAGE, "auto"))
    narrow_k, narrow_v = k[:, :4].contiguous(), v[:, :4].contiguous()  # pages of 4 tokens, the spec says 8
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="k_pages and v_pages must be"):
        fake = [mode.from_tensor(t) for t in (q, narrow_k, narrow_v, ql, kl, table)]
        torch.ops.tessera.paged_attention(*fake, None, spec_handles.register_spec(SPEC), PAGE, "auto")
    with pytest.raises(TypeError, match="q_lens must be a 1-D integer tensor"):
        paged_attention(q, k, v, ql.float(), kl, table, SPEC, PAGE)
