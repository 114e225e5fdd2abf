"""Where the cpu backend's decode and cascade milliseconds go: each part timed on its own, interleaved in one process.

Two reports, both for the fp32 targets of issues 2 and 3 that are still open on this machine:

* ``decode``: B=8, L=4096, Hq=32, Hkv=8, D=128 (the decode case of ``attention_cpu.py``). Times ``attention()``,
  the Numba kernel alone with the plan built once, and ``torch.sum`` over the same K/V bytes, first on their own
  and then with torch SDPA over transposed copies in the same rounds (the benchmark's situation: our call follows
  SDPA's 268 MB stream).
* ``cascade``: 32 decodes sharing a 4096-token prefix with 128 own tokens each (the cascade case of
  ``paged_cpu.py``). Times the plan without the cascade, the whole cascade step, and its three parts: the prefix
  kernel, the members' suffix decode, and the merge.

The machine is shared and switches between a quiet and a busy state, so compare rows of one run, never across
runs. Usage::

    python benchmarks/attention_breakdown.py [decode|cascade|both] [--reps N] [--quick]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see benchmarks/kernels_cpu.py)
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from attention_cpu import time_interleaved  # same folder: the interleaved median timer
from rich.console import Console
from rich.table import Table

from tessera.attention import AttentionSpec, attention, causal
from tessera.backends.base import KVLayout, RaggedBatch
from tessera.backends.cpu import cascade as cascade_mod
from tessera.backends.cpu.backend import CpuBackend
from tessera.backends.cpu.ops._narrow import storage_view
from tessera.backends.cpu.decode_kernel import NO_SCALES, decode_attention_kernel
from tessera.bench.suites.paged import HKV, HQ, D, cascade_plans, make_shared_prefix_batch
from tessera.hw import get_ceilings


def decode_rows(reps: int, quick: bool) -> list[dict[str, Any]]:
    """``attention()``, the kernel alone and torch.sum, alone and interleaved with SDPA: ms and GB/s each."""
    b, length = (2, 512) if quick else (8, 4096)
    spec = AttentionSpec(HQ, HKV, D, mask=causal())
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, 1, HQ, D, generator=gen)
    k = torch.randn(b, length, HKV, D, generator=gen)
    v = torch.randn(b, length, HKV, D, generator=gen)
    batch = RaggedBatch((1,) * b, (length,) * b)
    dplan = CpuBackend().plan(spec, batch, KVLayout.contiguous(batch)).decode
    part_out = np.empty((dplan.num_items, dplan.rows_per_item, D), np.float32)
    part_lse = np.empty((dplan.num_items, dplan.rows_per_item), np.float32)
    args = (q.reshape(b, HQ, D).numpy(), storage_view(k.reshape(b * length, HKV, D)), NO_SCALES,
            storage_view(v.reshape(b * length, HKV, D)), NO_SCALES, np.float32(1.0), part_out, part_lse,
            dplan.schedule)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    fns: dict[str, Callable[[], Any]] = {
        "attention()": lambda: attention(q, k, v, spec, backend="cpu"),
        "kernel alone": lambda: decode_attention_kernel(*args),
        "torch.sum of K and V": lambda: (k.sum(), v.sum()),
    }
    kv_bytes = 2 * k.numel() * k.element_size()
    rows = []
    for setting, extra in (("alone", {}), ("with SDPA", {"SDPA": lambda: F.scaled_dot_product_attention(
            qt, kt, vt, enable_gqa=True)})):
        times, _ = time_interleaved({**fns, **extra}, reps)
        for name, t in times.items():
            rows.append({"setting": setting, "what": name, "ms": t * 1e3, "gbps": kv_bytes / t / 1e9,
                         "over_read": t / times["torch.sum of K and V"]})
    return rows


def cascade_rows(reps: int, quick: bool) -> list[dict[str, Any]]:
    """The cascade step against the plain plan, and the step's parts, in ms."""
    n, prefix, own = (8, 1024, 128) if quick else (32, 4096, 128)
    q, k_pages, v_pages, table, kv_lens = make_shared_prefix_batch(n, prefix, own, torch.Generator().manual_seed(0))
    spec = AttentionSpec(HQ, HKV, D, mask=causal())
    plans = cascade_plans(spec, [1] * n, kv_lens, table, q, k_pages, v_pages)
    state = plans[True].backend_state(q.dtype, q.device)[1]
    (group,) = state.cascades
    k_rows, v_rows = k_pages.reshape(-1, HKV, D), v_pages.reshape(-1, HKV, D)
    out, lse = torch.zeros(n, HQ, D), torch.zeros(n, HQ)
    out2, lse2 = torch.zeros(n, HQ, D), torch.zeros(n, HQ)
    parts = cascade_mod.cascade_prefix(group, spec, q, k_rows, v_rows)
    times, _ = time_interleaved({
        "plain plan (no cascade)": lambda: plans[False].run(q, k_pages, v_pages),
        "cascade step": lambda: plans[True].run(q, k_pages, v_pages),
        "  prefix pass": lambda: cascade_mod.cascade_prefix(group, spec, q, k_rows, v_rows),
        "  suffix decode": lambda: state.decode.run(q, k_rows, v_rows, out, lse),
        "  merge": lambda: cascade_mod.merge_cascade(group, parts, out2, lse2),  # in place: values drift, time does not
    }, reps)
    flops = 4 * n * HQ * prefix * D
    return [{"what": name, "ms": t * 1e3,
             "note": f"{flops / t / 1e9:.0f} GFLOP/s" if name == "  prefix pass" else
             f"{times['plain plan (no cascade)'] / t:.2f}x faster than plain" if name == "cascade step" else ""}
            for name, t in times.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", nargs="?", choices=("decode", "cascade", "both"), default="both")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
    args = parser.parse_args(argv)
    console = Console(width=120)
    if args.report in ("decode", "both"):
        read_ceiling = get_ceilings().read_gbps
        shape = "B=2, L=512" if args.quick else "B=8, L=4096"
        table = Table(title=f"decode fp32, {shape}: attention() and its kernel against torch.sum over the same K/V",
                      title_justify="left", caption=f"% ceiling: of the cached read ceiling ({read_ceiling:.1f} "
                      "GB/s); x read: time over torch.sum's in the same rounds.", caption_justify="left")
        for col in ("setting", "what", "ms", "GB/s", "% ceiling", "x read"):
            table.add_column(col, justify="left" if col in ("setting", "what") else "right")
        for r in decode_rows(args.reps, args.quick):
            table.add_row(r["setting"], r["what"], f"{r['ms']:.2f}", f"{r['gbps']:.1f}",
                          f"{r['gbps'] / read_ceiling:.0%}", f"{r['over_read']:.2f}")
        console.print(table)
    if args.report in ("cascade", "both"):
        shape = "8 decodes sharing a 1k" if args.quick else "32 decodes sharing a 4k"
        table = Table(title=f"cascade step ({shape} prefix, 128 own tokens each) and its parts",
                      title_justify="left")
        for col in ("what", "ms", ""):
            table.add_column(col, justify="left" if col != "ms" else "right")
        for r in cascade_rows(args.reps, args.quick):
            table.add_row(r["what"], f"{r['ms']:.2f}", r["note"])
        console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
