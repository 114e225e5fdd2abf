"""What is tuned on this machine, as rows (``tuning_summary``) and as a rich table (``tessera tune --show``,
``tessera info``)."""

from __future__ import annotations

from typing import Any

from tessera.tuning import cache, registry


def tuning_summary() -> list[dict[str, Any]]:
    """One row per (tunable, shape class): what :func:`tessera.tuning.tuned` returns now and why.

    Returns
    -------
    list of dict with keys ``name``, ``shape_class`` (str or None), ``default``, ``value`` (what lookups return),
    ``source`` (``"tuned"``, ``"default"``, ``"forced"``, ``"off"``, or ``"error: ..."`` for a malformed environment
    variable), ``speedup`` (the tuned value's measured speed-up over the default, or None), ``measured_at`` (ISO
    time or None), ``quick`` (whether it was a ``--quick`` measurement, or None) and ``doc``.
    """
    rows = []
    for t in registry.tunables().values():
        for sc in t.shape_classes:
            row: dict[str, Any] = {"name": t.name, "shape_class": sc, "default": t.default_for(sc), "doc": t.doc,
                                   "speedup": None, "measured_at": None, "quick": None}
            try:
                value, source, entry = registry.lookup(t.name, sc)
            except ValueError as err:  # a bad TESSERA_TUNE_* must not hide the other rows of `tessera info`
                value, source, entry = t.default_for(sc), f"error: {err}", None
            row.update(value=value, source=source)
            if entry is not None:
                row.update(speedup=entry.get("speedup"), measured_at=entry.get("measured_at"),
                           quick=entry.get("quick"))
            rows.append(row)
    return rows


def format_value(value: object) -> str:
    """A tunable's value for a table: powers of two from 2^16 on as ``2^k`` (byte and multiply-add thresholds).

    Examples
    --------
    >>> format_value(1 << 20), format_value(512), format_value("x")
    ('2^20', '512', 'x')
    """
    if type(value) is int and value >= 1 << 16 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    return str(value)


def _tuning_table(rows: list[dict[str, Any]] | None = None, title: str | None = None) -> Any:
    """``rows`` (default :func:`tuning_summary`) as a ``rich.table.Table``."""
    from rich.table import Table

    rows = tuning_summary() if rows is None else rows
    table = Table(title=title or f"tuned thresholds ({registry.current_path()})", title_justify="left")
    for name, justify in (("tunable", "left"), ("shape class", "left"), ("default", "right"), ("value", "right"),
                          ("source", "left"), ("speed-up", "right"), ("measured", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "source")  # type: ignore[arg-type]
    for r in rows:
        speedup = f"{r['speedup']:.2f}x" if isinstance(r.get("speedup"), (int, float)) else ""
        when = (r.get("measured_at") or "")[:16].replace("T", " ")
        if when and r.get("quick"):
            when += " (quick)"
        source = {"tuned": "[green]tuned[/]", "forced": "[yellow]forced[/]"}.get(r["source"], r["source"])
        table.add_row(r["name"], cache.class_key(r["shape_class"]), format_value(r["default"]),
                      format_value(r["value"]), source, speedup, when)
    return table
