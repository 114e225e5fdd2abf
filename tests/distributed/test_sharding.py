"""How models are cut across ranks (no processes): head and feature splits, packed slices, clear refusals."""

from __future__ import annotations

import pytest
import torch

from tessera.distributed.sharding import even_ranges, local_config, mlp_unit, plan_shards, shard_weights
from tessera.distributed.slicing import take_cols, take_experts, take_rows
from tessera.kernels.quant import StackedWeight, dequantize, quantize
from tessera.models.config import ModelConfig


def _config(**kw) -> ModelConfig:
    base = dict(family="llama", vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                num_kv_heads=2, head_dim=16, max_position=64, norm_eps=1e-6)
    return ModelConfig(**{**base, **kw})


def test_even_ranges_cover_everything():
    assert even_ranges(3, 2) == [(0, 2), (2, 3)]
    assert even_ranges(100, 3) == [(0, 34), (34, 67), (67, 100)]


def test_heads_follow_kv_groups():
    a, b = plan_shards(_config(num_heads=9, num_kv_heads=3, head_dim=64), 2)  # SmolLM2's heads: 2 + 1 KV heads
    assert (a.kv_heads, a.q_heads) == ((0, 1), tuple(range(6)))
    assert (b.kv_heads, b.q_heads) == ((2,), (6, 7, 8))


def test_fewer_kv_heads_than_ranks_replicates():
    shards = plan_shards(_config(num_heads=4, num_kv_heads=1), 2)
    assert [s.kv_heads for s in shards] == [(0,), (0,)]
    assert [s.q_heads for s in shards] == [(0, 1), (2, 3)]


@pytest.mark.parametrize("kw, world, words", [
    (dict(num_heads=4, num_kv_heads=2), 3, "2 KV heads cannot be shared by 3 ranks"),
    (dict(num_heads=6, num_kv_heads=1), 4, "query heads must divide by 4"),
    (dict(num_experts=4, experts_per_token=2, moe_intermediate_size=32, shared_expert_intermediate_size=1), 2,
     "shared expert's 1 intermediate features"),
])
def test_unshardable_models_are_refused(kw, world, words):
    with pytest.raises(ValueError, match=words):
        plan_shards(_config(**kw), world)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4_min"])
def test_packed_column_slices_keep_whole_groups(fmt):
    w = torch.randn(8, 128)
    qw = quantize(w, fmt, group_size=32)
    full = dequantize(qw)
    assert torch.equal(dequantize(take_cols(qw, 32, 96, "w")), full[:, 32:96])
    assert torch.equal(dequantize(take_rows(qw, [1, 5], "w")), full[[1, 5]])
    with pytest.raises(ValueError, match="falls inside a .* group of 32"):
        take_cols(qw, 16, 96, "layers.0.down.weight")


