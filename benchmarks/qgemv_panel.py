"""Row-panel int4 kernels (``backends/cpu/ops/_qdot_panel.py``) against the row kernels and the bf16 tiles they replace.

For each shape (SmolLM2-135M's and TinyLlama-1.1B's projections, group-32 int4 with float16 scales as a GGUF Q4_0
holds them) and each number of activation rows M, in one process, rounds alternating:

- ``rows``: the ``vnni512`` row kernels (``_qdot_kernels.gemv_int4``), what ran every M up to the GEMV row limit;
- ``panel``: the panel kernels on the repacked weight;
- ``bf16 tiles`` (M above the row limit only): ``ops/quant._gemm_tiled``, what ran above it.

Timings include the activation's quantization. ``--dram`` rotates copies of each weight over twice the last-level
cache, so every call streams its weight from memory. Needs a CPU the ``vnni512`` variant runs on.

Usage::

    python benchmarks/qgemv_panel.py                         # ~1 minute on 2 cores
    python benchmarks/qgemv_panel.py --dram --rows 1,8 --json out.json
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
from tessera.backends.cpu.ops import _qdot, _qdot_kernels, _qdot_panel
from tessera.backends.cpu.ops import quant as cpu_quant
from tessera.backends.cpu.ops._int8_simd import VNNI512
from tessera.bench.harness import copies_for
from tessera.bench.machine import fingerprint
from tessera.hw import isa
from tessera.kernels import quant

SHAPES = [("smollm2 gate_up", 3072, 576), ("smollm2 down", 576, 1536), ("smollm2 qkv", 960, 576),
          ("1b q/o", 2048, 2048), ("1b gate", 5632, 2048), ("1b down", 2048, 5632)]


def _weight(n: int, k: int, gen: torch.Generator) -> quant.QuantizedWeight:
    qw = quant.quantize(torch.randn(n, k, generator=gen), "int4", 32)
    return quant.QuantizedWeight("int4", qw.shape, 32, qw.data, qw.scales.half(), qw.zeros)


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


def run(rows: list[int], dram: bool, rounds: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    results = []
    for label, n, k in SHAPES:
        base = _weight(n, k, gen)
        count = copies_for(base.nbytes) if dram else 1
        weights = [base] + [quant.QuantizedWeight("int4", base.shape, 32, base.data.clone(), base.scales.clone(),
                                                   base.zeros.clone()) for _ in range(count - 1)]
        row_args = [_qdot.weight_arrays(w) for w in weights]
        panel_args = [_qdot.panel_arrays(w)[:3] for w in weights]
        limit = cpu_quant.gemv_max_m_default("int4")
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            out = np.empty((m, n), np.float32)

            def row_kernels(i, x=x, out=out):
                xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
                _qdot_kernels.gemv_int4(VNNI512, xq, xd, xs, *row_args[i % count], out)

            def panels(i, x=x, out=out):
                xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
                _qdot_panel.gemv_panel(VNNI512, xq, xd, xs, *panel_args[i % count], out)

            fns = {"rows": row_kernels, "panel": panels}
            if m > limit:
                fns["bf16 tiles"] = lambda i, x=x: cpu_quant._gemm_tiled(x, weights[i % count])
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
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    missing = isa.missing(next(v for v in variants.FAMILIES["qgemv"].variants if v.name == "vnni512").requires)
    if missing:
        raise SystemExit(f"the panel kernels need the vnni512 qgemv variant; this CPU lacks {missing}")
    rows = [int(v) for v in args.rows.split(",")]
    results = run(rows, args.dram, args.rounds)
    table = Table(title=f"int4 g32 (f16 scales), {numba.get_num_threads()} threads, "
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
                  "machine": fingerprint(), "threads": numba.get_num_threads(), "dram": args.dram,
                  "results": results}
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
