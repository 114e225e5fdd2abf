"""Conformance of the mixture-of-experts ops: every backend against the float64 oracles, and ``moe_mlp`` against
small random-weight transformers ``MixtralSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock`` built offline."""

from __future__ import annotations

import pytest
import torch

from tessera.backends.reference.ops import moe as ref
from tessera.kernels import moe
from tests.kernels.conftest import kernel_backends
from tests.kernels.tolerances import assert_close_to_oracle

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = kernel_backends()
# (T, E, k): decode, odd T with odd E, k = 1, k = E, no tokens
ROUTE_SHAPES = [(1, 8, 2), (37, 7, 3), (5, 6, 1), (6, 5, 5), (0, 4, 2)]
ROUTE_MODES = [("topk_softmax", False), ("softmax_topk", False), ("softmax_topk", True)]


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _ids_with_idle_experts(gen: torch.Generator, num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    """Distinct expert ids per token that never use the last expert nor expert 1 (groups of zero tokens)."""
    allowed = torch.tensor([e for e in range(num_experts) if e not in (1, num_experts - 1)])
    assert allowed.numel() >= top_k
    picks = torch.rand(num_tokens, allowed.numel(), generator=gen).argsort(dim=1)[:, :top_k]
    return allowed[picks]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,renormalize", ROUTE_MODES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k", ROUTE_SHAPES)
def test_route(backend, dtype, mode, renormalize, num_tokens, num_experts, top_k, gen):
    logits = _randn(gen, num_tokens, num_experts, dtype=dtype, scale=2.0)
    weights, ids = moe.route(logits, top_k, mode=mode, renormalize=renormalize, backend=backend)
    ref_w, ref_ids = ref.route_f64(logits, top_k, mode, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids), "expert ids differ from the oracle's"
    assert_close_to_oracle(weights, ref_w, torch.float32, f"route {mode}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["topk_softmax", "softmax_topk"])
def test_route_ties_go_to_the_lowest_id(backend, mode):
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0], [-1.0, 3.0, -1.0, 3.0, -1.0]])
    _, ids = moe.route(logits, 3, mode=mode, backend=backend)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [1, 3, 0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_route_matches_transformers_routers(backend, gen):
    """Mixtral's router (softmax, top-k, renormalize) and Qwen2-MoE's (norm_topk_prob off), on fp32 logits."""
    logits = _randn(gen, 19, 8, scale=2.0)
    probs = torch.softmax(logits, dim=-1)
    top, top_ids = torch.topk(probs, 2, dim=-1)
    w, ids = moe.route(logits, 2, mode="topk_softmax", backend=backend)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(w, top / top.sum(-1, keepdim=True))
    w, ids = moe.route(logits, 2, mode="softmax_topk", renormalize=False, backend=backend)
    torch.testing.assert_close(w, top)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden,num_experts,top_k", [(1, 33, 8, 2), (23, 65, 6, 3), (9, 17, 5, 1),
                                                                  (0, 16, 4, 2)])
def test_permute(backend, dtype, num_tokens, hidden, num_experts, top_k, gen):
    x = _randn(gen, num_tokens, hidden, dtype=dtype)
    ids = _ids_with_idle_experts(gen, num_tokens, num_experts, top_k)
    x_sorted, offsets, inverse = moe.permute(x, ids, num_experts, backend=backend)
    ref_x, ref_offsets, ref_inverse = ref.permute_f64(x, ids, num_experts)
    assert x_sorted.dtype == dtype and offsets.dtype == torch.int64 and inverse.dtype == torch.int64
    assert torch.equal(x_sorted.double(), ref_x), "a permute moves data: it must be exact"
    assert torch.equal(offsets, ref_offsets) and torch.equal(inverse, ref_inverse)
    bounds = offsets.tolist()
    assert bounds[2] == bounds[1] and bounds[-1] == bounds[-2], "idle experts must own empty groups"
    assert torch.equal(x_sorted[inverse], x.unsqueeze(1).expand(-1, top_k, -1))
    for e in range(num_experts):  # stable: token order inside each group
        tokens = torch.div(torch.nonzero(ids.reshape(-1) == e).squeeze(1), top_k, rounding_mode="floor")
        assert torch.equal(x_sorted[bounds[e]:bounds[e + 1]], x[tokens])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes,k,n", [([1], 33, 17), ([0, 19, 0, 3, 40], 65, 47), ([5, 0, 0], 16, 32), ([0, 0], 8, 9)])
