"""How a decoder is cut across ``world`` ranks, and each rank's weights.

Attention is split by KV heads: each rank keeps whole GQA groups (its KV heads and the query heads that read them),
so attention needs no communication; q/k/v rows are column-parallel, o's input columns row-parallel. When there
are fewer KV heads than ranks, each KV head is replicated on ``world / num_kv_heads`` ranks and its query heads are
divided among them (vLLM does the same). The MLP's intermediate features are split the same way: gate/up rows
column-parallel, down's input columns row-parallel. The token table and output head are split by vocabulary rows.

A mixture-of-experts block is split by whole experts (expert parallelism): each rank holds a contiguous range of
experts, the router stays whole on every rank (so every rank picks the same top-k experts with the same weights),
and each rank adds up the routed outputs of its own experts; one all-reduce per MoE layer completes the block, in
place of the dense MLP's row-parallel one. A shared expert (Qwen2-MoE) is split like a dense MLP, and its partial
sum joins the same all-reduce. Whole experts move, so packed expert weights would need no cut.

Splits are as even as the units allow and need not be equal: SmolLM2 has 3 KV heads, so two ranks hold 2 and 1;
3 experts over two ranks are 2 and 1. With fewer experts than ranks the last ranks hold none (they still run
attention and the shared expert, and add zeros for the routed part).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessera.distributed.slicing import AnyWeight, group_size, take_cols, take_experts, take_rows
from tessera.models.config import ModelConfig


@dataclass(frozen=True)
class RankShard:
    """What rank ``rank`` of ``world`` holds.

    Attributes
    ----------
    q_heads, kv_heads : global head numbers (contiguous, ascending).
    intermediate : ``(start, stop)`` of the dense MLP's intermediate features (the whole range when the model has
        no dense MLP layer).
    vocab : ``(start, stop)`` of the token table's rows.
    experts : ``(start, stop)`` of the global expert ids whose weights this rank holds (``(0, 0)`` for a dense
        model; empty when there are fewer experts than ranks).
    shared_intermediate : ``(start, stop)`` of the shared expert's intermediate features (``(0, 0)`` without one).
    """

    rank: int
    world: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    experts: tuple[int, int] = (0, 0)
    shared_intermediate: tuple[int, int] = (0, 0)


def even_ranges(units: int, parts: int) -> list[tuple[int, int]]:
    """``[0, units)`` cut into ``parts`` contiguous ranges whose sizes differ by at most one (larger ones first)."""
    base, extra = divmod(units, parts)
    out, start = [], 0
    for p in range(parts):
        stop = start + base + (p < extra)
        out.append((start, stop))
        start = stop
    return out


def check_shardable(config: ModelConfig, world: int) -> None:
    """Raise ValueError when ``config`` cannot be split across ``world`` ranks (the message says what would)."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    hq, hkv = config.num_heads, config.num_kv_heads
    if hkv < world:
        if world % hkv:
            raise ValueError(f"{config.family}: {hkv} KV heads cannot be shared by {world} ranks (fewer KV heads than "
                             f"ranks needs tensor_parallel_size a multiple of {hkv}); use a tensor_parallel_size "
                             f"that divides or is a multiple of {hkv}")
        if hq % world:
            raise ValueError(f"{config.family}: with {hkv} KV heads replicated over {world} ranks, the {hq} query "
                             f"heads must divide by {world}; pick a tensor_parallel_size that divides {hq}")


