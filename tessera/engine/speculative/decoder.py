"""The engine's speculative decoding: who drafts, how many tokens, verification of a step's drafts, and metrics."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tessera.engine.sequence import Sequence, Status
from tessera.engine.speculative.config import SpeculativeConfig
from tessera.engine.speculative.costs import StepCosts
from tessera.engine.speculative.proposer import Draft, Proposer
from tessera.engine.speculative.verify import Verdict, verify_draft, verify_greedy
from tessera.kernels.sampling import filtered_probs, sample
from tessera.models.model import Model

#: acceptance prior of a sequence before anything was verified: (accepted, observed) pseudo-counts
_PRIOR = {"ngram": (1.0, 2.0), "draft": (1.4, 2.0), "self": (1.6, 2.0)}
#: how fast a sequence's acceptance estimate forgets (per verified step)
_DECAY = 0.8
#: a sequence whose best k is 0 still drafts one token every this many decodes, so its estimate can recover
_PROBE_EVERY = 8


def build_proposer(config: SpeculativeConfig, target: Model, num_pages: int, page_size: int) -> Proposer:
    """The proposer ``config`` names, with a draft cache of ``num_pages`` pages where it needs one."""
    if config.method == "ngram":
        from tessera.engine.speculative.ngram import NgramProposer

        return NgramProposer(config.ngram_max, config.ngram_min)
    from tessera.engine.speculative.draft_model import DraftModelProposer, self_draft_model

    if config.method == "self":
        draft = self_draft_model(target, config.self_format)
    else:
        from tessera.models.load import load_model

        path = Path(config.draft_path)
        if not path.exists():
            raise FileNotFoundError(f"speculative: draft model {path} does not exist; pass 'draft:PATH' with a GGUF "
                                    "file or checkpoint directory")
        draft = load_model(path, dtype=str(target.dtype).removeprefix("torch."), backend=target.backend,
                           device=target.device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative: the draft model's vocabulary has {draft.config.vocab_size} tokens but the "
                         f"target's has {target.config.vocab_size}; a draft must share the target's tokenizer")
    return DraftModelProposer(draft, num_pages, page_size)


class SpeculativeDecoder:
    """Drafts tokens for decoding sequences before a step, verifies them after the target's forward, and keeps
    the acceptance statistics that size each sequence's next draft.

    Parameters
    ----------
    config : what to draft with and how many tokens at most.
    proposer : the :class:`Proposer` (see :func:`build_proposer`).
    max_len : the context length (no draft reaches past it).

    How many tokens a sequence drafts (``adaptive``): with acceptance rate ``a`` (a decayed count per sequence),
    ``k`` drafts yield ``(1 - a^(k+1)) / (1 - a)`` tokens per step on average, at a cost of
    ``1 + f + (k - 1) n + k v`` one-token target steps: ``f`` and ``n`` a draft model's first and each further
    forward (0 for the n-gram lookup), ``v`` the target's extra time per verified token, all measured
    (:class:`~tessera.engine.speculative.costs.StepCosts`). The ``k`` in ``0..num_draft`` with the best ratio wins, so a draft that does not pay for itself
    stops being made (a probe every few steps lets the estimate recover).
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_len: int) -> None:
        self.config, self.proposer, self.max_len = config, proposer, max_len
        self._acceptance: dict[int, list[float]] = {}
        self._since_probe: dict[int, int] = {}
        self.costs = StepCosts()
        self.num_steps = 0  # steps that verified drafts
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_emitted = 0  # tokens produced by verified steps (accepted drafts + one per sequence)
        self.num_verified_seqs = 0
        self.draft_seconds = 0.0

    # --------------------------------------------------------------------------------------------- drafting
    def wanted(self, seq: Sequence) -> int:
        """How many tokens to draft for ``seq`` now (0: decode plainly)."""
        if not seq.params.speculative:
            return 0
        room = min(seq.params.max_tokens - len(seq.output_ids), self.max_len - seq.num_tokens) - 1
        limit = min(self.config.num_draft, room)
        if limit <= 0:
            return 0
        if not self.config.adaptive:
            return limit
        k = self._best_k(seq.seq_id, limit)
        if k == 0:
            waited = self._since_probe.get(seq.seq_id, 0) + 1
            self._since_probe[seq.seq_id] = waited
            if waited >= _PROBE_EVERY:
                self._since_probe[seq.seq_id] = 0
                return 1
        return k

    def _best_k(self, seq_id: int, limit: int) -> int:
        acc, seen = self._acceptance.get(seq_id) or _PRIOR[self.config.method]
        a = min(acc / seen, 0.999) if seen > 0 else 0.0
        first, following, verify = self.costs.ratios()
        if not self.proposer.costs_forward:
            first = following = 0.0
        best_k, best = 0, 1.0
        for k in range(1, limit + 1):
            cost = 1.0 + first + (k - 1) * following + k * verify
            value = (1.0 - a ** (k + 1)) / (1.0 - a) / cost
            if value > best * 1.02:  # a draft must win clearly: its cost estimate is noisy
                best_k, best = k, value
        return best_k

    def propose(self, seqs: list[Sequence]) -> None:
        """Set ``seq.draft`` on every running sequence that is about to decode and wants drafts (None elsewhere)."""
        wanted = []
        for seq in seqs:
            seq.clear_draft()
            if seq.status is Status.RUNNING and not seq.is_finished:
                k = self.wanted(seq)
                if k > 0:
                    wanted.append((seq, k))
        if not wanted:
            return
        start = time.perf_counter()
        drafts = self.proposer.propose([s for s, _ in wanted], [k for _, k in wanted])
        elapsed = time.perf_counter() - start
        self.draft_seconds += elapsed
        for (seq, _), draft in zip(wanted, drafts):
            seq.draft = draft if draft.tokens else None
        timing = getattr(self.proposer, "last_timing", None)
        if timing is not None:
            self.costs.observe_draft(*timing)

    def observe_step(self, seconds: float, tokens_per_seq: list[int]) -> None:
        """Record a target step's time and each scheduled decode's token count (1 + its drafts) for the cost fit."""
        if tokens_per_seq:
            self.costs.observe_step(seconds / len(tokens_per_seq), round(sum(tokens_per_seq) / len(tokens_per_seq)))

    # ------------------------------------------------------------------------------------------ verification
    def verify(self, seq: Sequence, draft: Draft, logits: torch.Tensor, backend: str) -> list[int]:
        """The tokens ``seq`` emits this step: its accepted drafts and one more token from the target.

        ``logits`` float32 ``[k + 1, V]``: the target's logits at the last sampled token and at each drafted one.
        """
        params, tokens = seq.params, draft.tokens
        k = len(tokens)
        if params.temperature == 0 and not params.has_penalties:
            best = logits.argmax(dim=-1).tolist()
            verdict = verify_greedy(best[:k], tokens)
            out = tokens[:verdict.num_accepted] + [best[verdict.num_accepted] if verdict.correction is None
                                                    else verdict.correction]
        else:
            history = seq.token_ids
            target = filtered_probs(logits[:k], [params] * k,
                                    token_counts=[history + tokens[:j] for j in range(k)] if params.has_penalties
                                    else None, backend=backend)
            verdict = verify_draft(target, tokens, draft.probs, seq.generator)
            out = tokens[:verdict.num_accepted]
            if verdict.correction is not None:
                out.append(verdict.correction)
            else:
                ids, _ = sample(logits[k:], [params], token_counts=[history + tokens] if params.has_penalties
                                else None, generators=[seq.generator], backend=backend)
                out.append(int(ids[0]))
        self._record(seq.seq_id, k, verdict)
        return out

    def _record(self, seq_id: int, drafted: int, verdict: Verdict) -> None:
        accepted = verdict.num_accepted
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.num_emitted += accepted + 1
        self.num_verified_seqs += 1
        acc, seen = self._acceptance.get(seq_id) or _PRIOR[self.config.method]
        self._acceptance[seq_id] = [_DECAY * acc + accepted, _DECAY * seen + accepted + (accepted < drafted)]

    def release(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence (its draft cache pages go back)."""
        self._acceptance.pop(seq_id, None)
        self._since_probe.pop(seq_id, None)
        self.proposer.release(seq_id)

    # ------------------------------------------------------------------------------------------------ metrics
    def stats(self) -> dict[str, float]:
        """Counters for ``LLM.stats()`` and ``/metrics``: drafted and accepted tokens, acceptance rate, mean tokens
        emitted per verified sequence-step, and time spent drafting."""
        return {
            "spec_num_steps": self.num_steps,
            "spec_draft_tokens": self.num_drafted,
            "spec_accepted_tokens": self.num_accepted,
            "spec_acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else 0.0,
            "spec_mean_accepted_length": self.num_emitted / self.num_verified_seqs if self.num_verified_seqs else 0.0,
            "spec_draft_seconds": self.draft_seconds,
        }
