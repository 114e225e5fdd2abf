"""Replay the fused decoder layer on its captured arguments: hot (one layer repeated, weights in cache) against
streaming (every layer in turn, as a token reads them), on one worker and on all of Numba's threads.

It decodes a few tokens of the default model (SmolLM2-135M Q4_1, packed) through the engine, records the arguments
of each layer of the last step, then times the kernel alone on them. What it separates: the
kernel's compute rate (hot), what the memory system adds (streaming), and what a second core buys in each; for
packed models also the layer's four GEMVs run alone on the same weights, so what the layer's other phases cost shows.

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
    """The arguments of every layer of one decode step, one ``decoder_layers_kernel`` call each (the engine runs
    runs of layers per call; each layer here gets its own one-layer lists; small arrays copied: the kernel updates
    x and h)."""
    from tessera.backends.cpu.decode_layer import kv_list, layer_list

    original = fused_decode.decoder_layers_kernel
    steps: list[list[tuple]] = []

    def spy(x, h, layers, kvs, *rest):
        calls = [(x.copy(), h.copy(), layer_list([layers[i]]), kv_list([kvs[i]]),
                  *(a.copy() if isinstance(a, np.ndarray) and a.size < 8192 else a for a in rest))
                 for i in range(len(layers))]
        if steps and x is steps[-1][0][-1]:  # the same step's next run of layers
            steps[-1][1].extend(calls)
        else:
            steps.append(([x], calls))
        original(x, h, layers, kvs, *rest)

    fused_decode.decoder_layers_kernel = spy
    try:
        llm.generate(["Hello there, how are you"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finally:
        fused_decode.decoder_layers_kernel = original
    layers = llm.model.config.num_layers
    if not steps or len(steps[-1][1]) < layers:
        raise SystemExit("the fused decode layer did not run (see tessera.backends.cpu.ops.fused_decode.unsupported_reason)")
    return steps[-1][1][-layers:]


def _per_call_ms(calls: list[tuple], rounds: int) -> float:
    kernel = fused_decode.decoder_layers_kernel
    for args in calls:
        kernel(*args)
    start = time.perf_counter()
    for _ in range(rounds):
        for args in calls:
            kernel(*args)
    return 1e3 * (time.perf_counter() - start) / (rounds * len(calls))


def _gemvs_alone_ms(call: tuple, workers: int, rounds: int) -> float | None:
    """The layer's four projections alone (the same row kernels the fused layer calls, on its weights, one x row,
    hot), on one thread or all: what the layer costs beyond them is its other phases and their hand-offs. None when
    a projection is not packed for the int8-activation kernels."""
    from tessera.backends.cpu.ops import _qdot_ggml, _qdot_kernels

    weights, isa = call[2][0][0], call[10]  # the layer's plain LayerWeights tuple
    if isa is None:
        return None
    runs = []
    for w in (weights[0], weights[2], weights[4], weights[6]):  # qkv, o, gate_up, down
        if not isinstance(w, tuple):
            return None
        ggml = len(w) == 5 and w[1].dtype == np.uint8  # ggml blocks (w0, w1, fmt0, fmt1, split); else int4 / int8
        k = _qdot_ggml_k(w) if ggml else w[0].shape[1] * (2 if len(w) == 5 else 1)
        xq, xd, xs = _qdot_kernels.quantize_activations(np.random.default_rng(0).standard_normal((1, k), np.float32))
        if ggml:
            out = np.empty((1, w[4] + w[1].shape[0]), np.float32)
            kernel = _qdot_ggml.gemv_ggml if workers > 1 else _qdot_ggml.gemv_ggml_serial
            runs.append(lambda kernel=kernel, w=w, out=out, a=(xq, xd, xs): kernel(isa, *a, *w, out))
        elif len(w) == 5:
            out = np.empty((1, w[0].shape[0]), np.float32)
            kernel = _qdot_kernels.gemv_int4 if workers > 1 else _qdot_kernels.gemv_int4_serial
            runs.append(lambda kernel=kernel, w=w, out=out, a=(xq, xd, xs): kernel(isa, *a, *w, out))
        else:
            out = np.empty((1, w[0].shape[0]), np.float32)
            kernel = _qdot_kernels.gemv_int8 if workers > 1 else _qdot_kernels.gemv_int8_serial
            runs.append(lambda kernel=kernel, w=w, out=out, a=(xq, xd): kernel(isa, *a, *w, out))
    threads = numba.get_num_threads()
    numba.set_num_threads(workers)
    try:
        for run in runs:
            run()
        start = time.perf_counter()
        for _ in range(rounds):
            for run in runs:
                run()
        return 1e3 * (time.perf_counter() - start) / rounds
    finally:
        numba.set_num_threads(threads)


def _qdot_ggml_k(w: tuple) -> int:
    """K of a ggml block-format projection from its row bytes and format code."""
    from tessera.backends.cpu.ops._ggml_kernels import FMT_CODES
    from tessera.kernels.ggml_blocks import BLOCKS

    fmt = next(name for name, code in FMT_CODES.items() if code == w[2])
    _, values, size = BLOCKS[fmt]
    return w[0].shape[1] // size * values


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
        alone = _gemvs_alone_ms(with_workers[0], workers, args.rounds)
        gemvs = "" if alone is None else f"; its four GEMVs alone, hot: {alone:.3f} ms"
        print(f"{workers} worker(s): hot {hot:.3f} ms per layer, streaming {streaming:.3f} ms per layer{gemvs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
