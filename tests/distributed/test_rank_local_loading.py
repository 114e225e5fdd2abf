"""Rank-local loading (no processes): each rank's shard, loaded weight by weight, equals ``shard_weights`` of the
fully loaded model bit for bit, and no whole weight outlives its cut.

Checkpoints: Hugging Face Llama directories (GQA, tied embeddings, one KV head shared by two ranks, an untied
head), a Mixtral directory (3 experts over 2 ranks), and GGUF files with packed Q4_0 projections and a Q8_0 token
table (q/k un-permuted on load) and with Q8_0 everywhere over one KV head.
"""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path

import pytest
import torch
import transformers

from tessera.distributed import rank_local
from tessera.distributed.comm import TensorParallelError
from tessera.distributed.launch import TensorParallelEngine
from tessera.distributed.rank_local import checkpoint_plan, load_shard
from tessera.distributed.sharding import mlp_unit, plan_shards, shard_weights
from tessera.distributed.torchrun import (GroupPlan, LaunchEnv, _check_same_cut, _check_same_model, plan_for,
                                       weight_forms)
from tessera.kernels.quant import QuantizedWeight, StackedWeight
from tessera.models import load_model
from tessera.models.gguf_write import write_gguf
from tests.models.helpers import save_tiny

WORLD = 2
TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128)


def _llama(path: Path, **kw) -> Path:
    save_tiny(transformers.LlamaForCausalLM, transformers.LlamaConfig(**{**TINY, **kw}), path)
    return path


def _mixtral(path: Path) -> Path:
    config = transformers.MixtralConfig(num_local_experts=3, num_experts_per_tok=2, num_key_value_heads=2, **TINY)
    save_tiny(transformers.MixtralForCausalLM, config, path)
    return path


def _gguf_q8_one_kv_head(path: Path) -> Path:
    source = _llama(path / "hf", num_key_value_heads=1, tie_word_embeddings=True)
    model = load_model(source)
    return write_gguf(path / "q8.gguf", model.config, model.weights, qtype="Q8_0")


def _gguf_q4_0(path: Path) -> Path:
    from tests.eval.tiny import tiny_gguf

    return tiny_gguf(path)


CHECKPOINTS = {
    "llama-gqa-tied": lambda p: _llama(p, num_key_value_heads=2, tie_word_embeddings=True),
    "llama-1kv-replicated": lambda p: _llama(p, num_key_value_heads=1),
    "llama-untied": lambda p: _llama(p, num_key_value_heads=4, tie_word_embeddings=False),
    "mixtral-3-experts": _mixtral,
    "gguf-q4_0-q8_0-table": _gguf_q4_0,
    "gguf-q8_0-1kv": _gguf_q8_one_kv_head,
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory) -> Path:
    return CHECKPOINTS[request.param](tmp_path_factory.mktemp(request.param))


def _tensors(w) -> list[torch.Tensor]:
    """The tensors a weight in any loaded form is made of."""
    if isinstance(w, torch.Tensor):
        return [w]
    if isinstance(w, StackedWeight):
        return [t for p in w.parts for t in _tensors(p)]
    if isinstance(w, QuantizedWeight):
        return [t for t in (w.data, w.scales, w.zeros, w.mins) if t is not None]
    if isinstance(w, (list, tuple)):
        return [t for p in w for t in _tensors(p)]
    raise TypeError(f"unexpected weight {type(w).__name__}")


def _assert_identical(got, want, name: str) -> None:
    """Same form, shape, dtype and every bit."""
    assert type(got) is type(want), name
    if isinstance(want, QuantizedWeight):
        assert (got.fmt, got.shape, got.group_size) == (want.fmt, want.shape, want.group_size), name
    a, b = _tensors(got), _tensors(want)
    assert len(a) == len(b), name
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(torch.uint8) if x.dtype.is_floating_point else x,
                           y.view(torch.uint8) if y.dtype.is_floating_point else y), name


