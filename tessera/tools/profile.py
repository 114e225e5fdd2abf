"""``tessera profile``: where one request's time goes, op by op, against this CPU's roofline.

Loads a model, warms up, then generates ``--gen-len`` tokens from a random ``--prompt-len``-token prompt under
``torch.profiler`` with every kernel call point wrapped (:mod:`tessera.profiling.accounting`). Writes a
Chrome/Perfetto trace and prints one row per op, sorted by time, so the top rows name the bottleneck. Column
meanings: docs/profiling.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from tessera.tools.weight_flags import add_weight_flags, keep_quantized

if TYPE_CHECKING:  # the CLI parser imports this module; torch loads only when the command runs
    from rich.table import Table

    from tessera.hw.devices import Device
    from tessera.profiling.tracer import ProfileResult

DTYPE_KEYS = {"float32": "fp32", "bfloat16": "bf16"}
#: Columns of the table when stdout is not a terminal.
TABLE_WIDTH = 150


def add_parser(commands) -> None:
    p = commands.add_parser("profile", help="profile one request op by op against this CPU's roofline")
    p.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens (default 64)")
    p.add_argument("--gen-len", type=int, default=16, help="generated tokens, EOS ignored (default 16)")
    p.add_argument("--dtype", choices=sorted(DTYPE_KEYS), default="float32")
    p.add_argument("--backend", default="auto")
    add_weight_flags(p)
    p.add_argument("--trace", default="tessera-profile.json", help="Chrome/Perfetto trace file to write")
    p.add_argument("--top", type=int, default=None, help="show only the K most expensive ops")
    p.add_argument("--unfused", action="store_true",
                   help="run decode steps op by op instead of the fused decoder-layer kernel")
    p.add_argument("--merge-phases", action="store_true",
                   help="one row per op over the whole request instead of separate prefill and decode rows")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tessera.engine import LLM
    from tessera.hw import devices
    from tessera.profiling import profile_request

    err = Console(stderr=True)
    if args.prompt_len < 1 or args.gen_len < 1:
        err.print(f"[red]error:[/] --prompt-len and --gen-len must be >= 1, got {args.prompt_len} and {args.gen_len}")
        return 2
    with err.status("loading the model, reading this machine's ceilings..."):
        llm = LLM(args.model, dtype=args.dtype, backend=args.backend, max_num_seqs=1,
                  max_num_batched_tokens=max(512, args.prompt_len), enable_prefix_caching=False,
                  keep_quantized=keep_quantized(args))
        device = devices.this_cpu().with_peaks(_backend_peaks())
    with err.status(f"warming up, then profiling {args.prompt_len} prompt + {args.gen_len} generated tokens..."):
        result = profile_request(llm, args.prompt_len, args.gen_len, args.trace, unfused=args.unfused,
                                 phases=not args.merge_phases)
    # piped output gets a fixed width: rich's 80-column default would truncate the numbers
    out = Console(width=None if sys.stdout.isatty() else TABLE_WIDTH)
    out.print(ops_table(result, device, DTYPE_KEYS[args.dtype], args.top))
    out.print(summary_line(result), highlight=False)
    return 0


def _backend_peaks() -> dict[str, float]:
    """Compute peaks usable backends measure for their kernel variants (e.g. ``int8`` dot products)."""
    import tessera.attention  # noqa: F401
    from tessera.backends import registered

    peaks: dict[str, float] = {}
    for backend in registered().values():
        if hasattr(backend, "compute_peaks") and not backend.available():
            peaks.update(backend.compute_peaks())
    return peaks


def ops_table(result: ProfileResult, device: Device, dtype: str, top: int | None = None) -> Table:
    """A rich Table of ``result``'s ops, most expensive first, each against ``device``'s roofline for ``dtype``."""
    from rich.table import Table

    from tessera.hw import roofline

    extra = "".join(f", {device.peak(k) / 1e9:.0f} GOP/s {k}" for k in sorted(device.peak_flops) if k != dtype
                    and k != "bf16")
    caption = (f"roofline: {device.name}, {device.peak(dtype) / 1e9:.0f} GFLOP/s {dtype}{extra}, "
               f"{device.mem_bw / 1e9:.1f} GB/s ({device.source}). "
               "'roof ms' = max(FLOPs / peak, bytes / bandwidth), a lower bound; 'of roof' = roof ms / ms.")
    table = Table(title=f"ops of one request ({result.prompt_len} prompt + {result.gen_len} generated tokens), "
                        f"{result.wall_seconds * 1e3:.1f} ms", title_justify="left", caption=caption,
                  caption_justify="left")
    for name, justify in (("op", "left"), ("time %", "right"), ("calls", "right"), ("ms", "right"),
                          ("FLOPs", "right"), ("bytes", "right"), ("GFLOP/s", "right"), ("GB/s", "right"),
                          ("roof ms", "right"), ("of roof", "right"), ("bound", "left")):
        table.add_column(name, justify=justify, no_wrap=True)
    wall = max(result.wall_seconds, 1e-12)
    for op in result.ops.sorted()[:top]:
        roof = op.roof if op.roof in device.peak_flops else dtype  # e.g. int8 dot products: their own roof
        predicted = roofline.predict_seconds(op.flops, op.bytes, device, roof)
        seconds = max(op.seconds, 1e-12)
        table.add_row(op.name, f"{op.seconds / wall:.1%}", str(op.calls), f"{op.seconds * 1e3:.2f}", _si(op.flops),
                      _si(op.bytes, "B"), f"{op.flops / seconds / 1e9:.2f}", f"{op.bytes / seconds / 1e9:.2f}",
                      f"{predicted * 1e3:.3f}", f"{predicted / seconds:.1%}",
                      roofline.bound(op.flops, op.bytes, device, roof) + ("" if roof == dtype else f" ({roof})"))
    table.add_row("python/other", f"{result.other_seconds / wall:.1%}", "", f"{result.other_seconds * 1e3:.2f}",
                  "", "", "", "", "", "", "", style="dim")
    return table


def summary_line(result: ProfileResult) -> str:
    """Prefill and decode throughput and the unaccounted share, one line."""
    other = result.other_seconds / max(result.wall_seconds, 1e-12)
    trace = f"; trace: {result.trace_path}" if result.trace_path is not None else ""
    return (f"prefill {result.prefill_tok_s:.0f} tok/s ({result.prompt_len} tokens), decode "
            f"{result.decode_tok_s:.1f} tok/s ({result.gen_len} tokens), python/other {other:.1%} of "
            f"{result.wall_seconds * 1e3:.1f} ms{trace}")


def _si(value: float, unit: str = "") -> str:
    """``12.3 G`` style: three significant digits with a decimal prefix."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()
