"""``tessera quant-report [FILE | --corpus pydoc]``: what each weight format and KV cache format costs, on one model
and one text (:mod:`tessera.eval.quant_report`).

Per row: perplexity by llama-perplexity's protocol, the mean and 99th-percentile KL divergence of the next-token
distribution from the float32 reference, top-1 agreement with it, bytes per weight of the projections and token
tables as held, the bytes of all the model's weights, and batch-1 greedy decode tokens/s.

Weight formats (--formats): fp32 (the reference: a GGUF file de-quantized), bf16, int8, int4, int4_min (groups of
--group-size along K), fp8_e4m3 (per channel), gguf (the file's own packed types, as `tessera generate` runs them).
KV rows (--kv-formats), each WEIGHTS:KV with KV one of fp32, bf16 (the model's own dtype), int8, fp8_e4m3; default
fp32:int8 fp32:fp8_e4m3 bf16:bf16 bf16:int8; `none` for no KV rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

from tessera.tools.placement_flags import add_placement_flags

#: the choices of ``--corpus`` (tessera.eval.corpus.CORPORA, spelled here so the parser imports nothing)
CORPORA = ("pydoc",)


def add_parser(commands: Any) -> None:
    p = commands.add_parser("quant-report", help="perplexity, KL divergence, memory and decode speed per weight and "
                                                 "KV cache format", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", nargs="?", help="UTF-8 text file (or --corpus)")
    p.add_argument("--corpus", choices=CORPORA,
                   help="measure a built-in text instead of FILE: pydoc = the standard library's help topics")
    p.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--chunks", type=int, default=8, help="windows evaluated per format (default 8)")
    p.add_argument("--formats", nargs="+", metavar="FORMAT",
                   help="weight formats: fp32 bf16 int8 int4 int4_min fp8_e4m3 gguf (default: all the model has; "
                        "fp32, the reference, is always measured)")
    p.add_argument("--kv-formats", nargs="+", metavar="WEIGHTS:KV",
                   help="KV cache rows, e.g. fp32:int8 bf16:bf16 bf16:int8 (default: fp32:int8 fp32:fp8_e4m3 "
                        "bf16:bf16 bf16:int8); none for no KV rows")
    p.add_argument("--group-size", type=int, default=32,
                   help="int8 / int4 / int4_min weights per scale along K: 32 (default), 64 or 128")
    p.add_argument("--decode-tokens", type=int, default=32,
                   help="greedy tokens per decode-speed run (default 32; 0 skips the decode measurement)")
    p.add_argument("--decode-repeats", type=int, default=3, help="timed decode runs per format; the median is "
                                                                 "reported (default 3)")
    p.add_argument("--json", metavar="OUT", help="write the report, machine and settings to OUT as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="draw perplexity and mean KL against bytes per weight to OUT")
    add_placement_flags(p)
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tessera.eval.corpus import corpus_fingerprint, corpus_text, read_text

    err = Console(stderr=True)
    if (args.file is None) == (args.corpus is None):
        raise ValueError("pass a text FILE or --corpus NAME (exactly one)")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise FileNotFoundError(f"{flag} {path}: its directory does not exist")
    text = read_text(args.file) if args.file is not None else corpus_text(args.corpus)

    import time

    from tessera.eval.quant_report import quant_report
    from tessera.hw import probes

    before, started = probes.cpu_seconds(), time.perf_counter()
    with _Progress(err) as progress:
        report = quant_report(args.model, text, ctx=args.ctx, chunks=args.chunks, formats=args.formats,
                              kv_formats=args.kv_formats, group_size=args.group_size,
                              decode_tokens=args.decode_tokens, decode_repeats=args.decode_repeats,
                              backend=args.backend, device=args.device, on_step=progress.step,
                              on_row=progress.row)
    seconds = time.perf_counter() - started
    # the share of the CPUs other processes took meanwhile: on a shared machine the timings are low by about that much
    others = probes.others_busy_fraction(before, probes.cpu_seconds(), seconds)
    record = {"date": datetime.date.today().isoformat(), **report.to_dict(), "seconds": seconds,
              "others_busy": others,
              "text": {"file": args.file, "corpus": args.corpus, **corpus_fingerprint(text)},
              "settings": _settings(args), "machine": _machine()}
    Console().print(report_table(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
        err.print(f"wrote {args.json}", highlight=False)
    if args.plot:
        from tessera.eval.quant_plot import plot_report

        plot_report(record, args.plot)
        err.print(f"wrote {args.plot}", highlight=False)
    return 0


def report_table(record: dict[str, Any]) -> Any:
    """The report as a rich table (one row per format)."""
    from rich.table import Table

    caption = (f"{record['n_chunks']} windows of {record['ctx']} tokens, {record['n_scored']} scored; KL = "
               "KL(P_fp32 || P) per scored token in nats; bytes/weight of the projections and token tables as held; "
               "weights = summed tensor bytes of every weight; decode = batch-1 greedy, median of "
               f"{record['decode_repeats']} runs of {record['decode_tokens']} tokens")
    table = Table(title=f"quant report: {Path(record['model']).name}", title_justify="left", caption=caption,
                  caption_justify="left")
    for column in ("format", "KV", "PPL", "+/-", "mean KL", "p99 KL", "top-1", "bytes/weight", "weights MiB",
                   "decode tok/s"):
        table.add_column(column, justify="left" if column in ("format", "KV") else "right")
    for r in record["rows"]:
        decode = f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] is not None else "-"
        table.add_row(r["weights"], r["kv_cache"] + (" (paged)" if r["paged_kv"] else ""), f"{r['ppl']:.4f}",
                      f"{r['stderr']:.4f}", f"{r['kl_mean']:.2e}", f"{r['kl_p99']:.2e}", f"{r['top1']:.4f}",
                      f"{r['bytes_per_weight']:.4f}", f"{r['model_bytes'] / 2**20:.1f}", decode)
    return table


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """How the report ran: what its figures depend on besides the text and the protocol."""
    import torch

    import tessera

    return {"ctx": args.ctx, "chunks": args.chunks, "formats": args.formats, "kv_formats": args.kv_formats,
            "group_size": args.group_size, "decode_tokens": args.decode_tokens,
            "decode_repeats": args.decode_repeats, "backend": args.backend, "device": args.device,
            "torch_threads": torch.get_num_threads(), "kernel_variants": _kernel_variants(),
            "TESSERA_CPU_VARIANTS": os.environ.get("TESSERA_CPU_VARIANTS"), "tessera": tessera.__version__,
            "argv": sys.argv[1:]}


def _kernel_variants() -> dict[str, str]:
    """The kernel variant each op family of each usable backend chose (``{"cpu.qgemm": "avx512_bf16", ...}``): the
    packed formats' arithmetic depends on them (bf16 prefill tiles, int8 activations in decode GEMVs)."""
    from tessera.backends import registered

    chosen = {}
    for backend in registered().values():
        explain = getattr(backend, "kernel_variants", None)
        if explain is None or backend.available():
            continue
        for row in explain():
            chosen[f"{backend.name}.{row['family']}"] = row["chosen"]
    return chosen


