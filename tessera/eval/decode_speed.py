"""Batch-1 greedy decode speed of a loaded model in the engine: what a weight or KV format gains (or costs) in
tokens per second.

One request at a time (``LLM(model, max_num_seqs=1)``): a short prompt, then ``tokens`` greedy tokens with EOS
ignored, so every run decodes the same number of tokens. A warm-up request runs first (it compiles or loads the
kernels the shapes need); each timed run's decode rate is ``(tokens - 1) / (latency - time to first token)``, the
steps after the one that samples the first token, less any time kernels took to compile or load meanwhile. The
median of the runs is reported.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tessera.models.model import Model

#: tokens per page of the engine's cache here (the engine's default)
PAGE_SIZE = 16


@dataclass(frozen=True)
class DecodeSpeed:
    """Decode tokens/s of one model and KV format.

    Attributes
    ----------
    tok_s : float
        Median of ``runs``.
    runs : list of float
        Each timed run's decode rate.
    tokens : int
        Tokens generated per run.
    prompt_tokens : int
        Tokens of the prompt.
    excluded_seconds : float
        Kernel compile or load time inside the timed runs, left out of the rates (0 once warm).
    others_busy : float
        Fraction of the machine's CPU time other processes used during the timed runs (0: the runs had it to
        themselves; on a shared machine the rates are low by about that much).
    """

    tok_s: float
    runs: list[float]
    tokens: int
    prompt_tokens: int
    excluded_seconds: float
    others_busy: float


def decode_speed(model: Model, prompt: Sequence[int], tokens: int = 32, repeats: int = 3,
                 kv_cache_dtype: str | None = None) -> DecodeSpeed:
    """Measure ``model``'s batch-1 greedy decode rate (see the module docstring).

    Parameters
    ----------
    model : the loaded model (any weight format)
    prompt : token ids of the prompt
    tokens : tokens to generate per run, at least 2
    repeats : timed runs, at least 1
    kv_cache_dtype : None (pages in the model's dtype), ``"int8"`` or ``"fp8_e4m3"``

    Raises
    ------
    ValueError
        ``tokens < 2``, ``repeats < 1``, an empty prompt, or a prompt plus tokens longer than the model's context.
    """
    from tessera._compile_clock import kernel_clock
    from tessera.engine import LLM, SamplingParams
    from tessera.hw import probes

    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2:
        raise ValueError(f"decode_speed: tokens must be an int >= 2 (the rate counts the steps after the first), "
                         f"got {tokens!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"decode_speed: repeats must be a positive int, got {repeats!r}")
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("decode_speed: the prompt is empty")
    if len(prompt) + tokens > model.config.max_position:
        raise ValueError(f"decode_speed: {len(prompt)} prompt tokens + {tokens} exceed the model's "
                         f"{model.config.max_position} positions")
    # a cache of just the pages one request needs, and no prefix cache: every run prefills and decodes the same way
    pages = math.ceil((len(prompt) + tokens) / PAGE_SIZE) + 1
    llm = LLM(model, max_num_seqs=1, page_size=PAGE_SIZE, num_pages=pages, enable_prefix_caching=False,
              kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up: compiles or loads the kernels of these shapes
    rates, excluded = [], 0.0
    before, began = probes.cpu_seconds(), time.perf_counter()
    with kernel_clock() as clock:
        for _ in range(repeats):
            start = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            first, end = start + out.time_to_first_token, start + out.latency
            late = clock.seconds(first, end)
            excluded += late
            rates.append((len(out.token_ids) - 1) / (out.latency - out.time_to_first_token - late))
    others = probes.others_busy_fraction(before, probes.cpu_seconds(), time.perf_counter() - began)
    return DecodeSpeed(statistics.median(rates), rates, tokens, len(prompt), excluded, others)
