"""``tessera profile``: where one request's time goes, op by op, against this CPU's roofline.

Loads a model, warms up, then generates ``--gen-len`` tokens from a random ``--prompt-len``-token prompt under
``torch.profiler`` with every kernel call point wrapped (:mod:`tessera.profiling.accounting`). Writes a
Chrome/Perfetto trace and prints one row per op, sorted by time, so the top rows name the bottleneck. Column
meanings: docs/profiling.md.

``--tensor-parallel-size N`` profiles rank 0 of a tensor-parallel engine and adds the communication share of a step
(time in collectives against the rest, collectives and bytes per step) next to the cost model's prediction for the
same collectives on this machine (:data:`tessera.hw.links.LOOPBACK_GLOO`). ``--project llama-70b --devices 8xH200``
loads nothing: it prints the model of :mod:`tessera.hw.projection` (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from tessera.tools.weight_flags import add_weight_flags, keep_quantized

if TYPE_CHECKING:  # the CLI parser imports this module; torch loads only when the command runs
    from rich.table import Table

    from tessera.hw.devices import Device
    from tessera.hw.links import Link
    from tessera.profiling.tracer import ProfileResult

#: ``--project`` choices (kept here: the parser must not import torch; tessera.hw.projection does not)
MODEL_SHAPES = ("llama-70b",)
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
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N processes and report rank 0's time in collectives (default 1)")
    p.add_argument("--project", choices=sorted(MODEL_SHAPES),
                   help="print a modelled (not measured) tensor-parallel decode step of this model shape instead")
    p.add_argument("--devices", default="8xH200", help="with --project: ranks and GPU, e.g. 8xH200 (default)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32],
                   help="with --project: decode batch sizes (default 1 32)")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tessera.engine import LLM
    from tessera.hw import devices
    from tessera.profiling import profile_request

    err = Console(stderr=True)
    # piped output gets a fixed width: rich's 80-column default would truncate the numbers
    out = Console(width=None if sys.stdout.isatty() else TABLE_WIDTH)
    if args.project is not None:
        return _run_projection(args, out, err)
    if args.prompt_len < 1 or args.gen_len < 1:
        err.print(f"[red]error:[/] --prompt-len and --gen-len must be >= 1, got {args.prompt_len} and {args.gen_len}")
        return 2
    if args.tensor_parallel_size < 1:
        err.print(f"[red]error:[/] --tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
        return 2
    with err.status("loading the model, reading this machine's ceilings..."):
        llm = LLM(args.model, dtype=args.dtype, backend=args.backend, max_num_seqs=1,
                  max_num_batched_tokens=max(512, args.prompt_len), enable_prefix_caching=False,
                  keep_quantized=keep_quantized(args), tensor_parallel_size=args.tensor_parallel_size)
    try:
        with err.status("reading this machine's ceilings..."):
            device = devices.this_cpu().with_peaks(_backend_peaks())
        with err.status(f"warming up, then profiling {args.prompt_len} prompt + {args.gen_len} generated tokens..."):
            result = profile_request(llm, args.prompt_len, args.gen_len, args.trace, unfused=args.unfused,
                                     phases=not args.merge_phases)
    finally:
        llm.shutdown()  # stops the worker ranks of a tensor-parallel engine (a no-op otherwise)
    out.print(ops_table(result, device, DTYPE_KEYS[args.dtype], args.top))
    out.print(summary_line(result), highlight=False)
    if args.tensor_parallel_size > 1:
        from tessera.hw.links import LOOPBACK_GLOO

        out.print(comm_table(comm_summary(result, args.tensor_parallel_size, LOOPBACK_GLOO), LOOPBACK_GLOO))
    return 0


def _run_projection(args: argparse.Namespace, out, err) -> int:
    from tessera.hw import projection

    try:
        world, device = projection.parse_devices(args.devices)
        if any(b < 1 for b in args.batch):
            raise ValueError(f"--batch sizes must be >= 1, got {args.batch}")
        rows = [projection.project_decode(projection.MODEL_SHAPES[args.project], device, world, b)
                for b in args.batch]
    except ValueError as exc:
        err.print(f"[red]error:[/] {exc}")
        return 2
    out.print(projection_table(rows))
    return 0


def projection_table(rows: list) -> Table:
    """A rich Table of :class:`tessera.hw.projection.DecodeProjection` rows (one per batch size)."""
    from rich.table import Table

    first = rows[0]
    shape, link = first.shape, first.link
    title = (f"MODEL, not a measurement: decode step of {shape.name} ({shape.num_layers} layers, hidden "
             f"{shape.hidden}, {shape.num_heads}/{shape.num_kv_heads} heads, intermediate {shape.intermediate}, vocab "
             f"{shape.vocab}, {shape.bytes_per_weight:g} bytes/weight) at TP={first.world} on {first.device.name}")
    caption = (f"per layer: max(weight bytes / {first.world} / {first.device.mem_bw / 1e12:.2f} TB/s, FLOPs / "
               f"{first.world} / bf16 peak) + 2 ring all-reduces of batch x {shape.hidden} x "
               f"{shape.bytes_per_weight:g} bytes on {link.name} ({link.latency_s * 1e6:g} us/hop, "
               f"{link.bandwidth / 1e9:g} GB/s); plus the output head's read. KV-cache reads and overlap not "
               "modelled (docs/distributed.md).")
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for name in ("batch", "weights ms/step", "all-reduce bytes", "all-reduces/step", "comm ms/step", "step ms",
                 "tokens/s", "comm share"):
        table.add_column(name, justify="right", no_wrap=True)
    for p in rows:
        table.add_row(str(p.batch), f"{p.compute_s * 1e3:.3f}", _si(p.all_reduce_bytes, "B"),
                      str(p.all_reduces_per_step), f"{p.comm_s * 1e3:.3f}", f"{p.step_s * 1e3:.3f}",
                      f"{p.tokens_per_s:.1f}", f"{p.comm_share:.1%}")
    return table


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
    from tessera.profiling import COMM_OPS

    for op in result.ops.sorted()[:top]:
        if op.name.split(" (")[0] in COMM_OPS:  # a collective: its bytes cross the link, no memory roofline applies
            table.add_row(op.name, f"{op.seconds / wall:.1%}", str(op.calls), f"{op.seconds * 1e3:.2f}", "",
                          _si(op.bytes, "B"), "", "", "", "", "link")
            continue
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


def comm_summary(result: ProfileResult, world: int, link: Link) -> list[dict]:
    """Rank 0's time in collectives per engine phase, and what ``link``'s cost model predicts for them.

    Parameters
    ----------
    result : a profiled request of a tensor-parallel engine (rank 0's ops; the collectives are the
        :data:`tessera.profiling.COMM_OPS`).
    world : the number of ranks.
    link : the link to predict with (:data:`tessera.hw.links.LOOPBACK_GLOO` for this machine).

    Returns
    -------
    list of dict, one per phase (``"prefill"``, ``"decode"``; ``"request"`` when phases were merged), with keys
    ``phase``, ``steps``, ``collectives`` (per step), ``kinds`` (op name -> calls per step), ``bytes`` (per step,
    the collectives' result buffers), ``comm_s`` and ``step_s`` (per step, measured on rank 0), ``compute_s``
    (``step_s - comm_s``), ``share`` (``comm_s / step_s``) and ``predicted_s`` (per step, the cost model).
    """
    from tessera.hw.links import collective_seconds
    from tessera.profiling import COMM_OPS

    ops = result.ops
    phases = [(p, ops.steps[p], ops.step_seconds[p]) for p in ("prefill", "decode") if ops.steps.get(p)]
    if not phases:  # phases merged: no step boundaries, the whole request is the unit
        phases = [(None, 1, result.wall_seconds)]
    rows = []
    for phase, steps, step_seconds in phases:
        kinds: dict[str, float] = {}
        seconds = nbytes = predicted = 0.0
        for name, kind in COMM_OPS.items():
            op = ops.stats.get(name if phase is None else f"{name} ({phase})")
            if op is None:
                continue
            kinds[name] = op.calls / steps
            seconds += op.seconds
            nbytes += op.bytes
            predicted += collective_seconds(link, kind, op.calls, op.bytes, world)
        rows.append({"phase": phase or "request", "steps": steps, "collectives": sum(kinds.values()), "kinds": kinds,
                     "bytes": nbytes / steps, "comm_s": seconds / steps, "step_s": step_seconds / steps,
                     "compute_s": max(step_seconds - seconds, 0.0) / steps,
                     "share": seconds / step_seconds if step_seconds > 0 else 0.0, "predicted_s": predicted / steps})
    return rows


def comm_table(rows: list[dict], link: Link) -> Table:
    """A rich Table of :func:`comm_summary`'s rows."""
    from rich.table import Table

    caption = (f"measured on rank 0: time inside collectives (including waiting for the other ranks) against the "
               f"rest of its forward steps (argmax_across: the all-gather of each rank's best logit, greedy steps; "
               f"'request': phases merged, the whole request's wall time). predicted: alpha-beta ring model on "
               f"{link.name}, {link.latency_s * 1e6:.0f} us/hop, {link.bandwidth / 1e9:.2f} GB/s ({link.source}).")
    table = Table(title="communication of a tensor-parallel step (rank 0; collectives, bytes and ms are per step)",
                  title_justify="left", caption=caption, caption_justify="left")
    for name in ("phase", "steps", "collectives", "bytes", "comm ms", "compute ms", "step ms", "comm share",
                 "predicted comm ms"):
        table.add_column(name, justify="left" if name == "phase" else "right", no_wrap=True)
    for r in rows:
        kinds = " + ".join(f"{n:g} {k}" for k, n in r["kinds"].items())
        table.add_row(r["phase"], str(r["steps"]), f"{r['collectives']:g} ({kinds})" if kinds else "0",
                      _si(r["bytes"], "B"), f"{r['comm_s'] * 1e3:.2f}", f"{r['compute_s'] * 1e3:.2f}",
                      f"{r['step_s'] * 1e3:.2f}", f"{r['share']:.1%}", f"{r['predicted_s'] * 1e3:.2f}")
    return table


def _si(value: float, unit: str = "") -> str:
    """``12.3 G`` style: three significant digits with a decimal prefix."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()