def test_rank_local_shards_equal_the_whole_models_cut(checkpoint):
    whole = load_model(checkpoint)
    config, shards = checkpoint_plan(checkpoint, WORLD)
    # the header's plan is the whole load's, mlp_unit (the down projections' quantization group) included
    assert shards == plan_shards(whole.config, WORLD, mlp_unit(whole.weights, whole.config.num_layers))
    if config.num_kv_heads < WORLD:  # the one KV head is on both ranks, each with half the query heads
        assert [s.kv_heads for s in shards] == [(0,), (0,)]
    for shard in shards:
        load = load_shard(checkpoint, shard.rank, WORLD)
        want = shard_weights(whole.config, whole.weights, shard)
        assert list(load.model.weights) == list(want)
        for name in want:
            _assert_identical(load.model.weights[name], want[name], f"rank {shard.rank}: {name}")
        assert load.forms == weight_forms(whole.weights)  # what the ranks compare, as a whole load gives it
        assert load.shards == shards and load.rank == shard.rank


def test_gguf_packed_weights_stay_packed_in_the_shard(tmp_path):
    path = _gguf_q4_0(tmp_path)
    config, shards = checkpoint_plan(path, WORLD)
    load = load_shard(path, 1, WORLD)
    w = load.model.weights
    assert isinstance(w["layers.0.down.weight"], QuantizedWeight) and w["layers.0.down.weight"].group_size == 32
    assert w["layers.0.down.weight"].shape == (64, 64)  # 128 input columns cut on Q4_0's 32-value groups
    assert isinstance(w["embed"], QuantizedWeight)  # the tied Q8_0 table: rank 1's vocabulary rows only
    v0, v1 = shards[1].vocab
    assert w["embed"].shape == (v1 - v0, config.hidden_size) and "lm_head" not in w


def test_no_whole_weight_outlives_its_cut(checkpoint, monkeypatch):
    """Every whole weight the loader hands the hook is gone (no reference left anywhere) by the time the next one
    arrives: a rank holds its shard plus at most the one weight being cut."""
    real = rank_local.shard_weights
    seen: list[str] = []
    cut: list[tuple[str, list[weakref.ref]]] = []

    def spy(config, weights, shard):
        ((name, whole),) = weights.items()  # one weight at a time
        alive = [n for n, refs in cut if any(r() is not None for r in refs)]
        assert not alive, f"{alive} still held when {name} arrived"
        out = real(config, weights, shard)
        kept = {id(t) for t in _tensors(out[name])}
        refs = [weakref.ref(t) for t in _tensors(whole) if id(t) not in kept]
        if refs:
            cut.append((name, refs))
        seen.append(name)
        return out

    monkeypatch.setattr(rank_local, "shard_weights", spy)
    load = load_shard(checkpoint, 0, WORLD)
    assert seen == list(load.model.weights)  # each weight once, in load order
    assert cut and all(r() is None for _, refs in cut for r in refs)


def test_worker_rank_local_load_agrees_with_a_whole_rank0(checkpoint):
    """A rank 0 that loaded the whole model (for a self-draft) and a worker that loaded rank-locally agree."""
    whole = load_model(checkpoint)
    config, shards = checkpoint_plan(checkpoint, WORLD)
    fields = dict(port=1, num_pages=8, page_size=4, kv_cache_dtype=None, threads=1, timeout_s=1.0, idle_timeout_s=1.0)
    plan: GroupPlan = plan_for(whole, shards, **fields)
    env = LaunchEnv(rank=1, world=WORLD, local_rank=1, master_addr="127.0.0.1", master_port=1)
    load = load_shard(checkpoint, 1, WORLD)
    _check_same_model(plan, load, env)
    _check_same_cut(plan, load, env)
    assert plan_for(load, shards, **fields).forms == plan.forms
    with pytest.raises(TensorParallelError, match="rank 1 planned its shard as .* but rank 0 planned it as"):
        _check_same_cut(dataclasses.replace(plan, shards=shards[::-1]), load, env)
    with pytest.raises(TensorParallelError, match="rank 1 loaded a different model than rank 0 .*float32.*bfloat16"):
        _check_same_model(plan, load_shard(checkpoint, 1, WORLD, "bfloat16"), env)


def test_rank_local_load_runs_only_under_torchrun(tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    load = load_shard(_llama(tmp_path, num_key_value_heads=2), 0, WORLD)
    with pytest.raises(ValueError, match="rank-local load .* runs only under torchrun"):
        TensorParallelEngine(load, WORLD, 8, 4)
    with pytest.raises(ValueError, match="rank 3 is outside"):
        load_shard(tmp_path, 3, WORLD)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_shard(tmp_path / "absent", 0, WORLD)
    with pytest.raises(ValueError, match="is a file but not .gguf"):
        load_shard(tmp_path / "config.json", 0, WORLD)
