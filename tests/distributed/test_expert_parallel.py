"""Expert parallelism: MoE models over two ranks (gloo on this machine) against the single-process engine, and the
expert-parallel block's partial sums against the whole MoE kernel (no processes).

Each LLM(tensor_parallel_size=2) spawns one worker rank (a few seconds); the tests keep their number small.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tessera import kernels as K
from tessera.distributed.layers import ExpertParallelMoE, routed_partial, shared_partial
from tessera.distributed.sharding import plan_shards, shard_weights
from tessera.engine import LLM
from tessera.models import load_model
from tessera.models.config import ModelConfig
from tessera.models.paged import forward_step, new_cache
from tests.distributed.test_tensor_parallel import GREEDY, _compare, _prefill_step, _prompts
from tests.models.helpers import save_tiny

TINY = dict(vocab_size=211, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128)


def _mixtral(tmp_path, experts: int):
    config = transformers.MixtralConfig(intermediate_size=96, num_local_experts=experts, num_experts_per_tok=2,
                                        **TINY)
    save_tiny(transformers.MixtralForCausalLM, config, tmp_path)
    return load_model(tmp_path)


def test_mixtral_matches_single_process_and_ranks_hold_only_their_experts(tmp_path):
    # _compare's checks, plus what rank 0 holds, in one group (each group spawns a worker)
    model = _mixtral(tmp_path, 4)
    prompts = _prompts(211)
    ref = [o.token_ids for o in LLM(model, page_size=4, num_pages=64).generate(prompts, GREEDY)]
    step = _prefill_step(prompts[1])
    ref_logits = forward_step(model, new_cache(model, 8, 4), step, all_logits=True, fused=False)
    llm = LLM(model, page_size=4, num_pages=64, max_num_batched_tokens=16, tensor_parallel_size=2)
    try:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        comm = llm.tensor_parallel.comm
        before = comm.num_all_reduce
        logits = llm.runner.forward_step(llm.model, llm.cache, step, all_logits=True)
        # the embedding, then per layer attention's o and the MoE block: one all-reduce each
        assert comm.num_all_reduce - before == 1 + 2 * model.config.num_layers
        w = llm.model.weights
    finally:
        llm.shutdown()
    assert got == ref
    err = float((logits - ref_logits).abs().max() / ref_logits.abs().max())
    assert err < 1e-5, err
    experts = w["layers.0.experts.gate_up"]
    assert isinstance(experts, ExpertParallelMoE) and experts.first == 0
    assert experts.shape == (2, 2 * 96, 64)  # rank 0: experts 0 and 1 of 4
    assert torch.equal(experts.gate_up, model.weights["layers.0.experts.gate_up"][:2])
    assert torch.equal(w["layers.1.experts.down"], model.weights["layers.1.experts.down"][:2])
    assert w["layers.0.router.weight"] is model.weights["layers.0.router.weight"]  # the whole router
    held = sum(t.numel() for name, t in w.items() if name.endswith("experts.down"))
    assert held == model.weights["layers.0.experts.down"].numel()  # 2 layers x 2 experts = 1 layer's 4 experts
    # the worker's shard, as it is sent: rank 1 holds experts 2 and 3
    config = model.config
    rank1 = shard_weights(config, model.weights, plan_shards(config, 2)[1])
    assert torch.equal(rank1["layers.0.experts.gate_up"], model.weights["layers.0.experts.gate_up"][2:])


def test_uneven_experts_match_single_process(tmp_path):
    model = _mixtral(tmp_path, 3)  # rank 0 holds experts 0-1, rank 1 expert 2
    assert [s.experts for s in plan_shards(model.config, 2)] == [(0, 2), (2, 3)]
    _compare(model, _prompts(211), 1e-5)


def test_qwen2_moe_shared_expert_and_dense_layer_match_single_process(tmp_path):
    # layer 0 dense (decoder_sparse_step=2): a row-parallel MLP; layer 1 sparse with a gated shared expert split by
    # intermediate features, its partial sum in the MoE block's all-reduce
    config = transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                         norm_topk_prob=False, decoder_sparse_step=2, **TINY)
    save_tiny(transformers.Qwen2MoeForCausalLM, config, tmp_path)
    model = load_model(tmp_path)
    assert model.config.dense_layers == (0,)
    _compare(model, _prompts(211), 1e-5)


def _moe_config(experts: int, shared: int) -> ModelConfig:
    return ModelConfig(family="qwen2_moe", vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1,
                       num_heads=6, num_kv_heads=3, head_dim=8, max_position=64, norm_eps=1e-6, num_experts=experts,
                       experts_per_token=min(2, experts), moe_intermediate_size=24,
                       shared_expert_intermediate_size=shared)


@pytest.mark.parametrize("experts, shared, world", [(4, 40, 2), (3, 0, 2), (5, 40, 3), (2, 40, 3)])
def test_partial_sums_add_up_to_the_whole_block(experts, shared, world):
    # the ranks' partials, summed here as the all-reduce would, against the single-process kernel; (2, 40, 3) leaves
    # rank 2 without experts: it adds only its slice of the shared expert
    config = _moe_config(experts, shared)
    gen = torch.Generator().manual_seed(experts * 10 + world)
    h, i, s = config.hidden_size, config.moe_intermediate_size, shared
    w = {"layers.0.router.weight": torch.randn(experts, h, generator=gen),
         "layers.0.experts.gate_up": torch.randn(experts, 2 * i, h, generator=gen) / 4,
         "layers.0.experts.down": torch.randn(experts, h, i, generator=gen) / 4}
    if shared:
        w |= {"layers.0.shared.gate_up.weight": torch.randn(2 * s, h, generator=gen) / 4,
              "layers.0.shared.down.weight": torch.randn(h, s, generator=gen) / 4,
              "layers.0.shared.gate.weight": torch.randn(h, generator=gen)}
    x = torch.randn(7, h, generator=gen)
    logits = x @ w["layers.0.router.weight"].T
    whole = K.SharedExpert(w["layers.0.shared.gate_up.weight"], w["layers.0.shared.down.weight"],
                           w["layers.0.shared.gate.weight"]) if shared else None
    ref = K.moe_mlp(x, w["layers.0.experts.gate_up"], w["layers.0.experts.down"], logits, config.experts_per_token,
                    "softmax_topk", False, shared=whole)
    total = torch.zeros_like(ref)
    for shard in plan_shards(config, world):
        part = shard_weights(config, w, shard)
        total += routed_partial(x, part["layers.0.experts.gate_up"], part["layers.0.experts.down"], logits,
                                config.experts_per_token, "softmax_topk", False, shard.experts[0], "auto")
        if shared:
            total += shared_partial(x, K.SharedExpert(part["layers.0.shared.gate_up.weight"],
                                                      part["layers.0.shared.down.weight"],
                                                      part["layers.0.shared.gate.weight"]), "auto")
    assert torch.allclose(total, ref, rtol=1e-5, atol=1e-5), float((total - ref).abs().max())

