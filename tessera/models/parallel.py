"""The two weight kinds a tensor-parallel shard holds that a plain ``linear`` / ``embed`` cannot run alone.

``layers.py`` runs any weight dict; a shard made by :mod:`tessera.distributed.sharding` puts two kinds of objects in
it that need a collective after the local op: a row-parallel projection (o, down: each rank holds a slice of the
input dimension, the partial products are summed across ranks) and a vocabulary-parallel token table (each rank
holds a range of rows). They are declared here, in the models package, so the shared decoder can dispatch on them
without importing the distributed runtime; a single-process model never holds them, and its cost is one
``isinstance`` per projection.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

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
