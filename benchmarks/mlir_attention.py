"""The ``mlir`` backend against the ``cpu`` backend on the same inputs, interleaved in one run.

For each case: the median time of each backend (A B A B ...), the ratio mlir / cpu, useful GFLOP/s (unmasked score
entries only), the max abs difference between the two, and the compile time of the case's module, measured
separately in a fresh cache directory (so it is the cold cost a new machine pays once; later runs load the binary).

With ``--tune``, first measure the kernel's tunables (``mlir_attention_rows``, ``mlir_attention_kv_tile``,
``mlir_tokens_max_q``; :mod:`tessera.backends.mlir.tunables`) with ``tessera tune``'s search and store the winners
in this machine's tuning cache (``$TESSERA_CACHE_DIR/tuning``), then run the cases with them. ``--cases ''`` tunes
only. ``tessera tune --only mlir_attention_rows ...`` runs the same searches.

Usage::

    python benchmarks/mlir_attention.py                       # every case
    python benchmarks/mlir_attention.py --cases causal --reps 9 --json benchmarks/results/mlir-attention.json
    python benchmarks/mlir_attention.py --tune --quick --cases causal,decode
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP pools spin and starve the other side otherwise
import json
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from tessera.attention import AttentionSpec, Mask, attention, causal, sliding_window
from tessera.hw.probes import cpu_model


@dataclass(frozen=True, eq=False)
class Case:
    name: str
    batch: int
    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    mask: Mask | None
    dtype: torch.dtype = torch.float32

    def flops(self) -> float:
        """4 * D FLOPs per unmasked (query, key) pair and head."""
        q_pos = torch.arange(self.kv_len - self.q_len, self.kv_len).view(-1, 1)
        kv_pos = torch.arange(self.kv_len).view(1, -1)
        kept = self.mask.evaluate(torch.tensor(0), torch.tensor(0), q_pos, kv_pos).sum() if self.mask is not None \
            else self.q_len * self.kv_len
        return 4.0 * self.head_dim * self.num_q_heads * self.batch * float(kept)


CASES = [
    Case("causal", 1, 1024, 1024, 32, 8, 128, causal()),
    Case("causal-bf16", 1, 1024, 1024, 32, 8, 128, causal(), torch.bfloat16),
    Case("window", 1, 2048, 2048, 32, 8, 128, sliding_window(512)),
    Case("smollm2-prefill", 1, 512, 512, 9, 3, 64, causal()),
    Case("decode", 8, 1, 2048, 32, 8, 128, causal()),
]


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def run_case(case: Case, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    shape_q = (case.batch, case.q_len, case.num_q_heads, case.head_dim)
    shape_kv = (case.batch, case.kv_len, case.num_kv_heads, case.head_dim)
    q, k, v = (torch.randn(*s, generator=gen).to(case.dtype) for s in (shape_q, shape_kv, shape_kv))
    spec = AttentionSpec(case.num_q_heads, case.num_kv_heads, case.head_dim, mask=case.mask)

    from tessera.mlir import iree_compile

    before = iree_compile.STATS.seconds
    with tempfile.TemporaryDirectory() as cold:  # the compile a new machine pays, outside the timed loop
        saved = os.environ.get("TESSERA_CACHE_DIR")
        os.environ["TESSERA_CACHE_DIR"] = cold
        iree_compile._BINARIES.clear()
        start = time.perf_counter()
        ours = attention(q, k, v, spec, backend="mlir")
        first_call = time.perf_counter() - start
        if saved is None:
            del os.environ["TESSERA_CACHE_DIR"]
        else:
            os.environ["TESSERA_CACHE_DIR"] = saved
    compile_s = iree_compile.STATS.seconds - before
    theirs = attention(q, k, v, spec, backend="cpu")
    diff = float((ours.float() - theirs.float()).abs().max())
    mlir_t, cpu_t = [], []
    for _ in range(reps):  # interleaved, so both sides see the same machine state
        mlir_t += _time(lambda: attention(q, k, v, spec, backend="mlir"), 1)
        cpu_t += _time(lambda: attention(q, k, v, spec, backend="cpu"), 1)
    m, c = statistics.median(mlir_t), statistics.median(cpu_t)
    return {"case": case.name, "dtype": str(case.dtype).removeprefix("torch."),
            "shape": f"b{case.batch} q{case.q_len} kv{case.kv_len} h{case.num_q_heads}/{case.num_kv_heads} "
                     f"d{case.head_dim}",
            "mask": repr(case.mask), "mlir_ms": m * 1e3, "cpu_ms": c * 1e3, "ratio_mlir_over_cpu": m / c,
            "mlir_gflops": case.flops() / m / 1e9, "cpu_gflops": case.flops() / c / 1e9,
            "compile_s": compile_s, "first_call_s": first_call, "max_abs_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", default="")
    parser.add_argument("--tune", action="store_true", help="measure the mlir tunables first and store the winners")
    parser.add_argument("--quick", action="store_true", help="with --tune: smaller shapes, fewer rounds")
    args = parser.parse_args()
    wanted = [name for name in args.cases.split(",") if name]
    unknown = set(wanted) - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; choose from {[c.name for c in CASES]}")
    tuned_rows = tune(args.quick) if args.tune else []
    rows = [run_case(c, args.reps) for c in CASES if c.name in wanted]
    cpu = cpu_model()
    table = Table(title=f"mlir vs cpu attention on {cpu} ({os.cpu_count()} cpus), {time.strftime('%Y-%m-%d')}")
    for col in ("case", "dtype", "shape", "mlir ms", "cpu ms", "mlir/cpu", "mlir GFLOP/s", "compile s", "max|diff|"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["case"], r["dtype"], r["shape"], f"{r['mlir_ms']:.2f}", f"{r['cpu_ms']:.2f}",
                      f"{r['ratio_mlir_over_cpu']:.2f}x", f"{r['mlir_gflops']:.1f}", f"{r['compile_s']:.2f}",
                      f"{r['max_abs_diff']:.1e}")
    if rows:
        Console(width=200).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "rows": rows,
                       "tuning": tuned_rows}, f, indent=2)


#: the tunables ``--tune`` measures, in order (the layout crossover is timed with the tiling already chosen)
TUNABLES = ("mlir_attention_rows", "mlir_attention_kv_tile", "mlir_tokens_max_q")


def tune(quick: bool) -> list[dict]:
    """Search :data:`TUNABLES` as ``tessera tune`` does, store the winners in this machine's tuning cache, print
    and return them."""
    from tessera.tuning import search

    outcomes = search.tune(search.plan(TUNABLES), quick=quick)
    table = Table(title=f"mlir tunables on {cpu_model()} ({'quick' if quick else 'full'} search)")
    for col in ("tunable", "default", "chosen", "speed-up", "candidates (median ms)", "reason"):
        table.add_column(col)
    for o in outcomes:
        unit = 1e3 if o.grid is None else 1.0  # a crossover's candidates are modelled costs, not seconds
        cands = ", ".join(f"{c['value']}: {c['seconds'] * unit:.3g}" for c in o.candidates)
        table.add_row(o.name, str(o.default), str(o.chosen), f"{o.speedup:.2f}x", cands, o.reason)
    Console(width=200).print(table)
    return [o.to_entry() | {"name": o.name} for o in outcomes]


if __name__ == "__main__":
    main()
