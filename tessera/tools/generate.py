"""``tessera generate``: stream a completion from a model, then report prefill and decode tokens/s.

Before the request a kernel warm-up (:mod:`tessera.tools.warmup`) compiles or loads the kernels it needs, with a
progress line when they compile (a first run). The speeds printed exclude any time spent compiling or loading
kernels, wherever it happened; the time compiling is reported on its own. ``--verbose`` breaks the start-up down:
imports, load (header, weights, tokenizer), engine, kernel warm-up, prefill, decode.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.tools.placement_flags import add_placement_flags
from tessera.tools.speculative_flags import add_speculative_flags, speculative_args
from tessera.tools.weight_flags import add_kv_cache_flag, add_weight_flags, keep_quantized

if TYPE_CHECKING:  # the command imports torch and the engine only when it runs
    from tessera._compile_clock import KernelClock
    from tessera.engine import SamplingParams
    from tessera.engine.params import RequestOutput
    from tessera.models.model import Model

DEFAULT_PROMPT = "Write one sentence about the sea."
PAGE_SIZE = 16  # tokens per KV page (the engine's default)


def add_parser(commands) -> None:
    p = commands.add_parser("generate", help="stream a completion (default model: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--model", help="GGUF file or Hugging Face directory")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (processes) the model is split across on this machine, one thread each "
                        "(docs/distributed.md)")
    p.add_argument("--verbose", action="store_true",
                   help="break the start-up down (imports, load, tokenizer, kernel warm-up, prefill, decode)")
    p.add_argument("--wait-for-kernels", action="store_true",
                   help="on a first run, compile this CPU's kernels before the request (minutes) instead of serving it "
                        "on a backend that needs no compiling while they compile in the background")
    add_placement_flags(p)
    add_weight_flags(p)
    add_kv_cache_flag(p)
    add_speculative_flags(p)
    p.set_defaults(run=_run)


@dataclass
class _Phases:
    """Wall-clock marks (``time.perf_counter``) of one run."""

    start: float
    imported: float = 0.0
    loaded: float = 0.0
    engine: float = 0.0
    warmed: float = 0.0
    request: float = 0.0
    done: float = 0.0


def _run(args: argparse.Namespace) -> int:
    phases = _Phases(time.perf_counter())
    with _long_lived(getattr(args, "owns_process", False)):
        from tessera._compile_clock import kernel_clock
        from tessera.engine import LLM, SamplingParams
        from tessera.engine.chat import render_chat
        from tessera.models.load import load_model
        from tessera.tools.warmup import CompileProgress, warm_up

        phases.imported = time.perf_counter()
        speculative = speculative_args(args)
        load_times: dict[str, float] = {}
        model = load_model(args.model, dtype=args.dtype, backend=args.backend, keep_quantized=keep_quantized(args),
                           device=args.device, timings=load_times)
        phases.loaded = time.perf_counter()
        prompt = args.prompt
        if args.chat:
            if model.chat_template is None:
                print("error: --chat needs a model with a chat template", file=sys.stderr)
                return 2
            prompt = render_chat(model.chat_template, [{"role": "user", "content": args.prompt}])
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        # the quick-start switch changes rank 0's backend mid-run only; tensor-parallel ranks keep one backend
        quick = _quick_start(args, model) if args.tensor_parallel_size == 1 else None
        if quick is not None:
            model = dataclasses.replace(model, backend=quick)
        llm = LLM(model, max_num_seqs=1, page_size=PAGE_SIZE, num_pages=_pages_needed(model, prompt, params),
                  kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size, **speculative)
        phases.engine = time.perf_counter()
    progress = CompileProgress(verbose=args.verbose)
    with kernel_clock(progress.on_compile, progress.on_compiled) as clock:
        if quick is None:  # the quick-start backend compiles nothing: nothing to warm
            warm_up(llm, prompt, params)
        phases.warmed = time.perf_counter()
        compiled = progress.summary(clock.compile_seconds())
        if compiled:
            print(compiled, file=sys.stderr)
        phases.request = time.perf_counter()
        upgrade = _Upgrade(llm, args.backend, model) if quick is not None else None
        for delta in llm.stream(prompt, params):
            print(delta, end="", flush=True)
            if upgrade is not None:
                upgrade.poll()
        phases.done = time.perf_counter()
    print()
    out = llm.last_output
    if out is not None and out.time_to_first_token and out.latency:
        print(_speeds(out, phases, clock), file=sys.stderr)
        if upgrade is not None:
            print(upgrade.summary(len(out.token_ids)), file=sys.stderr)
        if llm.speculative is not None:
            print(_speculation(llm.stats()), file=sys.stderr)
    if args.verbose:
        print(_breakdown(phases, load_times, clock, out, getattr(args, "owns_process", False)), file=sys.stderr)
    if getattr(args, "owns_process", False):
        # os._exit skips the engine's finalizer: stop tensor-parallel workers here, so that ranks started by
        # torchrun get their stop message and exit with status 0 instead of losing rank 0 (no-op for one process)
        llm.shutdown()
        _exit_now()
    return 0


def _quick_start(args: argparse.Namespace, model: Model) -> str | None:
    """On a first run (the model's kernels not compiled for this machine yet), the backend to serve this request on
    while ``tessera warmup`` compiles them in the background (:mod:`tessera.tools.first_run`); None to run as asked
    (kernels ready, ``--wait-for-kernels``, called from Python, or a backend without a quick start)."""
    if not getattr(args, "owns_process", False) or args.wait_for_kernels:
        return None
    from tessera.tools import first_run

    backend = first_run.effective_backend(args.backend, model.device)
    if first_run.is_warm(backend, first_run.model_kind(model)) is not False:
        return None
    quick = backend.quick_start_backend
    started = first_run.start_background_warmup(backend, first_run.warmup_argv(args))
    if started is not None:
        pid, log = started
        where = f"`tessera warmup` compiles them in the background now (pid {pid}, a few minutes; log {log})"
    elif first_run.warmup_running(backend):
        where = "a background `tessera warmup` is compiling them now"
    else:
        return None  # no background compile possible: compile in the foreground, as the warm-up does
    print(f"the {backend.name} backend's kernels for this model are not compiled on this CPU yet: this request runs "
          f"on the {quick} backend (nothing to compile, slower) while {where}. Later runs use them; "
          "--wait-for-kernels compiles them first instead.", file=sys.stderr, flush=True)
    return quick


class _Upgrade:
    """Moves a request that started on the quick-start backend to the backend asked for, between two decode steps, as
    soon as the background warm-up records its kernels compiled (a file check at most every :attr:`EVERY` s). Both
    backends run the same weights and the same KV pages; only the kernels change."""

    EVERY = 0.25

    def __init__(self, llm, backend: str, model: Model) -> None:
        from tessera.tools import first_run

        self._llm, self._backend = llm, backend
        self._target = first_run.effective_backend(backend, model.device)
        self._kind = first_run.model_kind(model)
        self._checked = time.perf_counter()
        self.tokens_before: int | None = None  # tokens streamed when the switch happened
        self._streamed = 0

    def poll(self) -> None:
        from tessera.tools import first_run

        self._streamed += 1
        if self.tokens_before is not None or time.perf_counter() - self._checked < self.EVERY:
            return
        self._checked = time.perf_counter()
        if first_run.is_warm(self._target, self._kind):
            self._llm.model.backend = self._backend  # read by the next step
            draft = getattr(getattr(self._llm.speculative, "proposer", None), "model", None)
            if draft is not None:  # a draft model (--speculative self:/draft:) moves with its target
                draft.backend = self._backend
            self.tokens_before = self._streamed

    def summary(self, tokens: int) -> str:
        quick = self._target.quick_start_backend
        if self.tokens_before is None:
            return f"[all {tokens} tokens on the {quick} backend; the kernels are still compiling in the background]"
        return (f"[the first ~{self.tokens_before} tokens on the {quick} backend, the rest on {self._target.name} "
                "once its kernels compiled]")


def _exit_now() -> None:
    """End the process without the interpreter's teardown (~0.25 s of module and object finalization for torch, Numba
    and the model, none of which has anything left to save: the output is flushed here, the kernel cache was written
    when each kernel compiled, and no file or child process is open). Only when the command is the whole process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextmanager
