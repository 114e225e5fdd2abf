"""Kernel-library benchmark on the cpu backend: each op's time, GB/s or GFLOP/s, fraction of the measured ceiling,
and ratio to torch eager's composition of the same op, timed interleaved in the same run (the machine is shared).

Usage::

    python benchmarks/kernels_cpu.py [--quick] [--family norms,rope,...] [--reps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib
import json
import os
import pkgutil
from pathlib import Path

# Idle OpenMP threads of torch and Numba spin by default and starve each other on a small shared machine
# (both sides of a comparison ran ~8 ms per call); must be set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # OpenBLAS threads: sleep, not spin (tessera/__init__.py)

import torch  # noqa: E402
from attention_cpu import time_interleaved  # noqa: E402  (same folder: the interleaved median timer)
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import tessera.bench.kernel_cases as families  # noqa: E402
from tessera.hw import get_ceilings  # noqa: E402


def load_cases(quick: bool, only: set[str] | None) -> list:
    cases = []
    for info in sorted(pkgutil.iter_modules(families.__path__), key=lambda m: m.name):
        if only and info.name not in only:
            continue
        module = importlib.import_module(f"{families.__name__}.{info.name}")
        cases.extend(module.cases(quick))
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--family", help="comma-separated module names under tessera/bench/kernel_cases/")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    ceilings = get_ceilings()
    only = set(args.family.split(",")) if args.family else None
    rows = []
    table = Table(title=f"tessera.kernels on cpu vs torch eager ({torch.get_num_threads()} threads)")
    for col in ("family", "op", "ours ms", "torch ms", "ours/torch", "target", "GB/s", "% read", "GFLOP/s", "% gemm"):
        table.add_column(col, justify="right")
    for case in load_cases(args.quick, only):
        times, _ = time_interleaved({"ours": case.ours, "torch": case.torch_eager}, args.reps)
        ours, base = times["ours"], times["torch"]
        gbs = case.bytes_moved / ours / 1e9
        gflops = case.flops / ours / 1e9 if case.flops else 0.0
        row = {"family": case.family, "op": case.name, "ours_ms": ours * 1e3, "torch_ms": base * 1e3,
               "ratio": ours / base, "target": case.target, "gbs": gbs, "frac_read": gbs / ceilings.read_gbps,
               "gflops": gflops, "frac_gemm": gflops / ceilings.gemm_fp32_gflops if case.flops else None,
               "met": None if case.target is None else ours / base <= case.target}
        rows.append(row)
        table.add_row(case.family, case.name, f"{ours * 1e3:.3f}", f"{base * 1e3:.3f}", f"{ours / base:.2f}",
                      "-" if case.target is None else f"<= {case.target}" + (" ok" if row["met"] else " MISSED"),
                      f"{gbs:.1f}", f"{100 * row['frac_read']:.0f}%", f"{gflops:.1f}" if case.flops else "-",
                      f"{100 * row['frac_gemm']:.0f}%" if case.flops else "-")
    Console(width=200).print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"date": dt.date.today().isoformat(), "ceilings": dataclasses.asdict(ceilings), "rows": rows}, f, indent=1,
                      default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
