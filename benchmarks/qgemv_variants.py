"""Every ``qgemv`` kernel variant this CPU runs, on one thread and on all, against torch's fp32 GEMV.

Why one thread too: the decode layer runs its projections on the calling thread (``backends/cpu/ops/fused_decode.py``), so
the single-thread rate of a variant is what a batch-1 token pays; the all-thread figure is the per-op path's.
Shapes: SmolLM2-135M's projections (cache-resident) and a 4096 x 4096 matrix whose copies rotate over at least twice
the last-level cache (streamed from DRAM), each at M = 1 and, with ``--rows``, more rows of x. Interleaved rounds
(every variant and the baseline once per round), minimum and median over rounds.

GGUF's block formats (``--formats q4_k,q6_k``, also q5_k, q5_0, q5_1) are quantized with Tessera's K-quant writer
(gguf-py's quantizer for Q5_0 / Q5_1) and timed on the shapes whose K they divide, plus TinyLlama-1.1B's gate and
down projections (5632 x 2048, 2048 x 5632; streamed).

Usage::

    python benchmarks/qgemv_variants.py                 # ~1 minute on 2 cores
    python benchmarks/qgemv_variants.py --rows 1,8,32 --json out.json
    python benchmarks/qgemv_variants.py --formats q4_k,q6_k
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see kernels_cpu.py: idle pools must not spin here

import numba
import torch
from rich.console import Console
from rich.table import Table

from tessera.backends.cpu import variants
from tessera.backends.cpu.ops import _qdot, quant as cpu_quant
from tessera.bench.harness import copies_for, rotating
from tessera.bench.machine import fingerprint
from tessera.kernels import quant

SHAPES = [("smollm2 gate_up", 3072, 576, False), ("smollm2 down", 576, 1536, False),
          ("smollm2 qkv", 960, 576, False), ("4096 x 4096 (DRAM)", 4096, 4096, True)]
#: TinyLlama-1.1B's gate and down projections: where a 1B-class K-quant file spends most of a token
SHAPES_1B = [("1b gate (DRAM)", 5632, 2048, True), ("1b down (DRAM)", 2048, 5632, True)]
FORMATS = [("int4", 32), ("int4_min", 32), ("int8", 32)]
GGML_FORMATS = ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1")


def _packed(w: torch.Tensor, fmt: str, group: int) -> quant.QuantizedWeight:
    """``w`` packed in ``fmt``: Tessera's quantizer, or the bytes a GGUF file would hold for ggml's formats."""
    if fmt not in GGML_FORMATS:
        return quant.quantize(w, fmt, group)
    import gguf
    import numpy as np

    from tessera.kernels.ggml_quantize import quantize_rows

    values = w.numpy().astype(np.float32)
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    blocks = quantize_rows(values, fmt) if fmt.endswith("_k") else gguf.quants.quantize(values, qtype)
    return quant.from_gguf(blocks, qtype, tuple(w.shape))


def _copies(qw: quant.QuantizedWeight, stream: bool) -> list[quant.QuantizedWeight]:
    if not stream:
        return [qw]
    clone = lambda t: None if t is None else t.clone()  # noqa: E731
    return [qw] + [dataclasses.replace(qw, data=qw.data.clone(), scales=clone(qw.scales), zeros=clone(qw.zeros),
                                       mins=clone(qw.mins)) for _ in range(copies_for(qw.nbytes, most=128) - 1)]


def _runner(variant: str, x: torch.Tensor, weights, serial: bool):
    token = _qdot._TOKENS[variant]
    if token is None:  # the portable float kernels: through the backend's own entry, forced
        def portable():
            os.environ["TESSERA_CPU_VARIANTS"] = "qgemv=portable"
            try:
                return cpu_quant.qmatmul(x, weights())
            finally:
                del os.environ["TESSERA_CPU_VARIANTS"]
        return portable
    return lambda: _qdot.qmatmul(x, weights(), token, serial)


def _time(fns: dict[str, callable], rounds: int) -> dict[str, list[float]]:
    for fn in fns.values():
        fn()
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1", help="comma-separated rows of x (default 1)")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--formats", default="int4,int4_min,int8",
                    help=f"comma-separated, of int4, int4_min, int8 (group 32) and {', '.join(GGML_FORMATS)}")
    ap.add_argument("--json", help="default benchmarks/results/qgemv-variants-<date>.json")
    args = ap.parse_args()
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in dict(FORMATS) and f not in GGML_FORMATS]
    if unknown:
        ap.error(f"unknown format(s) {unknown}; choose from {[f for f, _ in FORMATS] + list(GGML_FORMATS)}")
    names = variants.available("qgemv")
    threads = numba.get_num_threads()
    results = []
    shapes = SHAPES + (SHAPES_1B if any(f in GGML_FORMATS for f in formats) else [])
    for label, n, k, stream in shapes:
        w = torch.randn(n, k) * 0.02
        fp32 = rotating([w] + [w.clone() for _ in range(copies_for(w.numel() * 4) - 1)] if stream else [w])
        for fmt in formats:
            group = 256 if fmt.endswith("_k") else 32
            if k % group:
                continue  # a K-quant needs whole blocks of 256 along K
            weights = rotating(_copies(_packed(w, fmt, group), stream))
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k)
                for serial in (True, False):
                    numba.set_num_threads(1 if serial else threads)
                    torch.set_num_threads(1 if serial else threads)
                    fns = {v: _runner(v, x, weights, serial) for v in names}
                    fns["torch fp32"] = lambda: x @ fp32().T
                    got = _time(fns, args.rounds)
                    row = {"shape": label, "n": n, "k": k, "format": fmt, "group": group, "m": m,
                           "threads": 1 if serial else threads,
                           "ms": {v: 1e3 * min(t) for v, t in got.items()},
                           "median_ms": {v: 1e3 * statistics.median(t) for v, t in got.items()}}
                    results.append(row)
    numba.set_num_threads(threads)
    table = Table(title=f"qgemv variants vs torch fp32 (min ms over {args.rounds} interleaved rounds)",
                  title_justify="left")
    for col in ("shape", "format", "M", "threads", *names, "torch fp32", f"{names[0]} / portable",
                f"{names[0]} / torch"):
        table.add_column(col, justify="left" if col in ("shape", "format") else "right")
    for r in results:
        ms = r["ms"]
        label = r["format"] if r["format"] in GGML_FORMATS else f"{r['format']}/g{r['group']}"
        table.add_row(r["shape"], label, str(r["m"]), str(r["threads"]),
                      *(f"{ms[v]:.3f}" for v in names), f"{ms['torch fp32']:.3f}",
                      f"{ms[names[0]] / ms['portable']:.2f}x", f"{ms[names[0]] / ms['torch fp32']:.2f}x")
    console = Console(width=200)
    console.print(table)
    fp = fingerprint()
    console.print(f"{fp['cpu_model']}, {fp['num_cores']} cores; variants {names}; chosen {names[0]}")
    path = Path(args.json or Path(__file__).parent / "results" / f"qgemv-variants-{dt.date.today()}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": fp, "variants": names, "date": dt.datetime.now(dt.UTC).isoformat(),
                                "rows": results}, indent=1))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