@pytest.mark.parametrize("fmt", ["q5_0", "q5_1", "q4_k", "q5_k", "q6_k"])
def test_ggml_block_column_slices_keep_whole_blocks(fmt):
    from tessera.tuning.random_weights import random_ggml_weight

    qw = random_ggml_weight(fmt, 6, 768, torch.Generator().manual_seed(0))
    block = qw.group_size
    full = dequantize(qw)
    got = take_cols(qw, block, 3 * block if block == 256 else 5 * block, "w")
    assert got.fmt == qw.fmt and torch.equal(dequantize(got), full[:, block:got.shape[1] + block])
    assert torch.equal(dequantize(take_rows(qw, [0, 4], "w")), full[[0, 4]])
    with pytest.raises(ValueError, match=f"falls inside a {fmt} group of {block}"):
        take_cols(qw, block // 2, 3 * block, "layers.0.down.weight")


def test_per_channel_scales_cannot_split_columns():
    qw = quantize(torch.randn(8, 64), "int8")
    with pytest.raises(ValueError, match="one scale per row"):
        take_cols(qw, 0, 32, "w")


def test_stacked_rows_split_by_part():
    a, b = quantize(torch.randn(4, 64), "int8", 32), quantize(torch.randn(6, 64), "int4", 32)
    stacked = StackedWeight((a, b))
    got = take_rows(stacked, [1, 2, 5, 9], "qkv")
    assert isinstance(got, StackedWeight)
    assert torch.equal(dequantize(got), dequantize(stacked)[[1, 2, 5, 9]])
    assert not isinstance(take_rows(stacked, [4, 5], "qkv"), StackedWeight)


def test_shards_reassemble_the_model():
    c = _config(qkv_bias=True)
    d, hq, hkv = c.head_dim, c.num_heads, c.num_kv_heads
    gen = torch.Generator().manual_seed(0)
    w = {"embed": torch.randn(c.vocab_size, 64, generator=gen),
         "layers.0.qkv.weight": torch.randn(c.qkv_rows, 64, generator=gen),
         "layers.0.qkv.bias": torch.randn(c.qkv_rows, generator=gen),
         "layers.0.o.weight": torch.randn(64, hq * d, generator=gen),
         "layers.0.gate_up.weight": torch.randn(2 * 96, 64, generator=gen),
         "layers.0.down.weight": torch.randn(64, 96, generator=gen), "final_norm.weight": torch.ones(64)}
    shards = plan_shards(c, 2)
    parts = [shard_weights(c, w, s) for s in shards]
    assert torch.equal(torch.cat([p["embed"] for p in parts]), w["embed"])
    assert torch.equal(torch.cat([p["layers.0.o.weight"] for p in parts], 1), w["layers.0.o.weight"])
    assert torch.equal(torch.cat([p["layers.0.down.weight"] for p in parts], 1), w["layers.0.down.weight"])
    q0 = parts[0]["layers.0.qkv.weight"]  # rank 0: query heads 0-1, then its KV head 0 for k and for v
    assert torch.equal(q0[: 2 * d], w["layers.0.qkv.weight"][: 2 * d])
    assert torch.equal(q0[2 * d: 3 * d], w["layers.0.qkv.weight"][hq * d: (hq + 1) * d])
    assert torch.equal(q0[3 * d:], w["layers.0.qkv.weight"][(hq + hkv) * d: (hq + hkv + 1) * d])
    gate_up = parts[1]["layers.0.gate_up.weight"]  # rank 1: gate rows 48..95, then up rows 48..95
    assert torch.equal(gate_up, w["layers.0.gate_up.weight"][list(range(48, 96)) + list(range(144, 192))])
    assert parts[1]["final_norm.weight"] is w["final_norm.weight"]


def _moe(**kw) -> ModelConfig:
    return _config(num_experts=4, experts_per_token=2, moe_intermediate_size=32, **kw)


@pytest.mark.parametrize("experts, world, ranges", [
    (4, 2, [(0, 2), (2, 4)]),
    (3, 2, [(0, 2), (2, 3)]),  # uneven: the first rank holds one more
    (1, 2, [(0, 1), (1, 1)]),  # fewer experts than ranks: rank 1 holds none and adds zeros
])
def test_experts_split_into_contiguous_ranges(experts, world, ranges):
    shards = plan_shards(_config(num_experts=experts, experts_per_token=1, moe_intermediate_size=32), world)
    assert [s.experts for s in shards] == ranges
    assert [s.q_heads for s in shards] == [(0, 1), (2, 3)]  # attention splits as in a dense model
    assert [s.intermediate for s in shards] == [(0, 96)] * 2  # every layer is MoE: no dense MLP to cut


def test_dense_layers_of_a_moe_model_still_split():
    shards = plan_shards(_moe(dense_layers=(0,), num_layers=2, shared_expert_intermediate_size=40), 2)
    assert [s.intermediate for s in shards] == [(0, 48), (48, 96)]
    assert [s.shared_intermediate for s in shards] == [(0, 20), (20, 40)]
    c = local_config(_moe(dense_layers=(0,), num_layers=2, shared_expert_intermediate_size=40), shards[1])
    # the router routes over every expert on every rank; the shared expert runs its slice
    assert (c.num_experts, c.shared_expert_intermediate_size, c.intermediate_size) == (4, 20, 48)


def test_expert_shards_hold_whole_experts_and_the_whole_router():
    c = _moe(shared_expert_intermediate_size=40)
    gen = torch.Generator().manual_seed(0)
    w = {"layers.0.router.weight": torch.randn(4, 64, generator=gen),
         "layers.0.experts.gate_up": torch.randn(4, 64, 64, generator=gen),
         "layers.0.experts.down": torch.randn(4, 64, 32, generator=gen),
         "layers.0.shared.gate_up.weight": torch.randn(80, 64, generator=gen),
         "layers.0.shared.down.weight": torch.randn(64, 40, generator=gen),
         "layers.0.shared.gate.weight": torch.randn(64, generator=gen)}
    parts = [shard_weights(c, w, s) for s in plan_shards(c, 2)]
    for name in ("layers.0.experts.gate_up", "layers.0.experts.down"):
        assert torch.equal(torch.cat([p[name] for p in parts]), w[name])
        # a copy of its own, not a view of every expert: what a worker receives is only its experts
        assert parts[1][name].untyped_storage().nbytes() == w[name].nbytes // 2
    assert all(p[n] is w[n] for p in parts for n in ("layers.0.router.weight", "layers.0.shared.gate.weight"))
    assert torch.equal(parts[1]["layers.0.shared.gate_up.weight"],
                       w["layers.0.shared.gate_up.weight"][list(range(20, 40)) + list(range(60, 80))])
    assert torch.equal(parts[1]["layers.0.shared.down.weight"], w["layers.0.shared.down.weight"][:, 20:])
    assert mlp_unit(w, 1) == 1  # no dense down projection: the granularity of a float split


def test_packed_experts_move_whole():
    experts = [quantize(torch.randn(8, 64), "int4", group_size=32) for _ in range(3)]
    got = take_experts(experts, 2, 3, "layers.0.experts.down")
    assert len(got) == 1 and got[0] is experts[2]  # the packed weight itself: nothing is cut or repacked
    with pytest.raises(ValueError, match=r"experts \[2, 4\) do not lie in the weight's 3 experts"):
        take_experts(experts, 2, 4, "layers.0.experts.down")