def plan_shards(config: ModelConfig, world: int, mlp_unit: int = 1) -> list[RankShard]:
    """Each rank's heads, intermediate ranges, experts and vocabulary range.

    Parameters
    ----------
    config : the whole model's config.
    world : number of ranks.
    mlp_unit : the dense intermediate split's granularity (the down projection's quantization group; 1 for float).
        The shared expert's split has none: every loader keeps its weights float.
    """
    check_shardable(config, world)
    hq, hkv = config.num_heads, config.num_kv_heads
    group = hq // hkv
    if hkv >= world:
        kv_ranges = even_ranges(hkv, world)
        heads = [(tuple(range(a * group, b * group)), tuple(range(a, b))) for a, b in kv_ranges]
    else:
        per = hq // world
        heads = [(tuple(range(r * per, (r + 1) * per)), ((r * per) // group,)) for r in range(world)]
    if has_dense_mlp(config):
        inter = _feature_ranges(config, "MLP", config.intermediate_size, mlp_unit, world)
    else:  # every layer is MoE: no layer reads the dense size, so nothing is cut
        inter = [(0, config.intermediate_size)] * world
    experts = even_ranges(config.num_experts, world) if config.is_moe else [(0, 0)] * world
    shared = [(0, 0)] * world
    if config.is_moe and config.shared_expert_intermediate_size:
        shared = _feature_ranges(config, "shared expert", config.shared_expert_intermediate_size, 1, world)
    vocab = even_ranges(config.vocab_size, world)
    return [RankShard(r, world, heads[r][0], heads[r][1], inter[r], vocab[r], experts[r], shared[r])
            for r in range(world)]


def has_dense_mlp(config: ModelConfig) -> bool:
    """Whether any layer runs the dense MLP (every layer of a dense model; Qwen2-MoE's ``dense_layers``)."""
    return any(not config.is_moe_layer(i) for i in range(config.num_layers))


def _feature_ranges(config: ModelConfig, what: str, size: int, unit: int, world: int) -> list[tuple[int, int]]:
    """``[0, size)`` intermediate features cut into ``world`` ranges on multiples of ``unit``."""
    units = size // unit
    if size % unit or units < world:
        raise ValueError(f"{config.family}: the {what}'s {size} intermediate features in groups of {unit} cannot be "
                         f"split across {world} ranks; lower tensor_parallel_size or load with keep_quantized=False")
    return [(a * unit, b * unit) for a, b in even_ranges(units, world)]


def local_config(config: ModelConfig, shard: RankShard) -> ModelConfig:
    """The config one rank's layers run with: its heads and intermediate features. The vocabulary stays whole
    (token ids and logits are global), and so does ``num_experts``: the router is replicated and routes over every
    expert; the rank's share of them is its weights' (:class:`tessera.distributed.layers.ExpertParallelMoE`)."""
    start, stop = shard.intermediate
    s0, s1 = shard.shared_intermediate
    return dataclasses.replace(config, num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads),
                               intermediate_size=stop - start,
                               shared_expert_intermediate_size=s1 - s0 if config.shared_expert_intermediate_size else 0)


def _qkv_rows(config: ModelConfig, shard: RankShard) -> list[int]:
    d, hq, hkv = config.head_dim, config.num_heads, config.num_kv_heads
    rows = [h * d + i for h in shard.q_heads for i in range(d)]
    rows += [(hq + h) * d + i for h in shard.kv_heads for i in range(d)]
    rows += [(hq + hkv + h) * d + i for h in shard.kv_heads for i in range(d)]
    return rows


def shard_weights(config: ModelConfig, weights: dict[str, AnyWeight], shard: RankShard) -> dict[str, AnyWeight]:
    """One rank's weights under the canonical names, plain (unwrapped): what is sent to a worker.

    ``layers.i.o.weight`` / ``layers.i.down.weight`` / ``layers.i.shared.down.weight`` hold input-column slices,
    ``embed`` / ``lm_head`` vocabulary rows and ``layers.i.experts.*`` the rank's whole experts;
    :func:`tessera.distributed.layers.bind` wraps them with the collectives that complete them. Everything else is
    either a row slice (q/k/v, gate/up, the shared expert's gate/up, and their biases) or replicated (norms, router,
    the shared expert's sigmoid gate, biases of o and down).
    """
    d = config.head_dim
    v0, v1 = shard.vocab
    out: dict[str, AnyWeight] = {}
    for name, w in weights.items():
        parts = name.split(".")
        kind = ".".join(parts[2:]) if parts[0] == "layers" else name
        if kind in ("qkv.weight", "qkv.bias"):
            out[name] = take_rows(w, _qkv_rows(config, shard), name)
        elif kind in ("gate_up.weight", "gate_up.bias"):
            out[name] = take_rows(w, _gate_up_rows(shard.intermediate, config.intermediate_size, config.gated_mlp),
                                  name)
        elif kind == "shared.gate_up.weight":
            out[name] = take_rows(w, _gate_up_rows(shard.shared_intermediate, config.shared_expert_intermediate_size,
                                                   True), name)
        elif kind == "o.weight":
            out[name] = take_cols(w, shard.q_heads[0] * d, (shard.q_heads[-1] + 1) * d, name)
        elif kind == "down.weight":
            out[name] = take_cols(w, *shard.intermediate, name)
        elif kind == "shared.down.weight":
            out[name] = take_cols(w, *shard.shared_intermediate, name)
        elif kind in ("experts.gate_up", "experts.down"):
            out[name] = take_experts(w, *shard.experts, name)
        elif kind in ("embed", "lm_head"):
            out[name] = take_rows(w, list(range(v0, v1)), name)
        else:
            out[name] = w
    return out


def _gate_up_rows(features: tuple[int, int], size: int, gated: bool) -> list[int]:
    """Rows of a fused gate|up weight (``[2 * size, H]``; ``[size, H]`` when not gated) for ``features``."""
    i0, i1 = features
    return list(range(i0, i1)) + (list(range(size + i0, size + i1)) if gated else [])


def mlp_unit(weights: dict[str, AnyWeight], num_layers: int) -> int:
    """The largest quantization group of any dense down projection: the intermediate split's granularity (1 when
    no layer has one, as in a model whose every layer is MoE)."""
    names = (f"layers.{i}.down.weight" for i in range(num_layers))
    return max((group_size(weights[n]) for n in names if n in weights), default=1)
