"""The row-parallel projection, the vocabulary-parallel table and the expert-parallel MoE block of a shard
(:mod:`tessera.models.parallel`)."""

from __future__ import annotations

import torch

from tessera import kernels as K
from tessera.distributed.comm import Communicator
from tessera.distributed.sharding import RankShard
from tessera.distributed.slicing import AnyWeight
from tessera.models.parallel import ParallelExperts, ParallelLinear, ParallelTable


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


class ExpertParallelMoE(ParallelExperts):
    """Experts ``[first, first + E_local)`` of a sparse MoE block: the whole router's choice, this rank's experts,
    and one all-reduce.

    Every rank routes with the whole (replicated) router, so all pick the same top-k experts with the same weights;
    each runs only the token copies sent to its own experts, weighs them, adds its slice of the shared expert, and
    one all-reduce of the float32 partial sums completes the block (the sum is rounded to the model dtype once, as
    the single-process kernel rounds its combine).

    Parameters
    ----------
    gate_up : ``[E_local, 2I, H]``, this rank's experts (``E_local`` is 0 on a rank past the last expert).
    first : the global id of its first expert.
    comm : the rank's communicator.
    """

    def __init__(self, gate_up: torch.Tensor, first: int, comm: Communicator) -> None:
        self.gate_up, self.first, self.comm = gate_up, first, comm
        self.shape = tuple(gate_up.shape)

    def moe_mlp(self, x: torch.Tensor, down: torch.Tensor, router_logits: torch.Tensor, top_k: int, mode: str,
                renormalize: bool, *, shared: K.SharedExpert | None = None, backend: str = "auto") -> torch.Tensor:
        out = routed_partial(x, self.gate_up, down, router_logits, top_k, mode, renormalize, self.first, backend)
        if shared is not None:
            out += shared_partial(x, shared, backend)
        return self.comm.all_reduce(out).to(x.dtype)

    def to(self, device: str | torch.device) -> ExpertParallelMoE:
        return ExpertParallelMoE(self.gate_up.to(device), self.first, self.comm)


def routed_partial(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, router_logits: torch.Tensor,
                   top_k: int, mode: str, renormalize: bool, first: int, backend: str) -> torch.Tensor:
    """Float32 ``[T, H]``: ``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` over the ``j`` whose expert is local.

    Parameters
    ----------
    x : ``[T, H]`` float.
    gate_up, down : ``[E_local, 2I, H]`` and ``[E_local, H, I]``, experts ``first ..`` in x's dtype.
    router_logits : ``[T, E]``, the whole router's (every expert's) logits.
    top_k, mode, renormalize : as :func:`tessera.kernels.route`.
    first : the global id of ``gate_up[0]``.
    backend : kernel backend.
    """
    local = int(gate_up.shape[0])
    if local == 0:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    weights, ids = K.route(router_logits, top_k, mode=mode, renormalize=renormalize, backend=backend)
    mine = (ids >= first) & (ids < first + local)
    # copies routed to other ranks' experts go to one extra bucket, which permute sorts last and nothing computes
    xs, offsets, inverse = K.permute(x, torch.where(mine, ids - first, local), local + 1, backend=backend)
    rows = int(offsets[local])
    if rows == 0:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    bounds = offsets[:local + 1]
    h = K.grouped_matmul(xs[:rows], gate_up, bounds, backend=backend)
    ys = torch.zeros(xs.shape, dtype=torch.float32, device=x.device)  # the extra bucket's rows add zero
    ys[:rows] = K.grouped_matmul(K.silu_and_mul(h, backend=backend), down, bounds, backend=backend)
    return K.combine(ys, weights, inverse, backend=backend)


def shared_partial(x: torch.Tensor, shared: K.SharedExpert, backend: str) -> torch.Tensor:
    """Float32 ``[T, H]``: this rank's slice of the shared expert (its intermediate features), times the shared
    sigmoid gate. The gate is one factor per token, so the ranks' slices sum to the whole shared expert."""
    from tessera.models.layers import linear

    act = K.silu_and_mul(linear(x, shared.gate_up, None, backend), backend=backend)
    out = linear(act, shared.down, None, backend).float()
    if shared.gate is None:
        return out
    return torch.sigmoid(x.float() @ shared.gate.float()).unsqueeze(-1) * out


def bind(weights: dict[str, AnyWeight], shard: RankShard, vocab_ranges: list[tuple[int, int]],
         comm: Communicator) -> dict:
    """A rank's plain shard (:func:`tessera.distributed.sharding.shard_weights`) with its row-parallel projections,
    token tables and experts wrapped in the collectives that complete them.

    A shared expert's down projection stays plain: its partial sum joins the MoE block's all-reduce
    (:class:`ExpertParallelMoE`), and ``experts.down`` is passed to that block as it is.
    """
    out: dict = {}
    for name, w in weights.items():
        kind = name.split(".", 2)[-1] if name.startswith("layers.") else name
        if kind in ("o.weight", "down.weight"):
            out[name] = RowParallelLinear(w, comm)
        elif kind == "experts.gate_up":
            out[name] = ExpertParallelMoE(w, shard.experts[0], comm)
        elif name in ("embed", "lm_head"):
            out[name] = VocabParallelTable(w, shard.vocab[0], vocab_ranges, comm)
        else:
            out[name] = w
    return out
