"""``tessera bench plot FILE``: a roofline chart and latency-vs-context charts from one result file (PNG).

Roofline: each case with FLOPs and bytes sits at its arithmetic intensity (FLOP per byte moved) and achieved
GFLOP/s, under this run's ceilings: the fp32 and bf16 GEMM rates and the read bandwidth's slope. Latency: for the
cases that carry a ``context`` coordinate, milliseconds against context length, ours and the baseline, one line
per (suite, phase, dtype, batch).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402

_COLORS = {"kernels": "tab:blue", "attention": "tab:orange", "paged": "tab:green", "e2e": "tab:red"}


def roofline(data: dict[str, Any], path: Path) -> Path:
    c = data["ceilings"]
    rows = [r for r in data["results"] if r.get("seconds") and r.get("flops") and r.get("bytes_moved")]
    fig, ax = plt.subplots(figsize=(9, 6))
    intensities = [r["flops"] / r["bytes_moved"] for r in rows] or [1.0]
    lo, hi = min(min(intensities) / 4, 0.05), max(max(intensities) * 4, 100.0)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    for peak, label, style in ((c["gemm_fp32_gflops"], "fp32 GEMM", "-"), (c["gemm_bf16_gflops"], "bf16 GEMM", "--")):
        ax.plot(xs, [min(peak, x * c["read_gbps"]) for x in xs], style, color="black", lw=1.2,
                label=f"{label} {peak:.0f} GFLOP/s, read {c['read_gbps']:.0f} GB/s")
    seen = set()
    for r in rows:
        suite = r["suite"]
        ax.scatter(r["flops"] / r["bytes_moved"], r["gflops"], color=_COLORS.get(suite, "gray"), s=24,
                   label=suite if suite not in seen else None, zorder=3)
        seen.add(suite)
        ax.annotate(r["name"][:28], (r["flops"] / r["bytes_moved"], r["gflops"]), fontsize=6, alpha=0.7,
                    xytext=(3, 2), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)", ylabel="achieved GFLOP/s",
           title=f"Roofline: {data['machine'].get('cpu_model', '?')}, {data['machine'].get('num_cores', '?')} cores "
                 f"({data['date'][:10]})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def latency(data: dict[str, Any], path: Path) -> Path | None:
    series: dict[tuple, list[dict]] = defaultdict(list)
    for r in data["results"]:
        p = r.get("params") or {}
        if r.get("seconds") and "context" in p and p.get("phase") in ("prefill", "decode"):
            series[(p["phase"], r["suite"], r["dtype"], p.get("batch", 1), p.get("weights", ""))].append(r)
    series = {k: v for k, v in series.items() if len(v) >= 2}  # a line needs two points
    if not series:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for phase, ax in zip(("prefill", "decode"), axes):
        for (ph, suite, dtype, batch, weights), rows in sorted(series.items()):
            if ph != phase:
                continue
            rows.sort(key=lambda r: r["params"]["context"])
            ctx = [r["params"]["context"] for r in rows]
            label = f"{suite} {dtype} B={batch} {weights}".strip()
            line, = ax.plot(ctx, [r["seconds"] * 1e3 for r in rows], "o-", label=f"tessera {label}")
            base = [r.get("baseline_seconds") for r in rows]
            if all(base):
                ax.plot(ctx, [b * 1e3 for b in base], "x--", color=line.get_color(),
                        label=f"{rows[0]['baseline_name']} {label}")
        ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="ms per call",
               title=f"{phase} latency vs context")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_file(data: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """Write ``<stem>-roofline.png`` and (when there are context sweeps) ``<stem>-latency.png`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [roofline(data, out_dir / f"{stem}-roofline.png")]
    lat = latency(data, out_dir / f"{stem}-latency.png")
    return written + ([lat] if lat else [])