def _long_lived(owns_process: bool) -> Iterator[None]:
    """When this command is the whole process: no garbage collection while the imports, the model load and the engine
    build objects that live until exit (~1M of them, torch's mostly), then those objects frozen, so that no collection,
    the one at exit included, walks them again. That saves ~0.3 s of collections and ~0.4 s at exit. Left alone
    when called from Python, where frozen objects would outlive their use."""
    if not owns_process:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _pages_needed(model: Model, prompt: str, params: SamplingParams) -> int | None:
    """KV pages for this one request (prompt plus ``max_tokens``), instead of the engine's default pool (256 MiB that
    a one-shot command would allocate and zero for nothing); None when the prompt cannot be measured here."""
    if model.tokenizer is None:
        return None
    tokens = len(model.tokenizer.encode(prompt).ids) + params.max_tokens
    return max(1, math.ceil(min(tokens, model.config.max_position) / PAGE_SIZE))


def _speeds(out: RequestOutput, phases: _Phases, clock: KernelClock) -> str:
    """The request's line: prefill and decode tokens/s without the time kernels took to compile or load."""
    first = phases.request + out.time_to_first_token
    end = phases.request + out.latency
    prefill_time = out.time_to_first_token - clock.seconds(phases.request, first)
    decode_time = out.latency - out.time_to_first_token - clock.seconds(first, end)
    prefill = len(out.prompt_tokens) / prefill_time if prefill_time > 0 else 0.0
    decode = (len(out.token_ids) - 1) / decode_time if len(out.token_ids) > 1 and decode_time > 0 else 0.0
    line = (f"[{len(out.prompt_tokens)} prompt tokens, prefill {_rate(prefill, 0)} tok/s; {len(out.token_ids)} new "
            f"tokens, decode {_rate(decode, 1)} tok/s; finish: {out.finish_reason}")
    late = clock.compile_seconds(phases.request, end)
    if late > 0:  # a path the warm-up did not take (a longer prompt's GEMM); its compile is not in the speeds
        line += f"; {late:.1f} s compiling kernels during the request, excluded"
    return line + "]"


