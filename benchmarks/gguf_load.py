"""How long ``load_model`` takes to open a GGUF file, with a warm page cache, and where the time goes.

Loads the file once to warm the page cache (and the imports), then ``--repeat`` times, and prints the median and
every run, a breakdown of one load (header, weights, tokenizer) and, with ``--oracle``, gguf-py's
``GGUFReader`` on the same file for comparison. The CPU model and the date head the output.

Usage::

    python benchmarks/gguf_load.py                       # the default model (SmolLM2-135M-Instruct Q4_1)
    python benchmarks/gguf_load.py --model x.gguf --repeat 9 --oracle
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dequantize", action="store_true", help="keep_quantized=False (every weight de-quantized)")
    ap.add_argument("--oracle", action="store_true", help="also time gguf-py's GGUFReader")
    args = ap.parse_args(argv)

    import torch

    from tessera.hw.probes import cpu_model, num_cores
    from tessera.models.load import load_model
    from tessera.models.model import default_model_path

    path = args.model or default_model_path()
    keep = False if args.dequantize else None
    print(f"{dt.date.today()}  {cpu_model()}, {num_cores()} cores, {torch.get_num_threads()} torch threads")
    print(f"{path} ({path.stat().st_size / 2**20:.0f} MiB), keep_quantized={keep}")
    load_model(path, keep_quantized=keep)  # page cache and first-call costs
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        load_model(path, keep_quantized=keep)
        times.append(time.perf_counter() - start)
    print(f"load_model: median {statistics.median(times):.3f} s of {args.repeat} "
          f"({', '.join(f'{t:.3f}' for t in times)})")

    steps: dict[str, float] = {}
    load_model(path, keep_quantized=keep, timings=steps)
    print("one load: " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in steps.items())
          + " (weights and tokenizer run at the same time)")
    if args.oracle:
        import gguf

        start = time.perf_counter()
        gguf.GGUFReader(path)
        print(f"gguf-py GGUFReader(): {time.perf_counter() - start:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
