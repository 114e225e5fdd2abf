"""Kernel warm-up: compile (first run) or load from the cache (later runs) the kernels a model's requests need before
a request whose speed is reported; and ``tessera warmup``, which does only that (``make demo`` runs it first).

:func:`warm_up` runs one tiny request through the caller's engine: up to 14 of the prompt's tokens and two new tokens
with the request's sampling parameters, so the prefill kernels of short prompts, the sampler and one decode step run.
It stays shorter than a KV page, so the prefix cache keeps nothing of it for the real request to reuse. Kernels a
longer prompt needs (another GEMM path) compile during that request's prefill; the caller's
:class:`~tessera._compile_clock.KernelClock` still separates their time. ``tessera warmup`` runs prompts of
:data:`COMMAND_LENGTHS` tokens and a sampled request, on an engine it then discards, and records that this kind of
model is warm (:mod:`tessera.tools.first_run`: a first ``tessera generate`` starts it in the background).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any, TextIO

from tessera.tools.placement_flags import add_placement_flags
from tessera.tools.weight_flags import add_kv_cache_flag, add_weight_flags, keep_quantized

#: the progress line shown when the first kernel compiles
COMPILING = "compiling kernels for this CPU, first run only (they are cached for later runs)..."
MAX_WARMUP_PROMPT = 14
#: prompt lengths `tessera warmup` runs: a one-token prompt, a short one, and one long enough for the GEMM paths of a
#: chat prompt; then one sampled (not greedy) request
COMMAND_LENGTHS = (1, MAX_WARMUP_PROMPT, 64)


class CompileProgress:
    """Prints :data:`COMPILING` when the first kernel starts compiling, and, with ``verbose``, every compiled kernel
    with its time; :meth:`summary` is the closing line. Pass its methods to :func:`tessera._compile_clock.kernel_clock`.
    """

    def __init__(self, out: TextIO | None = None, verbose: bool = False) -> None:
        self._out, self.verbose = out, verbose
        self.started = False
        self.count = 0

    def _print(self, line: str) -> None:
        print(line, file=self._out or sys.stderr, flush=True)  # sys.stderr as it is now (a test may capture it)

    def on_compile(self, name: str) -> None:
        if not self.started:
            self.started = True
            self._print(COMPILING)
        if self.verbose:
            self._print(f"  compiling {name} ...")

    def on_compiled(self, span: Any) -> None:
        self.count += 1
        if self.verbose:
            self._print(f"  compiled {span.name} in {span.end - span.start:.1f} s")

    def summary(self, compile_seconds: float) -> str | None:
        """"compiled N kernels in X s", or None when nothing compiled."""
        if not self.count:
            return None
        return f"compiled {self.count} kernels in {compile_seconds:.1f} s; later runs load them from the cache"


def warm_up(llm: Any, prompt: str | list[int], params: Any) -> None:
    """Run one tiny request shaped like ``prompt`` / ``params`` through ``llm`` (see the module docstring)."""
    ids = llm.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
    # fewer tokens than a KV page holds, prompt and generated together: no full page, nothing for the prefix cache
    n = max(1, min(len(ids), MAX_WARMUP_PROMPT, llm.block_manager.page_size - 2))
    tiny = dataclasses.replace(params, max_tokens=2, ignore_eos=True, stop=[], stop_token_ids=[], n=1)
    llm.generate([ids[:n]], tiny)


def add_parser(commands) -> None:
    p = commands.add_parser("warmup", help="compile the kernels a model needs now (the first run's wait), then exit")
    p.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--verbose", action="store_true", help="list every compiled kernel with its time")
    p.add_argument("--background", action="store_true",
                   help="as started by a first `tessera generate`: at low priority, and only if no other background "
                        "warm-up is running")
    add_placement_flags(p)
    add_weight_flags(p)
    add_kv_cache_flag(p)  # a quantized cache's kernels (its slot writer, the decode items over codes) are their own
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from tessera._compile_clock import kernel_clock
    from tessera.engine import LLM, SamplingParams

    from tessera.tools import first_run

    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, backend=args.backend, max_num_seqs=1, keep_quantized=keep_quantized(args),
              device=args.device, kv_cache_dtype=args.kv_cache_dtype)
    backend = first_run.effective_backend(args.backend, llm.model.device)
    if args.background:
        lock = first_run.hold_lock(backend)  # held until this process ends
        if lock is None and first_run.marker_dir(backend) is not None:
            print("another background warm-up is running; nothing to do", file=sys.stderr)
            return 0
        os.nice(10)  # the request that started it keeps the CPU first
    vocab = llm.model.config.vocab_size
    progress = CompileProgress(verbose=args.verbose)
    with kernel_clock(progress.on_compile, progress.on_compiled) as clock:
        # this engine is thrown away after: whatever the prefix cache keeps does not matter here
        for n in COMMAND_LENGTHS:
            llm.generate([[(1000 + i) % vocab for i in range(n)]],
                         SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        llm.generate([[(2000 + i) % vocab for i in range(8)]],
                     SamplingParams(temperature=0.8, top_p=0.9, seed=0, max_tokens=2, ignore_eos=True))
    first_run.mark_warm(backend, first_run.model_kind(llm.model))
    done = progress.summary(clock.compile_seconds()) or "every kernel was already compiled (loaded from the cache)"
    print(f"{done}; warm-up took {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
