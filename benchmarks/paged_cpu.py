"""Paged-KV attention benchmark on the cpu backend: plan once, run one layer, against "gather the pages, then SDPA".

Cases (Hq=32, Hkv=8, D=128, page size 16, pages shuffled through the pool): decode for batches of 1, 8 and 32 with
mixed lengths from 1k to 16k, fp32 and bf16 KV; a mixed batch of prefill chunks and decodes. Reports our median
time, KV GB/s (decode), the fraction of torch.sum streaming the same page pool in the same run, and our time over
the baseline's (< 1: we are faster). Then bf16 against fp32 KV on the batch-8 case, timed interleaved, and the
shared-prefix case: 32 decodes sharing a 4k-token prefix (the same
pages), each with 128 tokens of its own, with and without the cascade.

Usage::

    python benchmarks/paged_cpu.py [--quick] [--reps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import os

# Idle OpenMP threads of torch and Numba spin by default and starve each other on a small shared machine; must be set
# before torch loads its OpenMP runtime (see kernels_cpu.py). Without it, our kernel's time right after a torch.sum or
# SDPA baseline included the other pool's spinning (paged bf16 b=8: 12.6 ms in the table, 8.1 ms timed alone).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
import json
from typing import Any

import torch
from attention_cpu import time_interleaved  # same folder: the interleaved median timer
from rich.console import Console
from rich.table import Table

from tessera.attention import AttentionSpec, causal, plan
from tessera.bench.suites.paged import (
    D,
    HKV,
    HQ,
    PAGE,
    cascade_plans,
    gather_then_sdpa,
    make_batch,
    make_shared_prefix_batch,
)


def run_case(name: str, kv_lens: list[int], q_lens: list[int], dtype: torch.dtype, reps: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    q, k_pages, v_pages, table = make_batch(kv_lens, q_lens, dtype, gen)
    spec = AttentionSpec(HQ, HKV, D, mask=causal())
    p = plan(spec, q_lens, kv_lens, table, PAGE, backend="cpu")
    k32, v32 = k_pages.view(torch.float32), v_pages.view(torch.float32)
    times, _ = time_interleaved({
        "ours": lambda: p.run(q, k_pages, v_pages),
        "baseline": lambda: gather_then_sdpa(q, k_pages, v_pages, table, q_lens, kv_lens),
        "read": lambda: (k32.sum(), v32.sum()),
    }, reps)
    kv_bytes = 2 * sum(kv_lens) * HKV * D * k_pages.element_size()
    return {
        "case": name, "dtype": str(dtype).removeprefix("torch."), "batch": len(kv_lens), "tokens": sum(q_lens),
        "kv_tokens": sum(kv_lens), "ours_s": times["ours"], "baseline_s": times["baseline"],
        "ours_over_baseline": times["ours"] / times["baseline"], "kv_gbps": kv_bytes / times["ours"] / 1e9,
        "fraction_of_same_run_read": times["read"] / times["ours"],
    }


def cases(quick: bool) -> list[tuple[str, list[int], list[int]]]:
    lens = [1024, 16384, 4096, 2048, 8192, 3000, 12000, 6000] if not quick else [1024, 4096, 2048, 3000]
    out = [(f"decode-b{b}", (lens * 4)[:b], [1] * b) for b in ((1, 8, 32) if not quick else (1, 4))]
    mixed_kv = [2048, 512, 4096, 1024, 3000, 700]
    out.append(("mixed-prefill+decode", mixed_kv, [512, 512, 1, 1, 4, 1]))
    return out


def dtype_case(reps: int, quick: bool) -> dict[str, Any]:
    """bf16 KV against fp32 KV on the same batch (batch 8, 1k-16k), the two timed interleaved in one loop: the
    machine's speed drifts between the table's rows, so their ratio across rows is not a measurement."""
    kv_lens = cases(quick)[1][1]
    q_lens = [1] * len(kv_lens)
    spec = AttentionSpec(HQ, HKV, D, mask=causal())
    fns = {}
    for dtype in (torch.float32, torch.bfloat16):
        q, k_pages, v_pages, table = make_batch(kv_lens, q_lens, dtype, torch.Generator().manual_seed(0))
        p = plan(spec, q_lens, kv_lens, table, PAGE, backend="cpu")
        fns[str(dtype).removeprefix("torch.")] = lambda p=p, q=q, k=k_pages, v=v_pages: p.run(q, k, v)
    times, _ = time_interleaved(fns, reps)
    return {"case": f"decode-b{len(kv_lens)}", "float32_s": times["float32"], "bfloat16_s": times["bfloat16"],
            "bf16_speedup": times["float32"] / times["bfloat16"]}


def cascade_case(reps: int, quick: bool) -> dict[str, Any]:
    """32 requests share the pages of a 4k-token prefix and own 128 tokens each; plan with and without the cascade."""
    n, prefix, own = (8, 1024, 128) if quick else (32, 4096, 128)
    q, k_pages, v_pages, table, kv_lens = make_shared_prefix_batch(n, prefix, own, torch.Generator().manual_seed(0))
    spec = AttentionSpec(HQ, HKV, D, mask=causal())
    plans = cascade_plans(spec, [1] * n, kv_lens, table, q, k_pages, v_pages)
    times, outs = time_interleaved({name: (lambda p=plans[on]: p.run(q, k_pages, v_pages))
                                    for name, on in (("cascade", True), ("plain", False))}, reps)
    return {"case": f"cascade-{n}x({prefix}+{own})", "cascade_s": times["cascade"], "plain_s": times["plain"],
            "speedup": times["plain"] / times["cascade"],
            "max_abs_diff": (outs["cascade"] - outs["plain"]).abs().max().item()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small batches")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rows = [run_case(name, kv, q, dt, args.reps) for name, kv, q in cases(args.quick)
            for dt in (torch.float32, torch.bfloat16)]
    table = Table(title="tessera paged attention (cpu) vs gather + SDPA", title_justify="left",
                  caption="GB/s: K/V bytes over our time; % read: of torch.sum streaming the same pages in this run; "
                  "/gather+SDPA: our time over the baseline's.", caption_justify="left")
    for col in ("case", "dtype", "tokens", "kv tokens", "ours ms", "GB/s", "% read", "/gather+SDPA"):
        table.add_column(col, justify="left" if col in ("case", "dtype") else "right")
    for r in rows:
        decode = r["tokens"] <= 8 * r["batch"]  # GB/s means something only when reading K/V is the work
        gbps, read = (f"{r['kv_gbps']:.1f}", f"{r['fraction_of_same_run_read']:.0%}") if decode else ("-", "-")
        table.add_row(r["case"], r["dtype"], str(r["tokens"]), str(r["kv_tokens"]), f"{r['ours_s'] * 1e3:.2f}",
                      gbps, read, f"{r['ours_over_baseline']:.3f}")
    console = Console(width=130)
    console.print(table)
    dt = dtype_case(args.reps, args.quick)
    console.print(f"{dt['case']} bf16 KV vs fp32 KV, interleaved: {dt['bfloat16_s'] * 1e3:.2f} ms vs "
                  f"{dt['float32_s'] * 1e3:.2f} ms, bf16 {dt['bf16_speedup']:.2f}x faster", highlight=False)
    c = cascade_case(args.reps, args.quick)
    console.print(f"{c['case']}: with cascade {c['cascade_s'] * 1e3:.2f} ms, without {c['plain_s'] * 1e3:.2f} ms, "
                  f"speed-up {c['speedup']:.2f}x (max |diff| {c['max_abs_diff']:.1e})", highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "bf16_vs_fp32": dt, "cascade": c}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
