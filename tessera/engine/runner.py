"""Runner: one scheduled step -> page copies, a :class:`StepBatch`, ``forward_step``, and the sampled tokens."""

from __future__ import annotations

import torch

from tessera.engine.scheduler import SchedulerOutput
from tessera.engine.speculative.decoder import SpeculativeDecoder
from tessera.engine.structured.decoding import StructuredDecoder
from tessera.kernels.sampling import sample
from tessera.kv import BlockManager, PagedKVCache
from tessera.models.model import Model
from tessera.models.paged import StepBatch, forward_step


class Runner:
    """Runs the model over the paged cache for the work the scheduler picked.

    Parameters
    ----------
    model : the loaded model.
    cache : its KV page pool (``new_cache(model, num_pages, page_size)``).
    block_manager : the allocator whose page ids index ``cache`` (slots and page tables come from it).
    """

    def __init__(self, model: Model, cache: PagedKVCache, block_manager: BlockManager,
                 speculative: SpeculativeDecoder | None = None) -> None:
        self.model, self.cache, self.block_manager = model, cache, block_manager
        self.speculative = speculative
        # the forward of one step; a tensor-parallel engine puts its own here, which runs it on every rank
        self.forward_step = self._module_forward_step
        #: pick the tokens of an all-greedy step inside the forward (``forward_step(..., greedy=True)``) rather than
        #: from its logits: a tensor-parallel engine's ranks then exchange their best logit instead of gathering
        #: the vocabulary, and a single process skips the sampler's per-step batch (its parameter tensors and a
        #: pass over the row: 60 us alone for one greedy row, 2026-12-05) for the argmax scan (11 us). Same
        #: token: both take the first maximal logit.
        self.greedy_in_forward = True
        self.structured = StructuredDecoder(model.tokenizer, model.config.vocab_size, model.config.eos_token_ids)

    @staticmethod
    def _module_forward_step(*args, **kwargs) -> torch.Tensor:
        # this module's forward_step looked up at each call, not bound at construction: a patch of it (the
        # profiler's phase marker and per-op switch, tests) reaches engines built before the patch
        return forward_step(*args, **kwargs)

    def build_batch(self, out: SchedulerOutput) -> StepBatch:
        """The step's new tokens, positions' slots and page tables, sequence by sequence."""
        bm = self.block_manager
        ids: list[int] = []
        slots: list[int] = []
        q_lens, kv_lens, tables = [], [], []
        for item in out.scheduled:
            end = item.start + item.num_new
            ids += item.seq.token_ids[item.start:end]
            if item.draft is not None:  # the drafted tokens follow the last sampled one (not in the sequence yet)
                ids += item.draft.tokens
            slots += bm.slot_mapping(item.seq.seq_id, item.start, end)
            q_lens.append(item.num_new)
            kv_lens.append(end)
            tables.append(bm.page_table(item.seq.seq_id))
        width = max(len(t) for t in tables)
        device = self.cache.device
        # the page table is planning input, read on the host (StepBatch); tokens and slots feed kernels
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cpu")
        return StepBatch(torch.tensor(ids, dtype=torch.int64, device=device), q_lens, kv_lens, table,
                         torch.tensor(slots, dtype=torch.int64, device=device))

    def execute(self, out: SchedulerOutput) -> dict[int, tuple[int, float]]:
        """Run one step; return ``seq_id -> (token id, logprob, top alternatives or None)`` for each sequence that
        reached its end (and for the samples that fork from it when its prompt completes, ``n > 1``). The logprob is
        0.0 unless the request asked for logprobs."""
        if not out.scheduled:
            return {}
        self.cache.copy_pages(out.page_copies)
        batch = self.build_batch(out)
        drafted = any(item.draft is not None for item in out.scheduled)
        # a step with drafts needs the logits of every verified token, and of only the last token elsewhere
        logit_rows, first_row, offset = [], [], 0
        for item in out.scheduled:
            first_row.append(len(logit_rows))
            width = item.num_new if item.draft is not None else 1
            logit_rows += range(offset + item.num_new - width, offset + item.num_new)
            offset += item.num_new
        rows, seqs = [], []
        for r, item in enumerate(out.scheduled):
            if item.draft is None and item.samples:  # parallel samples draw from the same logits row
                for seq in (item.seq, *item.seq.pending_children):
                    if seq is item.seq or not seq.is_finished:  # a sample aborted before its fork draws nothing
                        rows.append(first_row[r])
                        seqs.append(seq)
        masks = self.structured.begin(seqs)  # structured output: computed while the forward runs; None if unused
        if self.greedy_in_forward and not drafted and masks is None and all(map(_argmax_only, seqs)):
            tokens = self.forward_step(self.model, self.cache, batch, greedy=True).tolist()
            return {s.seq_id: (tokens[row], 0.0, None) for row, s in zip(rows, seqs)}
        logits = self.forward_step(self.model, self.cache, batch, logit_rows=logit_rows if drafted else None)
        results: dict = {}
        for r, item in enumerate(out.scheduled):
            if item.draft is not None:
                at = first_row[r]
                verified = self.speculative.verify(item.seq, item.draft, logits[at:at + item.num_new],
                                                   self.model.backend)
                results[item.seq.seq_id] = self._with_logprobs(item.seq, verified, logits[at:at + len(verified)])
        if not rows:
            return results
        sampled = logits[rows]  # a copy: the logprobs below still read the model's own distribution
        if masks is not None:
            self.structured.apply(masks, sampled)
        ids, _ = sample(
            sampled, [s.params for s in seqs],
            token_counts=[s.token_ids if s.params.has_penalties else None for s in seqs],
            generators=[s.generator for s in seqs], backend=self.model.backend,
        )
        ids_list = ids.tolist()
        if masks is not None:
            self.structured.advance(masks, ids_list)
        results.update({s.seq_id: (t, 0.0, None) for s, t in zip(seqs, ids_list)})
        want = [i for i, s in enumerate(seqs) if s.params.logprobs]
        if want:  # the model's distribution (before penalties, temperature, filters), as OpenAI and vLLM report
            entries = _token_logprobs(logits[[rows[i] for i in want]], [ids_list[i] for i in want],
                                      [seqs[i].params.top_logprobs for i in want])
            results.update({seqs[i].seq_id: entry for i, entry in zip(want, entries)})
        return results

    @staticmethod
    def _with_logprobs(seq, tokens: list[int], logits: torch.Tensor) -> list[tuple]:
        """``(token, logprob, top)`` per emitted token of a verified decode; row ``i`` of ``logits`` is the
        distribution token ``i`` was chosen from."""
        if not seq.params.logprobs:
            return [(t, 0.0, None) for t in tokens]
        return _token_logprobs(logits, tokens, [seq.params.top_logprobs] * len(tokens))


