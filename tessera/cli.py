"""The ``tessera`` command line: ``tessera info`` (versions, backends, this machine's ceilings), ``tessera validate``
(a model against transformers, layer by layer), ``tessera generate`` (stream a completion), ``tessera warmup``
(compile a model's kernels ahead of its first run), ``tessera serve`` (the OpenAI-compatible server), ``tessera
profile`` (where a request's time goes), ``tessera bench`` (benchmarks, comparisons, plots), ``tessera quantize``
(a model written as a quantized GGUF file), ``tessera perplexity`` (perplexity over a text file, by llama.cpp's
protocol) and ``tessera quant-report`` (what each weight and KV cache format costs in quality, memory and speed).

Run as ``tessera <command>`` (the installed entry point) or ``python -m tessera <command>``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import warnings
from importlib import metadata
from typing import Any

from rich.console import Console
from rich.table import Table

import tessera

#: set to 1 to see the traceback of a command that fails, instead of its one-line error
DEBUG_ENV = "TESSERA_DEBUG"
#: Packages whose versions ``tessera info`` reports, read from installed metadata so nothing heavy is imported.
VERSIONED_PACKAGES = ("torch", "numpy", "numba", "triton", "rich")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the chosen subcommand and return its exit status.

    Examples
    --------
    >>> main(["info", "--json"])  # doctest: +SKIP
    0
    """
    parser = _build_parser()
    args = parser.parse_args(argv)
    args.owns_process = argv is None  # run as the program, not called from Python: the process ends with it
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, ImportError) as err:
        # What a user can fix (a missing model file, a device this machine lacks, an unknown backend) reads as one
        # line, not a traceback; TESSERA_DEBUG=1 shows the traceback of anything that is in fact a bug.
        if os.environ.get(DEBUG_ENV, "").lower() in ("1", "true", "yes", "on"):
            raise
        print(f"error: {type(err).__name__}: {err}\n(set {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
        return 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description=tessera.__doc__)
    parser.add_argument("--version", action="version", version=f"tessera {tessera.__version__}")
    commands = parser.add_subparsers(title="commands", required=True)
    info = commands.add_parser("info", help="versions, backends and this machine's measured ceilings")
    info.add_argument("--json", action="store_true", help="print JSON instead of tables")
    info.add_argument("--refresh", action="store_true", help="re-measure the ceilings instead of using the cache")
    info.set_defaults(run=_run_info)
    # light: torch loads when one runs
    from tessera.tools import (bench, generate, perplexity, profile, quant_report, quantize, serve, tune, validate,
                               warmup)

    validate.add_parser(commands)
    generate.add_parser(commands)
    warmup.add_parser(commands)
    serve.add_parser(commands)
    profile.add_parser(commands)
    bench.add_parser(commands)
    tune.add_parser(commands)
    quantize.add_parser(commands)
    perplexity.add_parser(commands)
    quant_report.add_parser(commands)
    from tessera.mlir import dump as mlir_dump  # light: xDSL loads when `tessera mlir dump` runs

    mlir_dump.add_parser(commands)
    return parser


def collect_info(refresh: bool = False) -> dict[str, Any]:
    """Everything ``tessera info`` shows, as a JSON-ready dict.

    Parameters
    ----------
    refresh : bool
        Re-measure the ceilings (a few seconds) instead of reading the cache.

    Returns
    -------
    dict with keys ``tessera`` (version str), ``versions`` (package -> version str), ``backends`` (list of
    ``{name, priority, usable, reasons}``, highest priority first) and ``ceilings`` (the
    :class:`tessera.hw.Ceilings` fields).
    """
    from tessera.hw import get_ceilings  # deferred: imports torch, which --help should not wait for

    return {
        "tessera": tessera.__version__,
        "versions": _versions(),
        "backends": _backends(),
        "variants": _variants(),
        "tuning": _tuning(),
        "ceilings": get_ceilings(refresh=refresh).to_dict(),
    }


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def _backends() -> list[dict[str, Any]]:
    from tessera.backends import registered

    rows = []
    for backend in sorted(registered().values(), key=lambda b: -b.priority):
        try:
            reasons = list(backend.available())
        except Exception as err:  # a broken backend must not hide the others from `tessera info`
            reasons = [f"available() raised {type(err).__name__}: {err}"]
        rows.append({"name": backend.name, "priority": backend.priority, "usable": not reasons, "reasons": reasons})
    return rows


