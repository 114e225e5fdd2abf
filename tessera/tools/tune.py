"""``tessera tune``: measure this machine's crossovers and cache them; show or clear the cache.

::

    tessera tune [--quick] [--only NAME ...] [--model PATH]   measure (all tunables, or the named ones) and cache
    tessera tune --show                                       what this machine's cache holds and what applies now
    tessera tune --clear                                      delete this machine's cache file

Results go to ``$TESSERA_CACHE_DIR/tuning/<machine digest>.json`` (default ``~/.cache/tessera/tuning/``) and apply
to every later process on this machine; docs/tuning.md describes what is tuned and how to force or disable it.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from typing import Any


def add_parser(commands: Any) -> None:
    p = commands.add_parser(
        "tune", help="measure this machine's kernel thresholds and cache them (--show, --clear)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="SmolLM2 shapes only and fewer rounds (about a minute instead of several)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="tune only these tunables (see --show for names)")
    p.add_argument("--model", metavar="PATH",
                   help="measure on this model's projection shapes and packed formats (GGUF file or HF directory; "
                        "only its config is read)")
    p.add_argument("--show", action="store_true", help="print this machine's cache and the values in effect")
    p.add_argument("--clear", action="store_true", help="delete this machine's cache file")
    p.add_argument("--json", action="store_true", help="print the results (or --show's rows) as JSON")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=args.json)  # with --json, stdout carries only the JSON
    if not console.is_terminal:
        console.width = 160  # piped into a file or a log: wide enough for the "why" column
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            status = _dispatch(args, console)
        except (KeyError, ValueError, FileNotFoundError) as err:
            _print_warnings(console, caught)
            message = err.args[0] if isinstance(err, KeyError) and err.args else err
            console.print(f"[red]error:[/] {message}", highlight=False)
            return 2
    _print_warnings(console, caught)
    return status


def _print_warnings(console: Any, caught: list[warnings.WarningMessage]) -> None:
    for warning in caught:  # one line each, without the source line Python's default format adds
        console.print(f"[yellow]warning:[/] {warning.message}", highlight=False)


def _dispatch(args: argparse.Namespace, console: Any) -> int:
    from tessera.tuning import cache, registry

    if args.clear:
        path = registry.current_path()
        removed = cache.clear(path)
        registry.reset()
        console.print(f"{'removed' if removed else 'no cache file at'} {path}", highlight=False)
        return 0
    if args.show:
        return _show(args, console)
    return _tune(args, console)


def _show(args: argparse.Namespace, console: Any) -> int:
    from tessera.tuning import cache, registry
    from tessera.tuning.fingerprint import digest, fingerprint
    from tessera.tuning.summary import _tuning_table, tuning_summary

    rows = tuning_summary()
    if args.json:
        print(json.dumps({"path": str(registry.current_path()), "fingerprint": fingerprint(), "rows": rows},
                         indent=2))
        return 0
    fp = fingerprint()
    caches = ", ".join(f"{k} {v // 1024} KiB" if v else f"{k} ?" for k, v in fp["caches"].items())
    console.print(f"machine {digest()}: {fp['cpu_model']}, {fp['logical_cores']} logical cores, ISA "
                  f"{' '.join(fp['isa']) or 'none found'}, {caches}", highlight=False)
    path = registry.current_path()
    console.print(f"cache: {path}{'' if path.exists() else ' (not written yet: run `tessera tune`)'}",
                  highlight=False)
    if not registry.tuning_enabled():
        console.print("[yellow]TESSERA_TUNING=off: every lookup returns its default[/]")
    others = sorted(p.name for p in cache.cache_dir().glob("*.json") if p != path) if cache.cache_dir().is_dir() \
        else []
    if others:
        console.print(f"other machines' files in {cache.cache_dir()} (ignored here): {', '.join(others)}",
                      highlight=False)
    console.print(_tuning_table(rows, title="tunables (value = what the kernels use now)"))
    return 0


def _tune(args: argparse.Namespace, console: Any) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tessera.hw.ceilings import BUSY
    from tessera.tuning import registry, search
    from tessera.tuning.workload import SMOLLM2, SMOLLM2_AND_1B, format_classes, workload_from_model

    workload = workload_from_model(args.model) if args.model else None
    pairs = search.plan(args.only, format_classes(workload))
    start = time.perf_counter()
    outcomes: list[search.Outcome] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("tuning", total=len(pairs))
        state = {"i": 0, "round": 0}

        def describe() -> str:
            t, sc = pairs[min(state["i"], len(pairs) - 1)]
            label = t.name if sc is None else f"{t.name} [{sc}]"
            return f"{label}: round {state['round']}" if state["round"] else f"{label}: warming up"

        def tick() -> None:
            state["round"] += 1
            progress.update(task, description=describe())

        def done(outcome: search.Outcome) -> None:
            state["i"] += 1
            state["round"] = 0
            outcomes.append(outcome)
            nxt = pairs[state["i"]][0].name if state["i"] < len(pairs) else None
            if nxt != outcome.name:
                for module in registry.tunable_modules():  # the next tunable builds its own inputs
                    getattr(module, "release_inputs", lambda: None)()
            progress.update(task, advance=1, description=describe())

        progress.update(task, description=describe())
        search.tune(pairs, quick=args.quick, workload=workload, on_outcome=done, tick=tick)
    if args.json:
        print(json.dumps([o.to_entry() | {"name": o.name, "shape_class": o.shape_class} for o in outcomes],
                         indent=2))
        return 0
    shapes = workload or (SMOLLM2 if args.quick else SMOLLM2_AND_1B)
    console.print(_outcome_table(outcomes, time.perf_counter() - start, shapes))
    console.print(f"cached in {registry.current_path()}", highlight=False)
    busy = max((o.others_busy for o in outcomes), default=0.0)
    if busy > BUSY:
        warnings.warn(f"other processes used up to {busy:.0%} of the CPUs during these measurements: serial paths "
                      "then beat parallel ones they would lose to on an idle machine. Re-run `tessera tune` when "
                      "the machine is quiet", RuntimeWarning, stacklevel=2)
    return 0


def _outcome_table(outcomes: list[Any], seconds: float, workload: Any) -> Any:
    from rich.table import Table

    from tessera.tuning import cache
    from tessera.tuning.summary import format_value

    caption = (f"{len(outcomes)} searches in {seconds:.0f} s. Speed-up: the default's time over the chosen value's "
               "(1.00x when the default stays). A value changes only when it beats the default by more than 3% "
               "with disjoint interquartile ranges. Busy: the share of the CPUs other processes used meanwhile.")
    table = Table(title=f"tessera tune ({workload.name} shapes)", caption=caption,
                  title_justify="left", caption_justify="left")
    for name, justify in (("tunable", "left"), ("shape class", "left"), ("default", "right"), ("chosen", "right"),
                          ("speed-up", "right"), ("rounds", "right"), ("busy", "right"), ("why", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "why")  # type: ignore[arg-type]
    for o in outcomes:
        chosen = format_value(o.chosen)
        table.add_row(o.name, cache.class_key(o.shape_class), format_value(o.default),
                      f"[green]{chosen}[/]" if o.chosen != o.default else chosen, f"{o.speedup:.2f}x", str(o.rounds),
                      f"{o.others_busy:.0%}", o.reason)
    return table
