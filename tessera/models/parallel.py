"""The weight kinds a tensor-parallel shard holds that a plain ``linear`` / ``embed`` / ``moe_mlp`` cannot run alone.

``layers.py`` runs any weight dict; a shard made by :mod:`tessera.distributed.sharding` puts three kinds of objects
in it that need a collective after the local op: a row-parallel projection (o, down: each rank holds a slice of the
input dimension, the partial products are summed across ranks), a vocabulary-parallel token table (each rank holds
a range of rows) and a MoE block's share of the experts (each rank runs its own experts, the routed outputs are
summed across ranks). They are declared here, in the models package, so the shared decoder can dispatch on them
without importing the distributed runtime; a single-process model never holds them, and its cost is one
``isinstance`` per projection.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class ParallelLinear(ABC):
    """A projection whose ``x @ w.T`` needs a collective to complete (a row-parallel shard)."""

    shape: tuple[int, int]

    @abstractmethod
    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, backend: str) -> torch.Tensor:
        """``x [T, K_local] -> [T, N]``: the local product, reduced across ranks, plus ``bias`` once."""

    @abstractmethod
    def to(self, device: str | torch.device) -> ParallelLinear:
        """The same shard on ``device``."""


class ParallelTable(ABC):
    """A token table (embedding and/or output head) split by vocabulary rows across ranks."""

    shape: tuple[int, int]

    @abstractmethod
    def embed(self, ids: torch.Tensor, scale: float | None, dtype: torch.dtype, backend: str) -> torch.Tensor:
        """Rows of ``ids [T]`` (global ids) -> ``[T, H]`` in ``dtype`` on every rank."""

    @abstractmethod
    def lm_head(self, h: torch.Tensor, softcap: float | None, backend: str) -> torch.Tensor:
        """Float32 logits ``[T, V]`` over the whole vocabulary of hidden states ``h [T, H]``, on every rank."""

    @abstractmethod
    def greedy_tokens(self, h: torch.Tensor, softcap: float | None, backend: str) -> torch.Tensor:
        """``[T]`` int64: the first maximal index of each row of :meth:`lm_head`'s logits, on every rank, without
        assembling the logits (each rank exchanges only its local best)."""

    @abstractmethod
    def to(self, device: str | torch.device) -> ParallelTable:
        """The same shard on ``device``."""


class ParallelExperts(ABC):
    """A rank's share of a sparse MoE block's experts (``layers.i.experts.gate_up`` of an expert-parallel shard)."""

    @abstractmethod
    def moe_mlp(self, x: torch.Tensor, down: torch.Tensor, router_logits: torch.Tensor, top_k: int, mode: str,
                renormalize: bool, *, shared: Any = None, backend: str = "auto") -> torch.Tensor:
        """:func:`tessera.kernels.moe_mlp` over every rank: ``x [T, H]`` and the whole router's logits
        ``[T, E]`` -> the whole block's output ``[T, H]`` in x's dtype, on every rank. ``down`` is this rank's
        ``experts.down``; ``shared`` (a ``SharedExpert`` or None) holds this rank's slice of the shared expert."""

    @abstractmethod
    def to(self, device: str | torch.device) -> ParallelExperts:
        """The same shard on ``device``."""
