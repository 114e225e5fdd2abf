"""``LLM``: load a model, then ``generate`` many prompts with continuous batching over a paged KV cache."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from tessera.backends import resolve_device
from tessera.engine.params import RequestOutput, SamplingParams
from tessera.engine.runner import Runner
from tessera.engine.scheduler import Scheduler
from tessera.engine.sequence import Sequence
from tessera.engine.speculative import SpeculativeConfig, SpeculativeDecoder, parse_speculative
from tessera.engine.text_check import surrogate_message
from tessera.kv import BlockManager
from tessera.models.load import load_model
from tessera.models.model import Model, to_device
from tessera.kv.quantized import bytes_per_token, check_format
from tessera.models.paged import new_cache

Prompt = str | list[int]
DEFAULT_KV_CACHE_MEMORY = 256 * 2**20


class LLM:
    """An offline inference engine: a model, its paged KV cache, a scheduler and a runner.

    Parameters
    ----------
    model : a checkpoint path (GGUF file or Hugging Face directory), an already loaded :class:`Model`, or None for
        SmolLM2-135M-Instruct.
    dtype, backend : as :func:`tessera.models.load_model` (ignored for a loaded model).
    max_num_seqs : sequences running at once at most.
    max_num_batched_tokens : new tokens per step at most (prompt chunks are cut to fit: chunked prefill).
    page_size : tokens per KV page.
    num_pages : KV pages; None derives it from ``kv_cache_memory`` (capped at what ``max_num_seqs`` full-length
        sequences could use).
    kv_cache_memory : bytes for K and V of all layers when ``num_pages`` is None.
    kv_cache_dtype : None (K/V in the model's dtype), ``"int8"`` or ``"fp8_e4m3"``: pages hold codes and a float16
        scale per token and head, quantized as they are written (docs/quantization.md), about half of bf16's bytes,
        so the same ``kv_cache_memory`` holds ~2x the tokens of bf16 (~4x float32's).
    enable_prefix_caching : reuse the KV of full pages shared with earlier prompts.
    keep_quantized : GGUF only, as :func:`tessera.models.load_model`: None (default) keeps Q4_0 / Q4_1 / Q8_0
        projections packed, False dequantizes every weight to ``dtype``.
    device : where the weights, the KV cache and each step's tensors live: None for the backend's default
        (``"cuda"`` for ``backend="triton"`` on a GPU, else ``"cpu"``). With a loaded ``Model``, its weights are
        copied there when they live elsewhere.
    speculative : speculative decoding: None (off), ``"ngram"`` (prompt lookup), ``"draft:PATH"`` (a smaller
        checkpoint with the same vocabulary), ``"self:FORMAT"`` (this model's weights quantized to ``q4_0`` /
        ``q4_1`` / ``q8_0``), or a :class:`tessera.engine.speculative.SpeculativeConfig`. Greedy outputs are
        unchanged and sampled outputs keep their distribution (docs/speculative.md); a request opts out with
        ``SamplingParams(speculative=False)``.
    num_draft : the most tokens drafted per sequence and step (1..7; default 4); fewer when they do not pay off.
    tensor_parallel_size : ranks the model is split across on this machine (tensor parallelism over
        torch.distributed, gloo, one thread per rank; docs/distributed.md). 1 (default) runs in this process alone.
        With N > 1, N - 1 worker processes are spawned; :attr:`model` is then rank 0's shard. Call :meth:`shutdown`
        (or let the LLM be collected) to stop them. A speculative draft runs whole on rank 0. Under torchrun
        (docs/distributed.md) every rank loads only its own shard of a checkpoint path, cutting each weight as it is
        read; rank 0 loads the whole model only for a ``"self:FORMAT"`` draft, which quantizes it.

    Examples
    --------
    >>> llm = LLM()
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
    >>> out[0].text, out[0].finish_reason
    """

    def __init__(self, model: str | Path | Model | None = None, dtype: str = "float32", backend: str = "auto",
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 512, page_size: int = 16,
                 num_pages: int | None = None, kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
                 enable_prefix_caching: bool = True, keep_quantized: bool | None = None,
                 device: str | torch.device | None = None,
                 speculative: str | SpeculativeConfig | None = None, num_draft: int | None = None,
                 kv_cache_dtype: str | None = None, tensor_parallel_size: int = 1) -> None:
        spec_config = parse_speculative(speculative, num_draft)  # a bad value fails before the model loads
        tp = tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"LLM: tensor_parallel_size must be an int >= 1, got {tensor_parallel_size!r}")
        self.kv_cache_dtype = check_format(kv_cache_dtype, "LLM")
        sharded = None  # under torchrun: this rank's shard, loaded rank-locally
        if isinstance(model, Model):
            self.model = model if device is None else to_device(model, resolve_device(model.backend, device))
        elif _loads_rank_locally(tp, spec_config):
            from tessera.distributed import rank_local, torchrun

            launch = torchrun.launch_env()
            torchrun.check_world(launch, tp)  # before loading: a wrong world would plan the wrong cut
            sharded = rank_local.load_shard(model, launch.rank, tp, dtype, backend, keep_quantized=keep_quantized,
                                            device=device)
            self.model = sharded.model  # the whole config; the weights are this rank's shard
        else:
            self.model = load_model(model, dtype=dtype, backend=backend, keep_quantized=keep_quantized, device=device)
        self.max_len = self.model.config.max_position
        if num_pages is None:
            num_pages = self._pages_for(kv_cache_memory, page_size, max_num_seqs)
        self.block_manager = BlockManager(num_pages, page_size, enable_prefix_caching)
        # the whole model, before a tensor-parallel engine replaces self.model with rank 0's shard: a self-draft
        # quantizes it and a draft checkpoint loads like it, and the draft runs whole on rank 0 (docs/distributed.md).
        # A rank-local load has only rank 0's weights, which is all a draft checkpoint or n-gram lookup needs.
        whole_model = self.model
        self.tensor_parallel = None
        if tensor_parallel_size > 1:  # rank 0 here, workers spawned; each rank holds its shard of weights and KV
            from tessera.distributed.launch import TensorParallelEngine

            self.tensor_parallel = TensorParallelEngine(sharded if sharded is not None else self.model,
                                                        tensor_parallel_size, num_pages, page_size,
                                                        self.kv_cache_dtype)
            self.model, self.cache = self.tensor_parallel.model, self.tensor_parallel.cache
        else:
            self.cache = new_cache(self.model, num_pages, page_size, self.kv_cache_dtype)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.speculative: SpeculativeDecoder | None = None
        if spec_config is not None:
            from tessera.engine.speculative.decoder import build_proposer

            proposer = build_proposer(spec_config, whole_model, num_pages, page_size)
            self.speculative = SpeculativeDecoder(spec_config, proposer, self.max_len)
            self.scheduler.on_release = self.speculative.release
        self.runner = Runner(self.model, self.cache, self.block_manager, self.speculative)
        if self.tensor_parallel is not None:
            self.runner.forward_step = self.tensor_parallel.forward_step
        self._ids = itertools.count()
        self.last_output: RequestOutput | None = None

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker ranks, if any (idempotent; a single-process LLM has nothing to stop)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.shutdown()

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def max_seq_tokens(self) -> int:
        """The most tokens (prompt plus generated) one sequence can hold: the context length, or fewer when the
        whole KV cache holds fewer. A request whose prompt plus ``max_tokens`` needs more is refused."""
        bm = self.block_manager
        return min(self.max_len, bm.num_pages * bm.page_size)

    def _pages_for(self, memory: int, page_size: int, max_num_seqs: int) -> int:
        c = self.model.config
        per_page = c.num_layers * page_size * bytes_per_token(c.num_kv_heads, c.head_dim, self.model.dtype,
                                                               self.kv_cache_dtype)
        wanted = max_num_seqs * math.ceil(self.max_len / page_size)
        pages = min(memory // per_page, wanted)
        if pages < 1:
            raise ValueError(f"LLM: kv_cache_memory={memory} bytes holds no KV page ({per_page} bytes each); "
                             "give more memory or pass num_pages")
        return int(pages)

    # ------------------------------------------------------------------------------------------- requests
    def generate(self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs come back in prompt order.

        Parameters
        ----------
        prompts : strings (tokenized with the model's tokenizer) or lists of token ids.
        params : one :class:`SamplingParams` for all, one per prompt, or None (defaults).

        Raises
        ------
        ValueError
            A bad request (empty prompt, unknown token ids, prompt too long, params list of the wrong length);
            the message names the prompt's index. Nothing runs when any request is bad.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("generate: prompts must be a list of prompts; wrap a single prompt in a list")
        seqs = self._make_sequences(prompts, params)
        for seq in seqs:
            self.scheduler.add(seq)
        try:
            while any(not s.group_finished for s in seqs):
                self.step()
        finally:
            for seq in seqs:  # an error mid-run must not leave pages held by a dead request
                if not seq.group_finished:
                    self.scheduler.abort(seq)
        return [s.output() for s in seqs]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request as it grows (whole characters; stop strings never show).

        Text that could still turn out to be the start of a stop string is held back until it cannot. When the
        generator is exhausted, ``self.last_output`` holds the finished request's :class:`RequestOutput` (token ids,
        timings), e.g. for the tokens/s line of ``tessera generate``.
        """
        if params is not None and params.n != 1:
            raise ValueError(f"stream: one text stream per call; got n={params.n} (use generate for n > 1)")
        (seq,) = self._make_sequences([prompt], params)
        self.scheduler.add(seq)
        sent = 0
        try:
            while not seq.is_finished:
                self.step()
                safe = seq.shown_text_end(sent)
                if safe > sent:
                    yield seq.text[sent:safe]
                    sent = safe
            self.last_output = seq.output()
        finally:
            if not seq.is_finished:
                self.scheduler.abort(seq)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Render conversation(s) with the model's chat template (``add_generation_prompt=True``) and generate."""
        from tessera.engine.chat import render_chat

        if self.model.chat_template is None:
            raise ValueError("chat: the model has no chat template; use generate with a rendered prompt")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [render_chat(self.model.chat_template, conv) for conv in conversations]
        return self.generate(prompts, params)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> Sequence:
        """Validate and queue one request without running it; :meth:`step` advances it (a server's loop).

        Returns its :class:`Sequence`: ``.text`` and ``.output_ids`` grow as steps run, ``.is_finished`` and
        ``.output()`` report the end. With ``params.n > 1`` it is sample 0; ``.group`` lists every sample and
        ``.group_finished`` says when all are done. Raises ValueError / TypeError for a bad request (nothing is
        queued).
        """
        (seq,) = self._make_sequences([prompt], params)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a request now and return its KV pages (finish reason ``"abort"`` unless it had finished)."""
        self.scheduler.abort(seq)

    def has_unfinished(self) -> bool:
        """Whether any queued or running request remains (then :meth:`step` has work)."""
        return self.scheduler.has_unfinished()

    def stats(self) -> dict[str, float]:
        """Engine gauges and counters: queue, running sequences, KV pages, prefix-cache hits, preemptions."""
        bm, sched = self.block_manager, self.scheduler
        prompt = sched.num_prompt_tokens
        return {
            # sequences, counting the samples that will fork from a waiting request (n > 1)
            "num_waiting": sum(1 + len(s.pending_children) for s in sched.waiting),
            "num_running": len(sched.running),
            "kv_pages_total": bm.num_pages,
            "kv_pages_free": bm.num_free_pages,
            "kv_pages_used": bm.num_pages - bm.num_free_pages,
            "prefix_cache_queried_tokens": prompt,
            "prefix_cache_hit_tokens": sched.num_cached_prompt_tokens,
            "prefix_cache_hit_rate": sched.num_cached_prompt_tokens / prompt if prompt else 0.0,
            "num_preemptions": sched.num_preemptions,
            **(self.speculative.stats() if self.speculative is not None else {}),
        }

    def step(self) -> list[Sequence]:
        """One engine step: (draft,) schedule, run, sample (verify), update; returns the sequences that finished."""
        spec = self.speculative
        if spec is not None:  # drafts first: the scheduler reserves their slots with the decode's
            bm = self.block_manager
            spec.propose([s for s in self.scheduler.running if bm.num_tokens(s.seq_id) == s.num_tokens - 1])
        out = self.scheduler.schedule()
        if not out.scheduled:
            raise RuntimeError("LLM.step: requests are waiting but none could be scheduled: the KV cache is too "
                               "small for the next request; give LLM more num_pages")
        start = time.perf_counter()
        results = self.runner.execute(out)
        if spec is not None:
            decodes = [item.num_new for item in out.scheduled if item.start >= len(item.seq.prompt_ids)]
            if len(decodes) == len(out.scheduled):  # the cost fit takes pure decode steps only
                spec.observe_step(time.perf_counter() - start, decodes)
            spec.num_steps += any(item.draft is not None for item in out.scheduled)
        return self.scheduler.update(out, results)

    # ---------------------------------------------------------------------------------------- validation
    def _make_sequences(self, prompts: Seq[Prompt], params) -> list[Sequence]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"generate: got {len(prompts)} prompts but {len(params)} SamplingParams; pass one "
                             "SamplingParams for all or one per prompt")
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"request {i}: params must be tessera.engine.SamplingParams, got {type(p).__name__}")
            ids = self._check_prompt(i, prompt, p)
            group = []
            for sample in range(p.n):
                generator = torch.Generator().manual_seed(p.seed + sample) if p.seed is not None else None
                group.append(Sequence(next(self._ids), ids, p, self.model.config.eos_token_ids, self.max_len,
                                      self.tokenizer, generator, request_id=i, sample_index=sample))
            for seq in group:
                seq.group = group
            group[0].pending_children = group[1:]
            seqs.append(group[0])
        return seqs

    def _check_prompt(self, i: int, prompt: Prompt, p: SamplingParams) -> list[int]:
        if isinstance(prompt, str):
            bad_text = surrogate_message(prompt, f"request {i}: the prompt")
            if bad_text is not None:  # checked first: the tokenizer's own error does not say what is wrong
                raise ValueError(bad_text)
            if self.tokenizer is None:
                raise ValueError(f"request {i}: a text prompt needs a tokenizer and this model has none; pass "
                                 "token ids instead")
            ids = self.tokenizer.encode(prompt).ids
        else:
            ids = list(prompt)
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError(f"request {i}: the prompt is empty; a prompt needs at least 1 token")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {i}: token ids must be ints in [0, {vocab}), got {bad[:5]}")
        if len(ids) >= self.max_len:
            raise ValueError(f"request {i}: the prompt has {len(ids)} tokens but the context holds {self.max_len}, "
                             f"leaving no room to generate; shorten the prompt to at most {self.max_len - 1}")
        if p.grammar_source is not None and (self.tokenizer is None or not self.model.config.eos_token_ids):
            raise ValueError(f"request {i}: structured output (json_schema / regex / grammar / json_object) needs the "
                             "model's tokenizer and an EOS token, and this model lacks one; drop the constraint")
        if p.n > self.scheduler.max_num_seqs:
            raise ValueError(f"request {i}: n={p.n} samples run at once but max_num_seqs is "
                             f"{self.scheduler.max_num_seqs}; lower n or raise max_num_seqs")
        bm = self.block_manager
        # one sample alone must fit; parallel samples that do not fit together are preempted and run in turn
        need = math.ceil(min(len(ids) + p.max_tokens, self.max_len) / bm.page_size)
        if need > bm.num_pages:
            room = self.max_seq_tokens - len(ids)
            fix = (f"lower max_tokens to at most {room}" if room >= 1 else
                   f"shorten the prompt to at most {self.max_seq_tokens - 1} tokens")
            raise ValueError(f"request {i}: prompt + max_tokens need {need} KV pages but the cache has "
                             f"{bm.num_pages} ({self.max_seq_tokens} tokens); the prompt has {len(ids)} tokens, so "
                             f"{fix}, or give LLM more num_pages")
        return ids


def _loads_rank_locally(tensor_parallel_size: int, speculative: SpeculativeConfig | None) -> bool:
    """Whether this process is one rank of a torchrun group that loads only its shard of a checkpoint path: every
    rank, except rank 0 when a self-draft needs the whole model to quantize (the workers still load rank-locally:
    the draft runs on rank 0 alone)."""
    if tensor_parallel_size < 2:
        return False
    from tessera.distributed.torchrun import launch_env

    launch = launch_env()
    if launch is None:
        return False
    return launch.rank > 0 or speculative is None or speculative.method != "self"
