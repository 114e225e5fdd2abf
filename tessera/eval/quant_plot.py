"""The quant report's chart: perplexity and mean KL divergence against bytes per weight, one labelled point per
weight format (PNG). KV rows share their weights' bytes per weight, so they are left to the table."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_report(record: dict[str, Any], path: str | Path) -> Path:
    """Draw ``record`` (:meth:`tessera.eval.quant_report.QuantReport.to_dict`, plus ``date`` when the JSON has it)
    to ``path``.

    The left panel is perplexity, the right mean KL divergence from the reference on a log scale (the reference
    itself, KL 0, has no point there); bytes per weight run along a log axis. Standard errors are left to the table:
    every format is scored on the same tokens, so their differences are far better known than each one's error bar
    suggests.

    Returns
    -------
    Path
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    rows = sorted((r for r in record["rows"] if not r["paged_kv"]), key=lambda r: r["bytes_per_weight"])
    if not rows:
        raise ValueError("plot_report: the report has no weight-format rows to plot")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    ppl_offsets = _label_offsets([(r["bytes_per_weight"], r["ppl"]) for r in rows], log_y=False)
    for row, offset in zip(rows, ppl_offsets):
        left.scatter(row["bytes_per_weight"], row["ppl"], color="tab:blue", zorder=3)
        left.annotate(row["name"], (row["bytes_per_weight"], row["ppl"]), xytext=offset, textcoords="offset points",
                      fontsize=8)
    diverged = [r for r in rows if r["kl_mean"] > 0]
    kl_offsets = _label_offsets([(r["bytes_per_weight"], r["kl_mean"]) for r in diverged], log_y=True)
    for row, offset in zip(diverged, kl_offsets):
        right.scatter(row["bytes_per_weight"], row["kl_mean"], color="tab:red", zorder=3)
        right.annotate(row["name"], (row["bytes_per_weight"], row["kl_mean"]), xytext=offset,
                       textcoords="offset points", fontsize=8)
    xlabel = "bytes per weight (projections + token tables, scales included)"
    left.set(xlabel=xlabel, ylabel="perplexity", title="perplexity (standard errors in the table)")
    right.set(xlabel=xlabel, ylabel="mean KL(P_fp32 || P) per token, nats", yscale="log",
              title="mean KL divergence from the fp32 reference")
    ticks = [0.5, 0.75, 1, 1.5, 2, 3, 4]
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.set_xlim(min(0.45, rows[0]["bytes_per_weight"] * 0.9), max(4.8, rows[-1]["bytes_per_weight"] * 1.2))
        ax.margins(y=0.1)
        ax.grid(True, which="both", alpha=0.3)
    name = Path(record["model"]).name
    when = f", {record['date']}" if record.get("date") else ""
    fig.suptitle(f"{name}: {record['n_chunks']} windows of {record['ctx']} tokens, {record['n_scored']} scored{when}",
                 fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _label_offsets(points: list[tuple[float, float]], log_y: bool) -> list[tuple[int, int]]:
    """Where each point's label goes, in points from it: to its right, or, when the previous point (by bytes per
    weight) sits close by in both x and y, the previous label above its point and this one below, so the two do not
    run into each other."""
    import math

    ys = [math.log10(y) if log_y else y for _, y in points]
    span = (max(ys) - min(ys)) if len(ys) > 1 and max(ys) > min(ys) else 1.0
    right, above, below = (6, -3), (6, 5), (6, -11)
    offsets = []
    for i, (x, _) in enumerate(points):
        near = i > 0 and x / points[i - 1][0] < 1.25 and abs(ys[i] - ys[i - 1]) < 0.06 * span
        if near and offsets[-1] == right:
            offsets[-1] = above
            offsets.append(below)
        else:
            offsets.append(right)
    return offsets