def _speculation(stats: dict[str, float]) -> str:
    """The speculative decoding line: drafted and accepted tokens, and tokens per verified step."""
    return (f"[speculative: {stats['spec_draft_tokens']} drafted, {stats['spec_accepted_tokens']} accepted "
            f"({stats['spec_acceptance_rate']:.0%}); {stats['spec_mean_accepted_length']:.2f} tokens per verified "
            f"step; {stats['spec_draft_seconds']:.2f} s drafting]")


def _rate(tokens_per_s: float, decimals: int) -> str:
    """A speed with ``decimals`` places, or two significant digits below 1 tok/s (a first run's quick-start backend
    prefills at ~0.2 tok/s, which would print as 0)."""
    return f"{tokens_per_s:.2g}" if 0 < tokens_per_s < 1 else f"{tokens_per_s:.{decimals}f}"


def _breakdown(phases: _Phases, load_times: dict[str, float], clock: KernelClock, out: RequestOutput | None,
               owns_process: bool) -> str:
    """``--verbose``: where the run's wall time went, phase by phase (the interpreter's start-up only when this command
    is the whole process)."""
    before = _process_age(phases.start) if owns_process else None
    load = ", ".join(f"{step} {seconds:.2f}" for step, seconds in load_times.items())
    warm = phases.warmed - phases.engine
    compile_s = clock.compile_seconds(phases.engine, phases.warmed)
    cached_s = clock.seconds(phases.engine, phases.warmed) - compile_s
    rows = [
        ("python start-up + CLI", before),
        ("imports (torch, engine)", phases.imported - phases.start),
        (f"load ({load})", phases.loaded - phases.imported),
        ("engine (KV cache, runner)", phases.engine - phases.loaded),
        (f"kernel warm-up ({compile_s:.2f} s compiling, {cached_s:.2f} s loading from the cache)", warm),
    ]
    if out is not None and out.time_to_first_token and out.latency:
        first = phases.request + out.time_to_first_token
        rows += [("prefill (to the first token)", out.time_to_first_token),
                 ("decode (the other tokens)", out.latency - out.time_to_first_token),
                 ("tokenizing, printing, closing the request", phases.done - phases.request - out.latency)]
        kernels = clock.seconds(phases.request, phases.done)
        if kernels > 0:
            rows.append((f"  of which kernels compiled or loaded (excluded from tok/s; "
                         f"{clock.seconds(phases.request, first):.3f} s in prefill)", kernels))
    else:
        rows.append(("request", phases.done - phases.request))
    lines = [f"  {seconds:7.3f} s  {what}" for what, seconds in rows if seconds is not None]
    total = (before or 0.0) + phases.done - phases.start
    return "start-up and request, wall time:\n" + "\n".join(lines) + f"\n  {total:7.3f} s  total"


def _process_age(now: float) -> float | None:
    """Seconds from this process's start to ``now`` (a ``perf_counter`` reading), from /proc (None elsewhere):
    the interpreter's start-up and the imports before this command ran."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - started - (time.perf_counter() - now))
