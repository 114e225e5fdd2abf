"""How a dense decoder is cut across ``world`` ranks, and each rank's weights.

Attention is split by KV heads: each rank keeps whole GQA groups (its KV heads and the query heads that read them),
so attention needs no communication; q/k/v rows are column-parallel, o's input columns row-parallel. When there
are fewer KV heads than ranks, each KV head is replicated on ``world / num_kv_heads`` ranks and its query heads are
divided among them (vLLM does the same). The MLP's intermediate features are split the same way: gate/up rows
column-parallel, down's input columns row-parallel. The token table and output head are split by vocabulary rows.

Splits are as even as the units allow and need not be equal: SmolLM2 has 3 KV heads, so two ranks hold 2 and 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessera.distributed.slicing import AnyWeight, group_size, take_cols, take_rows
from tessera.models.config import ModelConfig


@dataclass(frozen=True)
class RankShard:
    """What rank ``rank`` of ``world`` holds.

    Attributes
    ----------
    q_heads, kv_heads : global head numbers (contiguous, ascending).
    intermediate : ``(start, stop)`` of the MLP's intermediate features.
    vocab : ``(start, stop)`` of the token table's rows.
    """

    rank: int
    world: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]


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
    if config.is_moe:
        raise ValueError(f"tensor parallelism does not split mixture-of-experts models yet ({config.family}: "
                         f"{config.num_experts} experts); run it with tensor_parallel_size=1")
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
    """Each rank's heads, intermediate range and vocabulary range.

    Parameters
    ----------
    config : the whole model's config.
    world : number of ranks.
    mlp_unit : the intermediate split's granularity (the down projection's quantization group; 1 for float).
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
    units = config.intermediate_size // mlp_unit
    if config.intermediate_size % mlp_unit or units < world:
        raise ValueError(f"{config.family}: the MLP's {config.intermediate_size} intermediate features in groups of "
                         f"{mlp_unit} cannot be split across {world} ranks; lower tensor_parallel_size or load with "
                         "keep_quantized=False")
    inter = [(a * mlp_unit, b * mlp_unit) for a, b in even_ranges(units, world)]
    vocab = even_ranges(config.vocab_size, world)
    return [RankShard(r, world, heads[r][0], heads[r][1], inter[r], vocab[r]) for r in range(world)]


def local_config(config: ModelConfig, shard: RankShard) -> ModelConfig:
    """The config one rank's layers run with: its heads and intermediate features (the vocabulary stays whole:
    token ids and logits are global)."""
    start, stop = shard.intermediate
    return dataclasses.replace(config, num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads),
                               intermediate_size=stop - start)


def _qkv_rows(config: ModelConfig, shard: RankShard) -> list[int]:
    d, hq, hkv = config.head_dim, config.num_heads, config.num_kv_heads
    rows = [h * d + i for h in shard.q_heads for i in range(d)]
    rows += [(hq + h) * d + i for h in shard.kv_heads for i in range(d)]
    rows += [(hq + hkv + h) * d + i for h in shard.kv_heads for i in range(d)]
    return rows


def shard_weights(config: ModelConfig, weights: dict[str, AnyWeight], shard: RankShard) -> dict[str, AnyWeight]:
    """One rank's weights under the canonical names, plain (unwrapped): what is sent to a worker.

    ``layers.i.o.weight`` / ``layers.i.down.weight`` hold input-column slices and ``embed`` / ``lm_head`` vocabulary
    rows; :func:`tessera.distributed.layers.bind` wraps them with the collectives that complete them. Everything
    else is either a row slice (q/k/v, gate/up and their biases) or replicated (norms, biases of o and down).
    """
    d = config.head_dim
    i0, i1 = shard.intermediate
    v0, v1 = shard.vocab
    big_i = config.intermediate_size
    out: dict[str, AnyWeight] = {}
    for name, w in weights.items():
        parts = name.split(".")
        kind = ".".join(parts[2:]) if parts[0] == "layers" else name
        if kind in ("qkv.weight", "qkv.bias"):
            out[name] = take_rows(w, _qkv_rows(config, shard), name)
        elif kind in ("gate_up.weight", "gate_up.bias"):
            rows = list(range(i0, i1)) + (list(range(big_i + i0, big_i + i1)) if config.gated_mlp else [])
            out[name] = take_rows(w, rows, name)
        elif kind == "o.weight":
            out[name] = take_cols(w, shard.q_heads[0] * d, (shard.q_heads[-1] + 1) * d, name)
        elif kind == "down.weight":
            out[name] = take_cols(w, i0, i1, name)
        elif kind in ("embed", "lm_head"):
            out[name] = take_rows(w, list(range(v0, v1)), name)
        else:
            out[name] = w
    return out


def mlp_unit(weights: dict[str, AnyWeight], num_layers: int) -> int:
    """The largest quantization group of any down projection: the intermediate split's granularity."""
    return max(group_size(weights[f"layers.{i}.down.weight"]) for i in range(num_layers))
