"""Where a batch-1 decode step of the default model goes: the whole step, then the same step with the fused layer
kernels switched off, then also without the LM head's GEMV. The differences are the layers' and the LM head's share;
what is left is Python, sampling, the embedding and the attention plan.

Switched-off kernels return at once (the tokens are then garbage; only time is read). Usage::

    python benchmarks/decode_breakdown.py [--model PATH] [--tokens 64] [--rounds 3]

``--model`` takes any GGUF or Hugging Face directory (default: SmolLM2-135M-Instruct); the LM head is timed where it
is a packed Q8_0 GEMV (the default GGUF's, and a tied Q8_0 embedding's).
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as tessera/__init__.py, before torch loads OpenMP
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
os.environ.setdefault("GOMP_SPINCOUNT", "20000")  # the bounded spin between a step's layers (tessera/__init__.py)

import tessera.backends.cpu.ops._qdot_kernels as qdot_kernels  # noqa: E402
import tessera.backends.cpu.ops.fused_decode as fused_decode  # noqa: E402
from tessera.bench.machine import fingerprint  # noqa: E402
from tessera.engine import LLM, SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    llm = LLM(args.model, max_num_seqs=1) if args.model else LLM(max_num_seqs=1)
    params = SamplingParams(max_tokens=args.tokens + 1, temperature=0.0, ignore_eos=True)

    def step_ms() -> float:
        runs = []
        for _ in range(args.rounds):
            out = llm.generate(["Hello there, how are you doing today?"], params)[0]
            runs.append(1e3 * (out.latency - out.time_to_first_token) / (len(out.token_ids) - 1))
        return statistics.median(runs)

    step_ms()  # compile and warm up
    whole = step_ms()
    layer_kernel = fused_decode.decoder_layers_kernel
    fused_decode.decoder_layers_kernel = lambda *a: None
    no_layers = step_ms()
    gemv_int8 = qdot_kernels.gemv_int8
    qdot_kernels.gemv_int8 = lambda *a: None  # the packed Q8_0 LM head of the default GGUF
    rest = step_ms()
    fused_decode.decoder_layers_kernel, qdot_kernels.gemv_int8 = layer_kernel, gemv_int8
    fp = fingerprint()
    print(f"{fp.get('cpu_model', fp)}; median of {args.rounds} x {args.tokens} tokens")
    print(f"step {whole:.2f} ms = layers {whole - no_layers:.2f} + LM head {no_layers - rest:.2f} + rest {rest:.2f} "
          "(Python, sampling, embedding, attention plan)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
