"""Run one request of an :class:`tessera.engine.LLM` under ``torch.profiler`` with op accounting on.

The request is a random prompt of ``prompt_len`` token ids generating exactly ``gen_len`` tokens (greedy,
``ignore_eos``), after a short warm-up generate that compiles the Numba kernels (and fills caches) the run will use,
so compile time does not show up as op time. Prefix caching stays off in the engine the caller builds (see
:func:`tessera.tools.profile`), and the warm-up prompt differs from the profiled one anyway.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.profiling.accounting import OpAccounting, account_ops, force_unfused

#: Tokens the warm-up generates: enough for a prefill step and a few decode steps.
WARMUP_TOKENS = 4
#: Random prompt ids start here, past the special tokens small vocabularies put first.
FIRST_ID = 3


@dataclass(slots=True)
class ProfileResult:
    """One profiled request.

    Attributes
    ----------
    ops : OpAccounting, per-op calls, seconds, FLOPs and bytes
    wall_seconds : float, wall time of the whole ``generate`` call (profiler overhead included)
    prompt_len, gen_len : int, prompt tokens and generated tokens
    time_to_first_token : float, seconds (the prefill step, plus scheduling)
    decode_seconds : float, seconds from the first token to the last
    trace_path : Path or None, the Chrome/Perfetto trace written
    """

    ops: OpAccounting
    wall_seconds: float
    prompt_len: int
    gen_len: int
    time_to_first_token: float
    decode_seconds: float
    trace_path: Path | None

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_len / self.time_to_first_token if self.time_to_first_token > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = self.gen_len - 1  # the first token comes out of the prefill step
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0

    @property
    def other_seconds(self) -> float:
        """Wall time outside every accounted op: Python, scheduling, detokenizing, tensor glue."""
        return max(self.wall_seconds - self.ops.seconds, 0.0)


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    """``length`` token ids drawn uniformly from ``[FIRST_ID, vocab_size)``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ID, vocab_size, (length,), generator=gen).tolist()


def profile_request(llm, prompt_len: int, gen_len: int, trace_path: str | Path | None = "tessera-profile.json",
                    unfused: bool = False, phases: bool = True, seed: int = 0) -> ProfileResult:
    """Warm up, then profile one request of ``prompt_len`` random tokens generating ``gen_len`` tokens.

    Parameters
    ----------
    llm : tessera.engine.LLM
        Built with ``max_num_batched_tokens >= prompt_len`` to prefill in one step, and prefix caching off.
    prompt_len, gen_len : int >= 1
    trace_path : where to write the Chrome/Perfetto trace JSON (None: no trace).
    unfused : run decode steps on the per-op path instead of the fused decoder-layer kernel.
    phases : account prefill and decode steps separately (``"matmul (prefill)"``, ``"matmul (decode)"``).
    seed : seed of the random prompts.

    Returns
    -------
    ProfileResult

    Examples
    --------
    >>> result = profile_request(LLM(enable_prefix_caching=False), 64, 16)
    >>> result.ops.sorted()[0].name, f"{result.decode_tok_s:.1f} tok/s"
    """
    from tessera.engine import SamplingParams

    if prompt_len < 1 or gen_len < 1:
        raise ValueError(f"profile_request: prompt_len and gen_len must be >= 1, got {prompt_len} and {gen_len}")
    vocab = llm.model.config.vocab_size
    path_mode = force_unfused() if unfused else contextlib.nullcontext()
    with path_mode:
        warmup = SamplingParams(max_tokens=min(gen_len, WARMUP_TOKENS), temperature=0.0, ignore_eos=True)
        llm.generate([random_prompt(vocab, prompt_len, seed + 1)], warmup)
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    prompt = random_prompt(vocab, prompt_len, seed)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof, account_ops(unfused, phases) as ops:
        start = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        wall = time.perf_counter() - start
    if trace_path is not None:
        trace_path = Path(trace_path)
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
    ttft = out.time_to_first_token or 0.0
    decode = (out.latency or 0.0) - ttft
    return ProfileResult(ops, wall, prompt_len, len(out.token_ids), ttft, decode, trace_path)
