"""A draft model proposer: a smaller checkpoint (or the target quantized) drafts k tokens autoregressively over its
own paged KV cache, kept in step with each target sequence."""

from __future__ import annotations

import time

import torch

from tessera.engine.sequence import Sequence
from tessera.engine.speculative.config import SELF_FORMATS
from tessera.engine.speculative.proposer import Draft
from tessera.kernels.sampling import filtered_probs
from tessera.kv import BlockManager, OutOfPagesError
from tessera.models.model import Model
from tessera.models.paged import StepBatch, forward_step, new_cache
from tessera.models.requantize import requantize_model


def self_draft_model(target: Model, fmt: str) -> Model:
    """The target with its projections and output table quantized to ``fmt`` (see
    :data:`tessera.engine.speculative.config.SELF_FORMATS`); norms and the embedding table are shared, not copied.

    A packed target weight is de-quantized first, so ``self:q4_0`` of a Q8_0 file drafts with 4-bit weights. An
    output table whose width is not a multiple of the group stays as it is.
    """
    if fmt not in SELF_FORMATS:
        raise ValueError(f"self-draft format must be one of {list(SELF_FORMATS)}, got {fmt!r}")
    qfmt, group = SELF_FORMATS[fmt]
    try:
        return requantize_model(target, qfmt, group, tables="output", skip_odd_tables=True)
    except ValueError as err:
        raise ValueError(f"self-draft: {err}") from None


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Inverse-CDF draw from one row of probabilities (float, sums to ~1)."""
    cdf = torch.cumsum(probs.double(), 0)
    u = float(torch.rand((), dtype=torch.float64, generator=generator)) * float(cdf[-1])
    pick = min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)
    while probs[pick] <= 0.0:
        pick -= 1
    return pick


class DraftModelProposer:
    """Drafts with ``model`` over its own KV cache.

    Each call syncs every sequence's draft cache to the target's tokens (the longest common prefix stays; tokens the
    target rejected are cut with :meth:`BlockManager.truncate`), feeds what is new in one chunk, and then decodes
    ``k`` tokens, batched over the sequences. Draft tokens are drawn from the draft's filtered distribution with the
    request's own sampler parameters and generator; greedy requests take the argmax.

    Parameters
    ----------
    model : the draft model; its vocabulary must be the target's.
    num_pages, page_size : its KV cache. A sequence that does not fit drafts nothing that step.
    """

    costs_forward = True

    def __init__(self, model: Model, num_pages: int, page_size: int) -> None:
        self.model = model
        self.block_manager = BlockManager(num_pages, page_size, enable_prefix_caching=False)
        self.cache = new_cache(model, num_pages, page_size)
        self._fed: dict[int, list[int]] = {}  # seq_id -> tokens whose KV is in the draft cache
        #: the last proposal's forward times in seconds per sequence: (first, mean of the rest), None where not
        #: measured. The first is kept only when it fed at most two tokens per sequence (a steady draft step); a
        #: longer catch-up (the prompt, or the tokens decoded while drafting paused) is not what drafting costs
        #: from step to step.
        self.last_timing: tuple[float | None, float | None] = (None, None)

    def release(self, seq_id: int) -> None:
        if seq_id in self._fed:
            del self._fed[seq_id]
            self.block_manager.free(seq_id)

    @torch.no_grad()
    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        bm = self.block_manager
        active, feeds = [], []  # indices into seqs, and the tokens each feeds first
        for i, seq in enumerate(seqs):
            new = self._sync(seq)
            if new is not None:
                active.append(i)
                feeds.append(new)
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        # the first forward's time per sequence, kept only when that forward was a steady step (see last_timing)
        first: float | None = None
        timed_first = False
        following: list[float] = []
        while active:
            start = time.perf_counter()
            steady = max(len(f) for f in feeds) <= 2
            logits = self._forward([seqs[i] for i in active], feeds)
            greedy = [i for i in active if seqs[i].params.temperature == 0 and not seqs[i].params.has_penalties]
            rows = {i: r for r, i in enumerate(active)}
            best = logits[[rows[i] for i in greedy]].argmax(dim=-1).tolist() if greedy else []
            drawn = dict(zip(greedy, best))
            sampled = [i for i in active if i not in drawn]
            if sampled:
                q = filtered_probs(logits[[rows[i] for i in sampled]], [seqs[i].params for i in sampled],
                                   token_counts=[seqs[i].token_ids + tokens[i] for i in sampled],
                                   backend=self.model.backend)
                for r, i in enumerate(sampled):
                    drawn[i] = _draw(q[r], seqs[i].generator)
                    probs[i].append(q[r])
            next_active, next_feeds = [], []
            for i in active:
                tokens[i].append(drawn[i])
                if len(tokens[i]) < max_tokens[i] and bm.can_append(seqs[i].seq_id, 1):
                    next_active.append(i)
                    next_feeds.append([drawn[i]])
            per_seq = (time.perf_counter() - start) / len(active)
            if not timed_first:
                timed_first = True
                first = per_seq if steady else None
            else:
                following.append(per_seq)
            active, feeds = next_active, next_feeds
        self.last_timing = (first, sum(following) / len(following) if following else None)
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _sync(self, seq: Sequence) -> list[int] | None:
        """Cut the draft cache of ``seq`` to its common prefix with the target's tokens and reserve slots for the
        rest; return the tokens to feed, or None when the cache has no room (the sequence drafts nothing)."""
        bm, target = self.block_manager, seq.token_ids
        fed = self._fed.get(seq.seq_id)
        if fed is None:
            fed = []
        keep = 0
        limit = min(len(fed), len(target) - 1)  # at least one token is fed: its logits give the first draft
        while keep < limit and fed[keep] == target[keep]:
            keep += 1
        new = target[keep:]
        try:
            if seq.seq_id not in self._fed:
                bm.allocate(seq.seq_id, new)
            else:
                bm.truncate(seq.seq_id, keep)
                bm.append(seq.seq_id, new)
        except OutOfPagesError:
            self.release(seq.seq_id)
            return None
        self._fed[seq.seq_id] = fed[:keep]  # _forward adds ``new`` once its KV is written
        return new

    def _forward(self, seqs: list[Sequence], feeds: list[list[int]]) -> torch.Tensor:
        """One draft forward: ``feeds[i]`` are appended to sequence i's draft cache; returns each one's last logits.
        The slots of a first feed were reserved by :meth:`_sync`; a later feed (the previous draft) reserves its own
        one here."""
        bm, device = self.block_manager, self.cache.device
        ids, slots, q_lens, kv_lens, tables = [], [], [], [], []
        for seq, feed in zip(seqs, feeds):
            fed = self._fed[seq.seq_id]
            if bm.num_tokens(seq.seq_id) == len(fed):  # a decode feed: its slot is not reserved yet
                bm.append(seq.seq_id, feed)
            fed.extend(feed)
            end = len(fed)
            ids += feed
            slots += bm.slot_mapping(seq.seq_id, end - len(feed), end)
            q_lens.append(len(feed))
            kv_lens.append(end)
            tables.append(bm.page_table(seq.seq_id))
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        step = StepBatch(torch.tensor(ids, dtype=torch.int64, device=device), q_lens, kv_lens, table,
                         torch.tensor(slots, dtype=torch.int64, device=device))
        return forward_step(self.model, self.cache, step)