def test_grouped_matmul(backend, dtype, sizes, k, n, gen):
    x = _randn(gen, sum(sizes), k, dtype=dtype)
    w = _randn(gen, len(sizes), n, k, dtype=dtype, scale=k ** -0.5)
    offsets = torch.tensor([0] + sizes).cumsum(0)
    out = moe.grouped_matmul(x, w, offsets, backend=backend)
    assert out.dtype == dtype
    assert_close_to_oracle(out, ref.grouped_matmul_f64(x, w, offsets), dtype, "grouped_matmul", reduction=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden,top_k", [(1, 33, 2), (13, 150, 3), (7, 16, 1), (0, 8, 2)])
def test_combine(backend, dtype, num_tokens, hidden, top_k, gen):
    y = _randn(gen, num_tokens * top_k, hidden, dtype=dtype)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    inverse = torch.randperm(num_tokens * top_k, generator=gen).view(num_tokens, top_k)
    out = moe.combine(y, weights, inverse, backend=backend)
    assert out.dtype == dtype
    assert_close_to_oracle(out, ref.combine_f64(y, weights, inverse), dtype, "combine")


def _experts(gen, num_experts, hidden, inter, dtype):
    gate_up = _randn(gen, num_experts, 2 * inter, hidden, dtype=dtype, scale=hidden ** -0.5)
    down = _randn(gen, num_experts, hidden, inter, dtype=dtype, scale=inter ** -0.5)
    return gate_up, down


def _shared(gen, hidden, inter, dtype, gated=True):
    return moe.SharedExpert(_randn(gen, 2 * inter, hidden, dtype=dtype, scale=hidden ** -0.5),
                            _randn(gen, hidden, inter, dtype=dtype, scale=inter ** -0.5),
                            _randn(gen, hidden, scale=hidden ** -0.5) if gated else None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k,mode,shared", [
    (1, 33, 19, 8, 2, "topk_softmax", None),
    (21, 40, 24, 6, 3, "softmax_topk", "gated"),
    (11, 17, 9, 4, 4, "softmax_topk", "ungated"),
    (9, 24, 16, 5, 1, "topk_softmax", None),
    (0, 16, 8, 4, 2, "softmax_topk", "gated"),
])
def test_moe_mlp(backend, dtype, num_tokens, hidden, inter, num_experts, top_k, mode, shared, gen):
    x = _randn(gen, num_tokens, hidden, dtype=dtype)
    gate_up, down = _experts(gen, num_experts, hidden, inter, dtype)
    logits = _randn(gen, num_tokens, num_experts, dtype=dtype, scale=2.0)
    sh = _shared(gen, hidden, 2 * inter - 1, dtype, gated=shared == "gated") if shared else None
    out = moe.moe_mlp(x, gate_up, down, logits, top_k, mode, True, shared=sh, backend=backend)
    expected = ref.moe_mlp_f64(x, gate_up, down, logits, top_k, mode, True, sh)
    assert out.dtype == dtype
    assert_close_to_oracle(out, expected, dtype, "moe_mlp", reduction=True)


def test_moe_mlp_idle_experts_and_pipeline_agree(gen):
    """The public pipeline (route, permute, grouped_matmul, combine) equals moe_mlp, with experts left idle."""
    x = _randn(gen, 6, 24)
    gate_up, down = _experts(gen, 8, 24, 12, torch.float32)
    logits = _randn(gen, 6, 8)
    logits[:, 5:] -= 100.0  # experts 5..7 receive no token
    w, ids = moe.route(logits, 2, mode="topk_softmax", backend="cpu")
    xs, offsets, inverse = moe.permute(x, ids, 8, backend="cpu")
    assert offsets[5:].eq(offsets[-1]).all()
    gate, up = moe.grouped_matmul(xs, gate_up, offsets, backend="cpu").chunk(2, dim=-1)
    ys = moe.grouped_matmul(torch.nn.functional.silu(gate) * up, down, offsets, backend="cpu")
    torch.testing.assert_close(moe.combine(ys, w, inverse, backend="cpu"),
                               moe.moe_mlp(x, gate_up, down, logits, 2, "topk_softmax", backend="cpu"))


# ------------------------------------------------------------------------------------------ against transformers

def _hf_block(kind: str, hidden: int, inter: int, num_experts: int, top_k: int, norm: bool = False):
    torch.manual_seed(1234)
    if kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts,
                            num_experts_per_tok=top_k)
        block = MixtralSparseMoeBlock(cfg)
    else:
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        cfg = Qwen2MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, shared_expert_intermediate_size=2 * inter,
                             num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=norm)
        block = Qwen2MoeSparseMoeBlock(cfg)
    for p in block.parameters():  # parameters are created empty; fill every one
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    return block.eval()