def _machine() -> dict[str, Any]:
    from tessera.bench.machine import fingerprint

    return fingerprint()


class _Progress:
    """A rich progress bar over each row's windows, with what runs now (building a model, windows, decoding)."""

    def __init__(self, console: Any) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._console = console
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=console)
        self._task: Any = None

    def __enter__(self) -> _Progress:
        self._progress.__enter__()
        self._task = self._progress.add_task("loading the reference...", total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def step(self, row: str, what: str, done: int, total: int) -> None:
        """The ``on_step`` hook of :func:`tessera.eval.quant_report.quant_report`."""
        if what == "window":
            self._progress.update(self._task, description=f"{row}: windows", total=total, completed=done)
        else:
            label = "building the model" if what == "build" else "decode tok/s"
            self._progress.update(self._task, description=f"{row}: {label}", total=None, completed=0)

    def row(self, row: Any) -> None:
        """The ``on_row`` hook: one line per finished row above the bar."""
        decode = f", decode {row.decode_tok_s:.1f} tok/s" if row.decode_tok_s is not None else ""
        self._console.print(f"{row.name}: PPL {row.ppl:.4f}, mean KL {row.kl_mean:.2e}, top-1 {row.top1:.4f}, "
                            f"{row.bytes_per_weight:.3f} B/weight{decode}", highlight=False)
