"""``tessera bench compare OLD NEW``: per-case time ratios between two result files, and a verdict for CI.

A case regressed when ``new / old - 1`` exceeds the threshold plus the cases' measured noise (the mean of the two
runs' interquartile spreads): a 10% threshold on a case whose timings scatter by 30% would otherwise fire on noise.
Cases are matched by ``suite/name``; cases present on one side only are listed, never counted as regressions.
Across machines, compare the ``vs base`` columns: each run's ratio to a baseline measured in the same run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

DEFAULT_THRESHOLD = 0.10


@dataclass
class Change:
    key: str
    old_seconds: float
    new_seconds: float
    noise: float
    old_vs_base: float | None
    new_vs_base: float | None
    regressed: bool
    improved: bool

    @property
    def ratio(self) -> float:
        return self.new_seconds / self.old_seconds


def compare(old: dict[str, Any], new: dict[str, Any], threshold: float = DEFAULT_THRESHOLD
            ) -> tuple[list[Change], list[str], list[str]]:
    """Changes of every case timed in both files, and the keys only in old / only in new."""
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0 (a fraction, 0.1 = 10%), got {threshold}")
    old_rows = {r["key"]: r for r in old["results"] if r.get("seconds")}
    new_rows = {r["key"]: r for r in new["results"] if r.get("seconds")}
    changes = []
    for key in old_rows.keys() & new_rows.keys():
        o, n = old_rows[key], new_rows[key]
        noise = ((o.get("spread") or 0.0) + (n.get("spread") or 0.0)) / 2
        ratio = n["seconds"] / o["seconds"]
        changes.append(Change(key, o["seconds"], n["seconds"], noise, o.get("ratio"), n.get("ratio"),
                              regressed=ratio - 1 > threshold + noise, improved=1 - ratio > threshold + noise))
    changes.sort(key=lambda c: -c.ratio)
    return changes, sorted(old_rows.keys() - new_rows.keys()), sorted(new_rows.keys() - old_rows.keys())


def print_changes(console: Console, changes: list[Change], only_old: list[str], only_new: list[str],
                  old: dict[str, Any], new: dict[str, Any], threshold: float) -> None:
    if old.get("machine", {}).get("cpu_model") != new.get("machine", {}).get("cpu_model"):
        console.print(f"[yellow]different machines[/yellow]: {old['machine'].get('cpu_model')} vs "
                      f"{new['machine'].get('cpu_model')}; absolute times differ, read the 'vs base' columns")
    table = Table(title=f"tessera bench compare (threshold {threshold:.0%} + noise)", title_justify="left")
    for col in ("case", "old ms", "new ms", "new/old", "noise", "old vs base", "new vs base", "verdict"):
        table.add_column(col, justify="left" if col in ("case", "verdict") else "right")
    for c in changes:
        verdict = "[red]REGRESSION[/red]" if c.regressed else "[green]faster[/green]" if c.improved else "same"
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        table.add_row(c.key, f"{c.old_seconds * 1e3:.3f}", f"{c.new_seconds * 1e3:.3f}", f"{c.ratio:.2f}",
                      f"{c.noise:.0%}", fmt(c.old_vs_base), fmt(c.new_vs_base), verdict)
    console.print(table)
    for label, keys in (("only in old", only_old), ("only in new", only_new)):
        if keys:
            console.print(f"{label}: {', '.join(keys)}")
    bad = [c.key for c in changes if c.regressed]
    console.print(f"{len(bad)} regression(s)" + (f": {', '.join(bad)}" if bad else ""))
