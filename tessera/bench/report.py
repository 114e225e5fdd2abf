"""Turn results into what a reader needs: rates, fractions of this run's ceilings, ratios, the roofline's prediction;
as rich tables and as a JSON file that ``compare`` and ``plot`` read back.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tessera.bench.harness import Result
from tessera.bench.machine import RunCeilings
from tessera.hw import devices, roofline

SCHEMA = 1


#: other devices each case's roofline time is predicted for (JSON only): "what would this take at the bound there"
OTHER_DEVICES = {"h100": devices.H100_SXM, "h200": devices.H200_SXM, "npu": devices.hypothetical_npu()}


def predicted_seconds(flops: float, bytes_moved: float, ceilings: RunCeilings, dtype: str) -> float | None:
    """The roofline's lower bound on this machine (:func:`tessera.hw.roofline.predict_seconds` with this run's
    ceilings): the slower of computing at the GEMM ceiling and streaming at the read ceiling."""
    if not flops and not bytes_moved:
        return None
    return roofline.predict_seconds(flops, bytes_moved, ceilings.device(), dtype)


def derived(r: Result, ceilings: RunCeilings) -> dict[str, Any]:
    """Rates and fractions of one result (None where they do not apply)."""
    out: dict[str, Any] = {"gflops": None, "gbps": None, "frac_compute": None, "frac_read": None,
                           "predicted_seconds": None, "roofline_fraction": None, "bound": None, "ratio": r.ratio,
                           "predicted_on": None}
    if r.seconds is None or r.seconds <= 0:
        return out
    if r.flops:
        out["gflops"] = r.flops / r.seconds / 1e9
        out["frac_compute"] = out["gflops"] / ceilings.peak_gflops(r.dtype)
    if r.bytes_moved:
        out["gbps"] = r.bytes_moved / r.seconds / 1e9
        out["frac_read"] = out["gbps"] / ceilings.read_gbps
    predicted = predicted_seconds(r.flops, r.bytes_moved, ceilings, r.dtype)
    if predicted is not None:
        out["predicted_seconds"] = predicted
        out["roofline_fraction"] = predicted / r.seconds
        out["bound"] = roofline.bound(r.flops, r.bytes_moved, ceilings.device(), r.dtype)
        out["predicted_on"] = {name: roofline.predict_seconds(r.flops, r.bytes_moved, dev, r.dtype)
                               for name, dev in OTHER_DEVICES.items()}
    return out


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3f}" if seconds < 0.1 else f"{seconds * 1e3:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def print_suite(console: Console, suite: str, results: list[Result], ceilings: RunCeilings) -> None:
    """One table per suite. ``ratio`` is ours / baseline time: below 1 we are faster."""
    table = Table(title=f"tessera bench {suite}", title_justify="left", caption=(
        "ours/base < 1: faster than the baseline. % peak: achieved GFLOP/s of this run's GEMM ceiling (compute-bound) "
        "or GB/s of its read ceiling (memory-bound). roofline: predicted / measured time (1 = at the bound)."),
        caption_justify="left")
    for col in ("case", "ours ms", "±", "baseline", "base ms", "ours/base", "target", "GFLOP/s", "GB/s", "bound",
                "% peak", "pred ms", "roofline"):
        table.add_column(col, justify="left" if col in ("case", "baseline", "bound") else "right")
    for r in results:
        if r.error:
            table.add_row(r.name, "[red]error[/red]", "", "", "", "", "", "", "", "", "", "", r.error.splitlines()[0])
            continue
        d = derived(r, ceilings)
        target = "-" if r.target is None else (f"<= {r.target:g} " + ("ok" if d["ratio"] is not None and
                                                                       d["ratio"] <= r.target else "MISSED"))
        peak = d["frac_compute"] if d["bound"] == "compute" else d["frac_read"]
        table.add_row(
            r.name, _ms(r.seconds), _pct(r.spread), r.baseline_name or "-", _ms(r.baseline_seconds),
            "-" if d["ratio"] is None else f"{d['ratio']:.2f}", target,
            "-" if d["gflops"] is None else f"{d['gflops']:.1f}", "-" if d["gbps"] is None else f"{d['gbps']:.1f}",
            d["bound"] or "-", _pct(peak), _ms(d["predicted_seconds"]), _pct(d["roofline_fraction"]),
        )
    console.print(table)


def to_json(results: list[Result], ceilings: RunCeilings, fingerprint: dict[str, Any], quick: bool,
            suites: list[str], skipped: dict[str, str]) -> dict[str, Any]:
    """The result file: schema, date, machine fingerprint, this run's ceilings, and one entry per case."""
    rows = []
    for r in results:
        row = asdict(r)
        row.update(derived(r, ceilings))
        row["key"] = r.key
        rows.append(row)
    return {"schema": SCHEMA, "date": dt.datetime.now().isoformat(timespec="seconds"), "quick": quick,
            "suites": suites, "skipped": skipped, "machine": fingerprint, "ceilings": ceilings.to_dict(),
            "results": rows}


def write_json(data: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))


def read_json(path: str | Path) -> dict[str, Any]:
    """Load a result file; ValueError with the path when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable tessera bench result file ({exc})") from exc
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("results"), list):
        raise ValueError(f"{path}: not a tessera bench result file (schema {SCHEMA}); write one with "
                         "`tessera bench ... --json FILE`")
    return data