def _hf_shared(block) -> moe.SharedExpert:
    mlp = block.shared_expert
    return moe.SharedExpert(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight,
                            block.shared_expert_gate.weight[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,norm", [("mixtral", None), ("qwen2_moe", False), ("qwen2_moe", True)])
def test_moe_mlp_matches_transformers(backend, kind, norm, gen):
    block = _hf_block(kind, hidden=48, inter=40, num_experts=6, top_k=2, norm=bool(norm))
    x = _randn(gen, 2, 9, 48)
    with torch.no_grad():
        expected = block(x).reshape(18, 48)
        h = x.reshape(18, 48)
        logits = h @ block.gate.weight.T
        if kind == "mixtral":
            out = moe.moe_mlp(h, block.experts.gate_up_proj, block.experts.down_proj, logits, 2, "topk_softmax",
                              backend=backend)
        else:
            out = moe.moe_mlp(h, block.experts.gate_up_proj, block.experts.down_proj, logits, 2, "softmax_topk",
                              norm, shared=_hf_shared(block), backend=backend)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu"])
def test_moe_mlp_matches_transformers_bf16(backend, gen):
    block = _hf_block("qwen2_moe", hidden=64, inter=32, num_experts=8, top_k=4).to(torch.bfloat16)
    x = _randn(gen, 1, 12, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = block(x).reshape(12, 64)
        h = x.reshape(12, 64)
        logits = h @ block.gate.weight.T
        out = moe.moe_mlp(h, block.experts.gate_up_proj, block.experts.down_proj, logits, 4, "softmax_topk",
                          False, shared=_hf_shared(block), backend=backend)
    assert (out.float() - expected.float()).abs().max() <= 3e-2 * expected.float().abs().max()


# ------------------------------------------------------------------------------------------ errors

def test_errors_name_the_problem_and_the_fix():
    x, logits = torch.randn(4, 8), torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, E=3\], got 4"):
        moe.route(logits, 4)
    with pytest.raises(ValueError, match="mode must be one of .* got 'softmax' \\(Mixtral: 'topk_softmax'"):
        moe.route(logits, 2, mode="softmax")
    with pytest.raises(ValueError, match="router_logits must be float32, bfloat16 or float16, got torch.int64"):
        moe.route(torch.zeros(4, 3, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match=r"expert_ids values must lie in \[0, 3\), got \[0, 3\]"):
        moe.permute(x, torch.tensor([[0], [1], [2], [3]]), 3)
    with pytest.raises(ValueError, match=r"expert_ids must be an int64 \[T=4, k\]"):
        moe.permute(x, torch.zeros(4, 2), 3)
    with pytest.raises(ValueError, match="weights must have x's dtype torch.float32, got torch.bfloat16"):
        moe.grouped_matmul(x, torch.randn(2, 5, 8, dtype=torch.bfloat16), torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match=r"weights must be \[E, N, K\] with K = x_sorted.shape\[1\] = 8"):
        moe.grouped_matmul(x, torch.randn(2, 8, 5), torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match=r"must rise from 0 to the row count 4 without decreasing, got \[0, 3, 2\]"):
        moe.grouped_matmul(x, torch.randn(2, 5, 8), torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match=r"expert_offsets must be int64 \[E\+1\] = \[3\]"):
        moe.grouped_matmul(x, torch.randn(2, 5, 8), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="T\\*k = 6 rows were expected"):
        moe.combine(x, torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"inverse must be int64 \[T, k\] = \(2, 2\)"):
        moe.combine(x, torch.rand(2, 2), torch.zeros(2, 2, dtype=torch.int32))


def test_moe_mlp_errors():
    x, logits = torch.randn(4, 8), torch.randn(4, 3)
    gate_up, down = torch.randn(3, 10, 8), torch.randn(3, 8, 5)
    with pytest.raises(ValueError, match=r"down must be \[E, H, I\] = \(3, 8, 5\), got \(3, 5, 8\)"):
        moe.moe_mlp(x, gate_up, down.transpose(1, 2), logits, 2)
    with pytest.raises(ValueError, match=r"gate_up must be \[E, 2I, H\] .* gate rows first, then up"):
        moe.moe_mlp(x, torch.randn(3, 9, 8), down, logits, 2)
    with pytest.raises(ValueError, match=r"router_logits must be \[T, E\] = \(4, 3\), got \(4, 2\)"):
        moe.moe_mlp(x, gate_up, down, torch.randn(4, 2), 2)
    with pytest.raises(ValueError, match="backend 'nope'"):
        moe.moe_mlp(x, gate_up, down, logits, 2, backend="nope")
    with pytest.raises(ValueError, match=r"SharedExpert.down must be \[H, I_s\] = \(8, 3\)"):
        moe.SharedExpert(torch.randn(6, 8), torch.randn(3, 8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_grouped_matmul_quantized_experts(backend, fmt, gen, monkeypatch):
    """A list of per-expert QuantizedWeight runs quant.qmatmul per group; the oracle uses the dequantized weights
    (float activations: the cpu int8-activation variants have their own oracle in tests/backends)."""
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", "qgemv=portable,qgemm=fp32")
    quant = pytest.importorskip("tessera.kernels.quant")
    from tessera.kernels import registry

    if backend not in registry.implementations("qmatmul"):
        pytest.skip(f"{backend} has no qmatmul")
    sizes, k, n = [3, 0, 5], 64, 24
    x = _randn(gen, sum(sizes), k)
    w = _randn(gen, len(sizes), n, k, scale=k ** -0.5)
    qws = [quant.quantize(w[e], fmt, 32, backend="reference") for e in range(len(sizes))]
    dense = torch.stack([quant.dequantize(q, backend="reference") for q in qws])
    offsets = torch.tensor([0] + sizes).cumsum(0)
    out = moe.grouped_matmul(x, qws, offsets, backend=backend)
    assert_close_to_oracle(out, ref.grouped_matmul_f64(x, dense, offsets), torch.float32, "grouped qmatmul",
                           reduction=True)
