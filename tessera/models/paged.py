"""One engine step of a model over a paged KV cache: new tokens of many sequences, any mix of phases.

A :class:`StepBatch` holds the new tokens of every scheduled sequence (a prompt chunk, a decode token, or draft tokens
to verify), their positions and cache slots, and each sequence's page table. :func:`forward_step` runs the shared
decoder (``layers.decoder``) with an ``attend`` that stores the new K/V into their slots and runs one attention plan
per distinct layer spec, planned once for the step and reused by every layer with that spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tessera.attention import plan
from tessera.kernels import registry
from tessera.kv import PagedKVCache
from tessera.models.layers import decoder, layer_spec, output_logits, output_tokens, rope_tables
from tessera.models.model import Model


@dataclass
class StepBatch:
    """The new tokens of one step, sequence by sequence.

    Attributes
    ----------
    token_ids : int64 ``[T]``, the new tokens of sequence 0, then sequence 1, ...
    q_lens : new tokens per sequence (``sum = T``)
    kv_lens : tokens each sequence has in the cache after this step (its new tokens are the last ``q_lens[s]``)
    page_table : int32 ``[num_seqs, max_pages]`` on the host: planning input (backends turn it into their own
        layout once per step, as FlashInfer's ``plan`` takes host index arrays)
    slots : int64 ``[T]``, the cache slot of each new token (``page_table[s, pos // page] * page + pos % page``)

    ``token_ids`` and ``slots`` live on the model's device; :attr:`positions` follows them.
    """

    token_ids: torch.Tensor
    q_lens: list[int]
    kv_lens: list[int]
    page_table: torch.Tensor
    slots: torch.Tensor

    @property
    def positions(self) -> torch.Tensor:
        """Absolute position of every new token, int64 ``[T]``."""
        device = self.token_ids.device
        parts = [torch.arange(kl - ql, kl, dtype=torch.int64, device=device)
                 for ql, kl in zip(self.q_lens, self.kv_lens)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)

    def validate(self) -> None:
        t = int(self.token_ids.numel())
        if sum(self.q_lens) != t or int(self.slots.numel()) != t:
            raise ValueError(f"StepBatch: {t} token ids, {int(self.slots.numel())} slots and sum(q_lens) = "
                             f"{sum(self.q_lens)} must agree")
        if len(self.q_lens) != len(self.kv_lens) or self.page_table.shape[0] != len(self.q_lens):
            raise ValueError("StepBatch: q_lens, kv_lens and page_table rows must have one entry per sequence")
        if self.slots.device != self.token_ids.device:
            raise ValueError(f"StepBatch: token_ids ({self.token_ids.device}) and slots ({self.slots.device}) must "
                             "be on the model's device")


def slots_for(page_table_row: list[int] | torch.Tensor, positions: range | list[int], page_size: int) -> list[int]:
    """Cache slots of ``positions`` for a sequence with page table row ``page_table_row``."""
    row = [int(p) for p in page_table_row]
    return [row[p // page_size] * page_size + p % page_size for p in positions]


def new_cache(model: Model, num_pages: int, page_size: int, kv_cache_dtype: str | None = None) -> PagedKVCache:
    """A page pool shaped for ``model`` in its dtype (or quantized: ``kv_cache_dtype`` "int8" / "fp8_e4m3"), on its
    device, stored the way its backend stores KV."""
    c = model.config
    return PagedKVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, model.dtype,
                        device=model.device, backend=model.backend, kv_cache_dtype=kv_cache_dtype)


@torch.no_grad()
def fused_decode_op(model: Model) -> Callable | None:
    """The model's backend's optional fused decode step (``fused_decode_layers``), or None where it has none.

    The op takes ``(model, cache, step, positions, ropes, plan_for)`` and returns the final-normed hidden states
    ``[T, H]``, or None for a step it declines; :func:`forward_step` then runs the per-op path.
    """
    return registry.resolve_optional("fused_decode_layers", model.backend, model.device)


def forward_step(model: Model, cache: PagedKVCache, step: StepBatch, *, all_logits: bool = False,
                 logit_rows: list[int] | None = None, fused: bool = True, greedy: bool = False) -> torch.Tensor:
    """Run one step; return float32 logits of each sequence's last new token ``[num_seqs, vocab]``.

    With ``all_logits=True`` it returns the logits of every new token ``[T, vocab]`` (speculative verification,
    prompt logprobs). Sequences with ``q_len = 0`` are skipped (their row is absent from the result).
    ``logit_rows`` (token rows in ``[0, T)``) returns exactly those rows' logits ``[len(logit_rows), vocab]``
    instead: a speculative step needs every drafted position of its verified sequences but only the last of a
    prompt chunk, and the LM head is the costliest op of a long chunk.
    ``fused=False`` forces the per-op path even where the backend's fused decode step applies (the optional
    ``fused_decode_layers`` op, e.g. :mod:`tessera.backends.cpu.ops.fused_decode`; tests compare the two).
    ``greedy=True`` returns the greedy token of each of those rows instead, ``[rows]`` int64 (the first maximal
    logit's index): a vocabulary-parallel output head then exchanges each rank's best logit instead of gathering
    the whole vocabulary (docs/distributed.md).
    """
    step.validate()
    config, w, backend = model.config, model.weights, model.backend
    device = model.device
    if step.token_ids.device != device or cache.device != device:
        raise ValueError(f"forward_step: the model is on {device}, the step's tokens on {step.token_ids.device} and "
                         f"the cache on {cache.device}; build all three on the model's device (new_cache(model, ...))")
    if step.token_ids.numel() == 0:
        if greedy:
            return torch.zeros(0, dtype=torch.int64, device=device)
        return torch.zeros(0, config.vocab_size, device=device)
    plans: dict[object, object] = {}

    def spec_key(i: int) -> object:
        return config.layer_windows[i]  # everything else in a layer's spec is the same on every layer

    def plan_for(i: int):
        key = spec_key(i)
        if key not in plans:
            plans[key] = plan(layer_spec(config, i), step.q_lens, step.kv_lens, step.page_table, cache.page_size,
                              backend=backend)
        return plans[key]

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache.write(i, k, v, step.slots)
        return plan_for(i).run(q, cache.k_pages[i], cache.v_pages[i])

    positions = step.positions
    ropes = rope_tables(config, max(step.kv_lens))
    fused_layers = fused_decode_op(model) if fused else None
    h = fused_layers(model, cache, step, positions, ropes, plan_for) if fused_layers is not None else None
    if h is None:
        h = decoder(config, w, step.token_ids.long(), positions, ropes, attend, backend)
    if logit_rows is not None:
        t = int(step.token_ids.numel())
        if any(not 0 <= r < t for r in logit_rows):
            raise ValueError(f"forward_step: logit_rows must be token rows in [0, {t}), got {list(logit_rows)}")
        h = h[torch.tensor(logit_rows, dtype=torch.int64, device=device)]
    elif not all_logits:
        ends = torch.tensor([sum(step.q_lens[: s + 1]) - 1 for s in range(len(step.q_lens)) if step.q_lens[s] > 0],
                            dtype=torch.int64, device=device)
        h = h[ends]
    if greedy:
        return output_tokens(config, w, h.contiguous(), backend)
    return output_logits(config, w, h.contiguous(), backend)
