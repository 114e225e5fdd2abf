"""Replay the fused decoder layer on its captured arguments: hot (one layer repeated, weights in cache) against
streaming (every layer in turn, as a token reads them), on one worker and on all of Numba's threads.

It decodes a few tokens of the default model (SmolLM2-135M Q4_1, packed) through the engine, records the arguments
of each ``decoder_layer_kernel`` call of the last step, then times the kernel alone on them. What it separates: the
kernel's compute rate (hot), what the memory system adds (streaming), and what a second core buys in each.

Usage::

    python benchmarks/fused_layer_replay.py [--model PATH] [--rounds 300]
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

import tessera.backends.cpu.ops.fused_decode as fused_decode
from tessera.bench.machine import fingerprint
from tessera.engine import LLM, SamplingParams


def _capture(llm: LLM) -> list[tuple]:
    """The arguments of every layer call of one decode step (small arrays copied: the kernel updates x and h)."""
    original = fused_decode.decoder_layer_kernel
    calls: list[tuple] = []

    def spy(*args):
        calls.append(tuple(a.copy() if isinstance(a, np.ndarray) and a.size < 8192 else a for a in args))
        original(*args)

    fused_decode.decoder_layer_kernel = spy
    try:
        llm.generate(["Hello there, how are you"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finally:
        fused_decode.decoder_layer_kernel = original
    layers = llm.model.config.num_layers
    if len(calls) < layers:
        raise SystemExit("the fused decode layer did not run (see tessera.backends.cpu.ops.fused_decode.unsupported_reason)")
    return calls[-layers:]


def _per_call_ms(calls: list[tuple], rounds: int) -> float:
    kernel = fused_decode.decoder_layer_kernel
    for args in calls:
        kernel(*args)
    start = time.perf_counter()
    for _ in range(rounds):
        for args in calls:
            kernel(*args)
    return 1e3 * (time.perf_counter() - start) / (rounds * len(calls))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300, help="timed calls of the hot case (streaming: a tenth)")
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    args = ap.parse_args(argv)
    llm = LLM(args.model, max_num_seqs=1) if args.model else LLM(max_num_seqs=1)
    llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # compile
    calls = _capture(llm)
    print(f"{fingerprint()['cpu_model']}, {numba.get_num_threads()} Numba threads, {len(calls)} layers")
    for workers in sorted({1, numba.get_num_threads()}):
        with_workers = [c[:-1] + (workers,) for c in calls]  # n_workers is the kernel's last argument
        hot = _per_call_ms(with_workers[:1], args.rounds)
        streaming = _per_call_ms(with_workers, max(1, args.rounds // 10))
        print(f"{workers} worker(s): hot {hot:.3f} ms per layer, streaming {streaming:.3f} ms per layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
