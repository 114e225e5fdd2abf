"""cProfile of batch-1 decode through the engine: where a decode step's milliseconds go.

Usage::

    python benchmarks/profile_decode.py [--tokens 40] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see benchmarks/kernels_cpu.py)
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # OpenBLAS threads: sleep, not spin (tessera/__init__.py)

from tessera.engine import LLM, SamplingParams  # noqa: E402

PROMPT = "Hello there, how are you doing today?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    llm = LLM(max_num_seqs=1)
    llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # compile and warm up
    profile = cProfile.Profile()
    profile.enable()
    out = llm.generate([PROMPT], SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True))[0]
    profile.disable()
    per_step = 1000 * (out.latency - out.time_to_first_token) / max(len(out.token_ids) - 1, 1)
    print(f"{len(out.token_ids)} tokens, {per_step:.1f} ms per decode step")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
