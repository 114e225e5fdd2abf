"""The row-parallel projection and the vocabulary-parallel table of a shard (:mod:`tessera.models.parallel`)."""

from __future__ import annotations

import torch

from tessera import kernels as K
from tessera.distributed.comm import Communicator
from tessera.distributed.sharding import RankShard
from tessera.distributed.slicing import AnyWeight
from tessera.models.parallel import ParallelLinear, ParallelTable


class RowParallelLinear(ParallelLinear):
    """A slice of a projection's input columns: ``y = all_reduce(x_local @ w_local.T) + bias``.

    Parameters
    ----------
    weight : ``[N, K_local]`` float or packed.
    comm : the rank's communicator.
    """

    def __init__(self, weight: AnyWeight, comm: Communicator) -> None:
        self.weight, self.comm = weight, comm
        self.shape = tuple(weight.shape)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, backend: str) -> torch.Tensor:
        from tessera.models.layers import linear

        out = self.comm.all_reduce(linear(x, self.weight, None, backend))
        return out if bias is None else out + bias  # the bias is replicated: added once, after the sum

    def to(self, device: str | torch.device) -> RowParallelLinear:
        return RowParallelLinear(self.weight.to(device), self.comm)


class VocabParallelTable(ParallelTable):
    """Rows ``[start, stop)`` of a token table ``[V, H]``: an embedding (masked lookup + all-reduce) and/or an
    output head (local logits + all-gather of the whole vocabulary).

    Parameters
    ----------
    table : ``[stop - start, H]`` float or packed.
    start : the first global row.
    ranges : every rank's ``(start, stop)``, in rank order (the gather's piece sizes).
    comm : the rank's communicator.
    """

    def __init__(self, table: AnyWeight, start: int, ranges: list[tuple[int, int]], comm: Communicator) -> None:
        self.table, self.start, self.ranges, self.comm = table, start, ranges, comm
        self.rows = int(table.shape[0])
        self.shape = (ranges[-1][1], int(table.shape[1]))

    def embed(self, ids: torch.Tensor, scale: float | None, dtype: torch.dtype, backend: str) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        x = K.embed(torch.where(inside, local, torch.zeros_like(local)), self.table, scale=scale, dtype=dtype,
                    backend=backend)
        # other ranks' rows are zero here; the sum of one row and zeros is exact in any dtype
        return self.comm.all_reduce(x.masked_fill(~inside[:, None], 0))

    def lm_head(self, h: torch.Tensor, softcap: float | None, backend: str) -> torch.Tensor:
        local = K.lm_head(h, self.table, softcap=softcap, backend=backend)
        return self.comm.all_gather_cols(local, [b - a for a, b in self.ranges])

    def greedy_tokens(self, h: torch.Tensor, softcap: float | None, backend: str) -> torch.Tensor:
        local = K.lm_head(h, self.table, softcap=softcap, backend=backend)
        values, indices = local.max(dim=-1)  # the first maximal index within this rank's rows
        return self.comm.argmax_across(values, indices + self.start)

    def to(self, device: str | torch.device) -> VocabParallelTable:
        return VocabParallelTable(self.table.to(device), self.start, self.ranges, self.comm)


def bind(weights: dict[str, AnyWeight], shard: RankShard, vocab_ranges: list[tuple[int, int]],
         comm: Communicator) -> dict:
    """A rank's plain shard (:func:`tessera.distributed.sharding.shard_weights`) with its row-parallel projections
    and token tables wrapped in the collectives that complete them."""
    out: dict = {}
    for name, w in weights.items():
        if name.endswith(".o.weight") or name.endswith(".down.weight"):
            out[name] = RowParallelLinear(w, comm)
        elif name in ("embed", "lm_head"):
            out[name] = VocabParallelTable(w, shard.vocab[0], vocab_ranges, comm)
        else:
            out[name] = w
    return out