def _argmax_only(seq) -> bool:
    """Whether ``seq``'s next token is the plain argmax of the model's logits: greedy, and nothing that reads or
    changes the logits first (penalties, logprobs; a grammar's mask is checked by the caller)."""
    p = seq.params
    return p.temperature == 0.0 and not p.has_penalties and not p.logprobs and not p.top_logprobs


def _token_logprobs(logits: torch.Tensor, tokens: list[int], top_ns: list[int]
                    ) -> list[tuple[int, float, list[tuple[int, float]] | None]]:
    """``(token, logprob, top)`` per row: the log-probability of ``tokens[i]`` under row ``i`` of ``logits`` (the
    model's distribution, before penalties, temperature and filters), and that row's ``top_ns[i]`` most likely
    ``(token, logprob)`` pairs (None where ``top_ns[i]`` is 0).

    Parameters
    ----------
    logits : torch.Tensor ``[R, V]``, one row per token.
    tokens : the R chosen token ids.
    top_ns : how many alternatives each row reports.

    Returns
    -------
    list of R ``(token, logprob, top)`` tuples.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(tokens, dtype=torch.int64, device=logp.device)[:, None]
    picked = logp.gather(1, chosen)[:, 0].tolist()
    # one topk for all rows, of the largest count asked; each row keeps its own leading ones
    k = max(top_ns, default=0)
    top_v, top_i = logp.topk(k, dim=-1) if k else (None, None)
    return [(t, lp, list(zip(top_i[row, :n].tolist(), top_v[row, :n].tolist())) if n else None)
            for row, (t, lp, n) in enumerate(zip(tokens, picked, top_ns))]
