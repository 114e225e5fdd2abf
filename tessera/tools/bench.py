"""``tessera bench``: run benchmark suites, compare two result files, plot one.

::

    tessera bench [kernels|attention|paged|e2e|all ...] [--quick] [--json FILE] [--plot DIR]
    tessera bench compare OLD.json NEW.json [--threshold 0.1]
    tessera bench plot FILE.json [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ACTIONS = ("compare", "plot")


def add_parser(commands) -> None:
    p = commands.add_parser(
        "bench", help="benchmark suites vs baselines and this run's machine ceilings; compare; plot",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="*", default=["all"],
                   help="suites (kernels, attention, paged, e2e, all), or: compare OLD NEW, or: plot FILE")
    p.add_argument("--quick", action="store_true", help="small shapes and few repeats (all suites < 10 minutes)")
    p.add_argument("--json", metavar="FILE", help="write results (with machine fingerprint and ceilings) here")
    p.add_argument("--plot", metavar="DIR", help="also write the PNG charts of this run into DIR")
    p.add_argument("--threshold", type=float, default=None, help="compare: allowed slow-down beyond noise (0.1)")
    p.add_argument("--out", metavar="DIR", help="plot: output folder (default: next to FILE)")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads would spin against Numba's
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader draws a raw tqdm bar into the tables
    if args.what and args.what[0] in ACTIONS:
        action, files = args.what[0], args.what[1:]
        return _compare(files, args) if action == "compare" else _plot(files, args)
    return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tessera.bench.harness import run_cases
    from tessera.bench.machine import fingerprint, measure_run_ceilings
    from tessera.bench.report import print_suite, to_json, write_json
    from tessera.bench.suites import SUITES, suite_cases
    from tessera.bench.suites.e2e import SuiteSkipped

    names = list(SUITES) if "all" in args.what else args.what
    for name in names:
        if name not in SUITES:
            print(f"error: unknown suite {name!r}; choose from {', '.join(SUITES)}, all, compare, plot",
                  file=sys.stderr)
            return 2
    console = Console(width=200)
    start = time.perf_counter()
    with console.status("measuring this machine's ceilings"):
        ceilings = measure_run_ceilings(args.quick)
    console.print(f"ceilings (this run): fp32 GEMM {ceilings.gemm_fp32_gflops:.0f} GFLOP/s, bf16 GEMM "
                  f"{ceilings.gemm_bf16_gflops:.0f} GFLOP/s, read {ceilings.read_gbps:.1f} GB/s, copy "
                  f"{ceilings.copy_gbps:.1f} GB/s")
    results, skipped, failed = [], {}, 0
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        for name in names:
            task = progress.add_task(f"{name}: starting", total=None)
            suite_results = []
            try:
                for r in run_cases(suite_cases(name)(args.quick), args.quick):
                    suite_results.append(r)
                    progress.update(task, description=f"{name}: {r.name}", advance=1)
            except SuiteSkipped as exc:
                skipped[name] = str(exc)
            progress.remove_task(task)
            if suite_results:
                print_suite(console, name, suite_results, ceilings)
            if name in skipped:
                console.print(f"{name}: skipped: {skipped[name]}")
            results += suite_results
            failed += sum(r.error is not None for r in suite_results)
    data = to_json(results, ceilings, fingerprint(), args.quick, names, skipped)
    if args.json:
        write_json(data, args.json)
        console.print(f"wrote {args.json}")
    if args.plot:
        from tessera.bench.plot import plot_file

        stem = Path(args.json).stem if args.json else "bench"
        for path in plot_file(data, Path(args.plot), stem):
            console.print(f"wrote {path}")
    console.print(f"{len(results)} cases in {time.perf_counter() - start:.0f} s" +
                  (f", [red]{failed} failed[/red]" if failed else ""))
    return 1 if failed else 0


def _compare(files: list[str], args: argparse.Namespace) -> int:
    from rich.console import Console

    from tessera.bench.compare import DEFAULT_THRESHOLD, compare, print_changes
    from tessera.bench.report import read_json

    if len(files) != 2:
        print("error: usage: tessera bench compare OLD.json NEW.json [--threshold 0.1]", file=sys.stderr)
        return 2
    threshold = DEFAULT_THRESHOLD if args.threshold is None else args.threshold
    try:
        old, new = read_json(files[0]), read_json(files[1])
        changes, only_old, only_new = compare(old, new, threshold)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_changes(Console(width=200), changes, only_old, only_new, old, new, threshold)
    return 1 if any(c.regressed for c in changes) else 0


def _plot(files: list[str], args: argparse.Namespace) -> int:
    from tessera.bench.plot import plot_file
    from tessera.bench.report import read_json

    if len(files) != 1:
        print("error: usage: tessera bench plot FILE.json [--out DIR]", file=sys.stderr)
        return 2
    try:
        data = read_json(files[0])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(files[0]).parent
    for path in plot_file(data, out, Path(files[0]).stem):
        print(f"wrote {path}")
    return 0
