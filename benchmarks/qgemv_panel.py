"""Row-panel kernels (``backends/cpu/ops/_qdot_panel.py``, ``_qdot_kpanel.py``, ``_qdot_q6panel.py``) against the
row kernels and the bf16 tiles they replace.

For each shape (SmolLM2-135M's and TinyLlama-1.1B's projections) and each number of activation rows M, in one
process, rounds alternating, for ``--format int4`` (group 32 with float16 scales, as a GGUF Q4_0 holds them) or
``q4_k`` / ``q6_k`` (random blocks, ggml's own bytes):

- ``rows``: the ``vnni512`` row kernels (``_qdot_kernels.gemv_int4``; ``_qdot_ggml.gemv_ggml`` for the K-quants),
  what ran every M up to the GEMV row limit;
- ``panel``: the panel kernels on the repacked weight;
- ``bf16 tiles`` (M above the row limit only): ``ops/quant._gemm_tiled`` (``_ggml_tiled``), what ran above it.

Timings include the activation's quantization. ``--dram`` rotates copies of each weight over twice the last-level
cache, so every call streams its weight from memory. Needs a CPU the ``vnni512`` variant runs on.

Usage::

    python benchmarks/qgemv_panel.py                         # ~1 minute on 2 cores
    python benchmarks/qgemv_panel.py --dram --rows 1,8 --json out.json
    python benchmarks/qgemv_panel.py --format q4_k --shapes 1b --json out.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path

import numba
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from tessera.backends.cpu import variants
from tessera.backends.cpu.ops import _qdot, _qdot_ggml, _qdot_kernels, _qdot_kpanel, _qdot_panel, _qdot_q6panel
from tessera.backends.cpu.ops import quant as cpu_quant
from tessera.backends.cpu.ops._int8_simd import VNNI512
from tessera.bench.harness import copies_for
from tessera.bench.machine import fingerprint
from tessera.hw import isa
from tessera.kernels import quant
from tessera.tuning.random_weights import random_ggml_weight

SHAPES = [("smollm2 gate_up", 3072, 576), ("smollm2 down", 576, 1536), ("smollm2 qkv", 960, 576),
          ("1b q/o", 2048, 2048), ("1b gate", 5632, 2048), ("1b down", 2048, 5632)]


def _weight(fmt: str, n: int, k: int, gen: torch.Generator) -> quant.QuantizedWeight:
    if fmt != "int4":
        return random_ggml_weight(fmt, n, k, gen)
    qw = quant.quantize(torch.randn(n, k, generator=gen), "int4", 32)
    return quant.QuantizedWeight("int4", qw.shape, 32, qw.data, qw.scales.half(), qw.zeros)


def _copy(w: quant.QuantizedWeight) -> quant.QuantizedWeight:
    clone = lambda t: None if t is None else t.clone()
    return quant.QuantizedWeight(w.fmt, w.shape, w.group_size, w.data.clone(), clone(w.scales), clone(w.zeros),
                                 clone(w.mins))


def _kernels(fmt: str):
    """(the rows GEMV, the panel GEMV, the de-quantized tiles) for ``fmt``."""
    if fmt == "q4_k":
        return _qdot_ggml.gemv_ggml, _qdot_kpanel.gemv_kpanel, cpu_quant._ggml_tiled
    if fmt == "q6_k":
        return _qdot_ggml.gemv_ggml, _qdot_q6panel.gemv_q6panel, cpu_quant._ggml_tiled
    return _qdot_kernels.gemv_int4, _qdot_panel.gemv_panel, cpu_quant._gemm_tiled


def _time(fns: dict, rounds: int) -> dict[str, float]:
    """Median seconds per call of each function, rounds alternating between them."""
    for f in fns.values():
        f(0)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name, f in fns.items():
            start = time.perf_counter()
            f(r)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def run(fmt: str, shapes: list[tuple[str, int, int]], rows: list[int], dram: bool, rounds: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    results = []
    row_gemv, panel_gemv, tiles = _kernels(fmt)
    for label, n, k in shapes:
        base = _weight(fmt, n, k, gen)
        count = copies_for(base.nbytes) if dram else 1
        weights = [base] + [_copy(base) for _ in range(count - 1)]
        row_args = [_qdot.weight_arrays(w) for w in weights]
        panel_args = [_qdot.panel_arrays(w)[:-1] for w in weights]
        limit = cpu_quant.GGML_GEMV_MAX_M if fmt != "int4" else cpu_quant.gemv_max_m_default("int4")
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            out = np.empty((m, n), np.float32)

            def row_kernels(i, x=x, out=out):
                xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
                row_gemv(VNNI512, xq, xd, xs, *row_args[i % count], out)

            def panels(i, x=x, out=out):
                xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
                panel_gemv(VNNI512, xq, xd, xs, *panel_args[i % count], out)

            fns = {"rows": row_kernels, "panel": panels}
            if m > limit:
                fns["bf16 tiles"] = lambda i, x=x: tiles(x, weights[i % count])
            times = _time(fns, rounds if m * n * k < 1 << 30 else max(3, rounds // 4))
            results.append({"shape": label, "n": n, "k": k, "m": m, "copies": count,
                            "ms": {name: t * 1e3 for name, t in times.items()},
                            "gmac_s": {name: n * k * m / t / 1e9 for name, t in times.items()},
                            "panel_speedup": {name: t / times["panel"] for name, t in times.items() if name != "panel"}})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,32,128,512", help="activation rows M, comma-separated")
    parser.add_argument("--dram", action="store_true", help="rotate weight copies over twice the last-level cache")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--format", default="int4", choices=["int4", "q4_k", "q6_k"])
    parser.add_argument("--shapes", default="all", choices=["all", "smollm2", "1b"], help="which models' shapes")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    missing = isa.missing(next(v for v in variants.FAMILIES["qgemv"].variants if v.name == "vnni512").requires)
    if missing:
        raise SystemExit(f"the panel kernels need the vnni512 qgemv variant; this CPU lacks {missing}")
    rows = [int(v) for v in args.rows.split(",")]
    shapes = [s for s in SHAPES if args.shapes == "all" or s[0].startswith(args.shapes)]
    results = run(args.format, shapes, rows, args.dram, args.rounds)
    what = "int4 g32 (f16 scales)" if args.format == "int4" else args.format
    table = Table(title=f"{what}, {numba.get_num_threads()} threads, "
                        f"{'DRAM' if args.dram else 'in cache'}: ms (GMAC/s), panel speed-up")
    for col in ("shape", "M", "rows", "panel", "bf16 tiles", "panel vs rows", "panel vs tiles"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    for r in results:
        cell = lambda name: f"{r['ms'][name]:.3f} ({r['gmac_s'][name]:.0f})" if name in r["ms"] else "-"
        ratio = lambda name: f"{r['panel_speedup'][name]:.2f}x" if name in r["panel_speedup"] else "-"
        table.add_row(r["shape"], str(r["m"]), cell("rows"), cell("panel"), cell("bf16 tiles"), ratio("rows"),
                      ratio("bf16 tiles"))
    Console().print(table)
    if args.json:
        record = {"benchmark": "qgemv_panel", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "format": args.format, "machine": fingerprint(), "threads": numba.get_num_threads(), "dram": args.dram,
                  "results": results}
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
