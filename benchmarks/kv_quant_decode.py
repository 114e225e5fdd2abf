"""Paged decode over quantized KV pages against bf16 (and fp32) pages, one layer, same run.

Batch 8, every sequence 4096 keys (``--kv-len``), one query each (``--queries``), Hq=32 (``--hq``), Hkv=8, D=128, page size 16, pages shuffled through the
pool; the same K/V values stored as fp32, bf16, int8 and fp8 e4m3 (a float16 scale per token and head). The four
runs are timed round-robin (``attention_cpu.time_interleaved``), so the ratios hold on a shared machine even when the
absolute times move. ``int8`` runs the ``kv_qk`` and ``kv_pv`` variants chosen for this CPU (Q.K and P.V in int8
dot products with VNNI); ``int8/float-pv`` is the same pages with ``kv_pv=float`` forced (int8 Q.K, value codes
widened to float32), ``int8/float-qk`` with ``kv_qk=portable`` (both products in float32), timed in the same
round-robin, so the paths compare on equal terms. Reports tokens/s (the batch's queries per second of one
layer), the KV bytes each read, the GB/s that makes, and each format's speed over bf16's.

Usage::

    python benchmarks/kv_quant_decode.py [--batch 8] [--kv-len 4096] [--reps 15] [--hq 32] [--queries 1] [--json PATH]

``--hq 64`` (GQA groups of 8) or ``--queries 4`` (a verify step) give the int8 kernel 8 or more query rows per kv
head, where its P.V runs in int8 too (``kv_pv``; with fewer rows it is the float pass either way).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see paged_cpu.py: idle OpenMP pools must not spin
import datetime
import json
from typing import Any

import torch
from attention_cpu import time_interleaved  # same folder: the interleaved median timer
from rich.console import Console
from rich.table import Table

from tessera.attention import AttentionSpec, causal, plan
from tessera.bench.machine import fingerprint
from tessera.bench.suites.paged import D, HKV, HQ, PAGE, make_batch
from tessera.kv.quantized import QuantizedPages, bytes_per_token, quantize_kv

FORMATS = ("float32", "bfloat16", "int8", "int8/float-pv", "int8/float-qk", "fp8_e4m3")
#: extra rows: (storage format, TESSERA_CPU_VARIANTS while it runs)
FORCED = {"int8/float-pv": ("int8", "kv_pv=float"), "int8/float-qk": ("int8", "kv_qk=portable")}


def forcing(fn, setting: str):
    """``fn`` run with ``TESSERA_CPU_VARIANTS=setting`` (the variant choice is read per call and cached per setting,
    so switching costs microseconds)."""
    def run():
        old = os.environ.get("TESSERA_CPU_VARIANTS")
        os.environ["TESSERA_CPU_VARIANTS"] = setting
        try:
            return fn()
        finally:
            if old is None:
                del os.environ["TESSERA_CPU_VARIANTS"]
            else:
                os.environ["TESSERA_CPU_VARIANTS"] = old
    return run


def pools(k: torch.Tensor, v: torch.Tensor, fmt: str):
    if fmt in ("float32", "bfloat16"):
        dtype = getattr(torch, fmt)
        return k.to(dtype), v.to(dtype)
    return QuantizedPages(*quantize_kv(k, fmt), fmt), QuantizedPages(*quantize_kv(v, fmt), fmt)


def run(batch: int, kv_len: int, reps: int, hq: int = HQ, q_per_seq: int = 1) -> dict[str, Any]:
    if hq % HKV:
        raise SystemExit(f"--hq must be a multiple of the {HKV} kv heads, got {hq}")
    gen = torch.Generator().manual_seed(0)
    kv_lens, q_lens = [kv_len] * batch, [q_per_seq] * batch
    _, k, v, table = make_batch(kv_lens, q_lens, torch.float32, gen)
    q = torch.randn(batch * q_per_seq, hq, D, generator=gen)
    spec = AttentionSpec(hq, HKV, D, mask=causal())
    p = plan(spec, q_lens, kv_lens, table, PAGE, backend="cpu")
    stores = {fmt: pools(k, v, fmt) for fmt in FORMATS if fmt not in FORCED}
    # Each forced row reads its own copy of the pages: sharing them, a row timed right after its base would find
    # part of them still in the L3 (32 MiB against 68 MB of int8 pages) and look faster than it is.
    stores.update({fmt: pools(k, v, base) for fmt, (base, _) in FORCED.items()})
    # queries in bf16 for the bf16 and quantized pools (a bf16 model's), fp32 for fp32 pages
    queries = {fmt: q if fmt == "float32" else q.to(torch.bfloat16) for fmt in FORMATS}
    calls = {fmt: (lambda f=fmt: p.run(queries[f], *stores[f])) for fmt in FORMATS}
    calls.update({fmt: forcing(calls[fmt], setting) for fmt, (_, setting) in FORCED.items()})
    times, outs = time_interleaved(calls, reps)
    rows = []
    for fmt in FORMATS:
        storage = None if fmt in ("float32", "bfloat16") else FORCED.get(fmt, (fmt,))[0]
        dtype = getattr(torch, fmt) if storage is None else torch.bfloat16
        kv_bytes = batch * kv_len * bytes_per_token(HKV, D, dtype, storage)
        err = float((outs[fmt].float() - outs["float32"]).abs().max() / outs["float32"].abs().max())
        rows.append({"kv_format": fmt, "seconds": times[fmt], "tokens_per_s": batch / times[fmt],
                     "kv_bytes": kv_bytes, "gb_per_s": kv_bytes / times[fmt] / 1e9,
                     "speed_vs_bf16": times["bfloat16"] / times[fmt], "rel_err_vs_fp32": err})
    return {"benchmark": "kv_quant_decode", "date": datetime.date.today().isoformat(), "machine": fingerprint(),
            "threads": torch.get_num_threads(), "batch": batch, "kv_len": kv_len, "queries_per_sequence": q_per_seq,
            "heads": [hq, HKV], "head_dim": D,
            "page_size": PAGE, "reps": reps, "results": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--kv-len", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--hq", type=int, default=HQ, help=f"query heads ({HKV} kv heads; default {HQ})")
    parser.add_argument("--queries", type=int, default=1,
                        help="query tokens per sequence (a speculative verify step; default 1)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    report = run(args.batch, args.kv_len, args.reps, args.hq, args.queries)
    table = Table(title=f"paged decode b={args.batch} L={args.kv_len} Hq={args.hq} q={args.queries}, "
                        f"{report['machine']['cpu_model']}")
    for col in ("KV format", "ms", "tok/s", "KV MB", "GB/s", "x bf16 speed", "err vs fp32"):
        table.add_column(col, justify="right")
    for r in report["results"]:
        table.add_row(r["kv_format"], f"{r['seconds'] * 1e3:.2f}", f"{r['tokens_per_s']:.0f}",
                      f"{r['kv_bytes'] / 1e6:.0f}", f"{r['gb_per_s']:.1f}", f"{r['speed_vs_bf16']:.2f}",
                      f"{r['rel_err_vs_fp32']:.1e}")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