def _tuning() -> list[dict[str, Any]]:
    from tessera.tuning.summary import tuning_summary

    return tuning_summary()


def _variants() -> list[dict[str, Any]]:
    """Every usable backend's kernel variants (backends that specialize kernels per CPU expose
    ``kernel_variants()``), each row tagged with its backend."""
    from tessera.backends import registered

    rows = []
    for backend in sorted(registered().values(), key=lambda b: -b.priority):
        explain = getattr(backend, "kernel_variants", None)
        if explain is None or backend.available():
            continue
        try:
            rows += [{"backend": backend.name, **row} for row in explain()]
        except Exception as err:  # e.g. a malformed TESSERA_CPU_VARIANTS: say so, keep the rest of the report
            rows.append({"backend": backend.name, "family": "?", "chosen": "?", "why": f"{type(err).__name__}: {err}",
                         "passed_over": [], "summary": "", "available": []})
    return rows


def _run_info(args: argparse.Namespace) -> int:
    # Progress goes to stderr so `tessera info --json > file` stays valid JSON.
    err = Console(stderr=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with err.status("reading or measuring this machine's ceilings (measuring takes a few seconds)..."):
            info = collect_info(refresh=args.refresh)
    for warning in caught:  # as one line each, without the source line Python's default format adds
        err.print(f"[yellow]warning:[/] {warning.message}", highlight=False)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    out = Console()
    out.print(_versions_table(info))
    out.print(_backends_table(info["backends"]))
    out.print(_variants_table(info["variants"]))
    from tessera.tuning.summary import _tuning_table

    out.print(_tuning_table(info["tuning"]))
    out.print(_ceilings_table(info["ceilings"]))
    return 0


def _versions_table(info: dict[str, Any]) -> Table:
    table = Table(title="tessera", title_justify="left")
    table.add_column("package")
    table.add_column("version")
    table.add_row("tessera", info["tessera"])
    for package, version in info["versions"].items():
        table.add_row(package, version)
    return table


def _backends_table(backends: list[dict[str, Any]]) -> Table:
    table = Table(title="backends (highest priority first)", title_justify="left")
    table.add_column("backend")
    table.add_column("priority", justify="right")
    table.add_column("usable")
    table.add_column("why not")
    for row in backends:
        usable = "[green]yes[/]" if row["usable"] else "[red]no[/]"
        table.add_row(row["name"], str(row["priority"]), usable, "\n".join(row["reasons"]))
    return table


def _variants_table(rows: list[dict[str, Any]]) -> Table:
    from tessera.hw import isa

    caption = (f"CPU target {isa.host_cpu_name()}; features used: {' '.join(sorted(isa.features())) or 'none'} "
               f"(TESSERA_ISA={isa.cap()}). Force with TESSERA_CPU_VARIANTS=family=variant,...")
    table = Table(title="kernel variants (chosen from this CPU's instruction set)", title_justify="left",
                  caption=caption, caption_justify="left")
    for column in ("family", "chosen", "why", "passed over"):
        table.add_column(column)
    for row in rows:
        table.add_row(f"{row['backend']}.{row['family']}", f"[bold]{row['chosen']}[/]", row["why"],
                      "\n".join(row["passed_over"]))
    return table


def _ceilings_table(c: dict[str, Any]) -> Table:
    from tessera.hw.ceilings import BUSY

    busy = " [yellow](too busy: re-measure with --refresh on an idle machine)[/]" if c["others_busy"] > BUSY else ""
    caption = (
        f"{c['cpu_model']}, {c['num_cores']} cores, ISA: {' '.join(c['isa']) or 'none found'}. Measured "
        f"{c['measured_at']} with torch {c['torch_version']} in {c['measure_seconds']:.1f} s; other processes used "
        f"{c['others_busy']:.0%} of the CPUs meanwhile{busy}."
    )
    table = Table(title="measured ceilings (benchmarks report fractions of these)", title_justify="left",
                  caption=caption, caption_justify="left")
    table.add_column("ceiling")
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("how")
    table.add_row("fp32 GEMM", f"{c['gemm_fp32_gflops']:.1f} GFLOP/s",
                  f"best of torch.matmul and numpy.matmul, {c['gemm_size']}x{c['gemm_size']}, "
                  f"{c['torch_threads']} threads")
    table.add_row("memory read", f"{c['read_gbps']:.1f} GB/s",
                  f"{c['read_method']} over {c['read_bytes'] / 2**30:.3g} GiB, best of several")
    return table


if __name__ == "__main__":
    sys.exit(main())
