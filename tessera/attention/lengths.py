"""Validation of a ragged batch's lengths, shared by every entry point that takes ``q_lens`` / ``kv_lens``."""

from __future__ import annotations

import torch

from tessera.attention.spec import AttentionSpec
from tessera.backends.base import RaggedBatch


def as_lengths(lens: list[int] | tuple[int, ...] | torch.Tensor, name: str, where: str) -> tuple[int, ...]:
    """``lens`` (a list of ints or a 1-D integer tensor) as a tuple of ints >= 0; ``where`` names the caller in
    errors."""
    if isinstance(lens, torch.Tensor):
        if lens.dim() != 1 or lens.dtype.is_floating_point or lens.dtype == torch.bool:
            raise TypeError(f"{where}: {name} must be a 1-D integer tensor or a list of ints, got {lens.dtype} "
                            f"{tuple(lens.shape)}")
        lens = lens.tolist()
    try:
        out = tuple(int(x) for x in lens)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: {name} must be a list of ints or a 1-D int tensor, got {lens!r}") from None
    if any(x < 0 for x in out):
        raise ValueError(f"{where}: {name} must be >= 0, got {list(out)}")
    return out


def ragged_batch(q_lens: list[int] | torch.Tensor, kv_lens: list[int] | torch.Tensor, spec: AttentionSpec,
                 where: str) -> RaggedBatch:
    """The :class:`RaggedBatch` of validated lengths: one ``q_len <= kv_len`` pair per sequence, and lengths the
    spec's mask can cover (a document mask needs ids for every kv position)."""
    q_lens_t, kv_lens_t = as_lengths(q_lens, "q_lens", where), as_lengths(kv_lens, "kv_lens", where)
    if len(q_lens_t) != len(kv_lens_t):
        raise ValueError(f"{where}: {len(q_lens_t)} q_lens but {len(kv_lens_t)} kv_lens; give one of each per "
                         "sequence")
    for s, (ql, kl) in enumerate(zip(q_lens_t, kv_lens_t)):
        if ql > kl:
            raise ValueError(f"{where}: sequence {s} has q_len {ql} > kv_len {kl}; a sequence's kv includes its "
                             "queries' keys and values (they sit at its last q_len positions)")
    batch = RaggedBatch(q_lens_t, kv_lens_t)
    if spec.mask is not None:
        spec.mask.check_lengths(batch.num_seqs, list(kv_lens_t), dense=False)
    return batch
