"""How fast this machine reads memory in the orders an attention kernel reads its token rows.

The decode kernel's K/V are token rows of ``Hkv * D`` elements (4 KiB at Hkv=8, D=128, fp32). Its register-blocked
micro-kernels read several rows at once in short pieces, and the hardware prefetchers serve some orders far worse
than a plain stream. This benchmark reads 256 MiB of such rows on every core with vector loads and no arithmetic
to speak of, in these orders:

* ``sequential``: row after row, front to back (what torch.sum does);
* ``blocks of N rows x P bytes``: N rows at a time, each in turn for P bytes, then the next P bytes of each (the
  Q.K micro-kernel is 4 rows x 64 bytes; its old head-major loop 4 rows x 512 bytes; the P.V loop 32 rows x
  256 bytes);
* the same with software prefetch hints, either in the loads' own order a block ahead, or as a cursor that walks the
  rows in address order a fixed distance ahead, a few lines per piece (what the decode kernel does since the sixth
  session, see ``docs/performance.md``).

Every order runs in each round, round-robin, with torch.sum over the same bytes as the baseline; GB/s are medians.
The machine is shared: compare rows of one run only. Usage::

    python benchmarks/read_patterns.py [--rounds N] [--mib M] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see kernels_cpu.py)
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from numba import get_num_threads, njit, prange
from rich.console import Console
from rich.table import Table

from tessera.backends.cpu.numba_math import FASTMATH
from tessera.backends.cpu.simd import LANES, line_elements, prefetch, vadd, vload, vsum, vzero

ROW_ELEMS = 8 * 128  # Hkv=8, D=128 fp32: one 4 KiB token row

#: how the hints are placed: none, in the loads' own order one block ahead, or an address-order cursor
NO_HINTS, SAME_ORDER, ADDRESS_ORDER = 0, 1, 2


@njit(inline="always", fastmath=FASTMATH)
def _read_blocks(x, lo, hi, rows_per_block, piece, hints, distance):  # pragma: no cover - compiled
    """Sum rows ``[lo, hi)`` of ``x`` (flat, ``ROW_ELEMS`` per row), ``rows_per_block`` rows at a time, each in turn
    for ``piece`` elements. ``distance`` is in rows (SAME_ORDER: the block that far ahead; ADDRESS_ORDER: a cursor
    that far ahead of the block's first row)."""
    line = line_elements(x)
    last = x.size - 1
    a0 = vzero()
    a1 = vzero()
    for b in range(lo, hi, rows_per_block):
        cursor = (b + distance) * ROW_ELEMS
        for col in range(0, ROW_ELEMS, piece):
            if hints == ADDRESS_ORDER:  # as many lines, in address order, as this step reads
                for _ in range(0, rows_per_block * piece, line):
                    prefetch(x, min(cursor, last))
                    cursor += line
            for r in range(rows_per_block):
                base = (b + r) * ROW_ELEMS + col
                if hints == SAME_ORDER:
                    for t in range(0, piece, line):
                        prefetch(x, min(base + distance * ROW_ELEMS + t, last))
                for t in range(0, piece, 2 * LANES):
                    a0 = vadd(a0, vload(x, base + t))
                    a1 = vadd(a1, vload(x, base + t + LANES))
    return vsum(vadd(a0, a1))


@njit(parallel=True, fastmath=FASTMATH)  # not cached: Numba cannot cache it (it reads module globals)
def read_rows(x, rows_per_block, piece, hints, distance):  # pragma: no cover - compiled
    """Every thread reads its contiguous share of ``x``'s rows in the given order; returns the sum (kept live)."""
    workers = get_num_threads()
    rows = x.size // ROW_ELEMS
    share = rows // workers // 32 * 32
    out = np.zeros(workers, dtype=np.float32)
    for w in prange(workers):
        out[w] = _read_blocks(x, w * share, (w + 1) * share, rows_per_block, piece, hints, distance)
    return out.sum()


def orders() -> dict[str, tuple[int, int, int, int]]:
    """name -> (rows per block, piece in floats, hints, distance in rows)."""
    return {
        "sequential": (1, ROW_ELEMS, NO_HINTS, 0),
        "4 rows x 64 B (Q.K micro-kernel)": (4, 16, NO_HINTS, 0),
        "4 rows x 512 B (Q.K, per head)": (4, 128, NO_HINTS, 0),
        "32 rows x 256 B (P.V micro-kernel)": (32, 64, NO_HINTS, 0),
        "4 rows x 1 KiB": (4, 256, NO_HINTS, 0),
        "32 rows x 1 KiB": (32, 256, NO_HINTS, 0),
        "4 rows x 512 B, hints in own order 32 rows ahead": (4, 128, SAME_ORDER, 32),
        "32 rows x 256 B, hints in own order 32 rows ahead": (32, 64, SAME_ORDER, 32),
        "4 rows x 64 B, address-order hints 4 rows ahead": (4, 16, ADDRESS_ORDER, 4),
        "4 rows x 64 B, address-order hints 32 rows ahead": (4, 16, ADDRESS_ORDER, 32),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--mib", type=int, default=256, help="bytes to read per call")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()

    rows = args.mib * 2**20 // (4 * ROW_ELEMS)
    x = np.random.default_rng(0).standard_normal(rows * ROW_ELEMS, dtype=np.float32)
    xt = torch.from_numpy(x)
    fns: dict[str, Callable[[], object]] = {"torch.sum": lambda: xt.sum()}
    for name, (block, piece, hints, dist) in orders().items():
        fns[name] = lambda b=block, p=piece, h=hints, d=dist: read_rows(x, b, p, h, d)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # compile and warm
    for _ in range(args.rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    gbs = {name: x.nbytes / statistics.median(ts) / 1e9 for name, ts in samples.items()}

    table = Table(title=f"reading {args.mib} MiB of 4 KiB token rows on {get_num_threads()} threads")
    table.add_column("order")
    table.add_column("GB/s", justify="right")
    table.add_column("of torch.sum", justify="right")
    for name, rate in gbs.items():
        table.add_row(name, f"{rate:.1f}", f"{rate / gbs['torch.sum']:.0%}")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mib": args.mib, "rounds": args.rounds, "gb_per_s": gbs}, f, indent=2)


if __name__ == "__main__":
    main()
