"""CPU attention benchmark: tessera's ``cpu`` backend against torch SDPA and compiled FlexAttention, in one run.

For each case it reports our median time, useful throughput (GFLOP/s over the unmasked score entries only, or GB/s
of KV read for decode), that throughput as a fraction of this machine's measured ceiling (:mod:`tessera.hw`), the
time ratio ours / baseline for SDPA and compiled flex_attention (measured interleaved with ours), flex's compile
time, and our max abs error against SDPA. Exits 1 when any case errors or disagrees with SDPA.

Usage::

    python benchmarks/attention_cpu.py                  # the full set
    python benchmarks/attention_cpu.py --quick          # small shapes, under a minute with flex compiles (make demo)
    python benchmarks/attention_cpu.py --cases causal,decode --no-flex --reps 5 --json out.json
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
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import tessera
from tessera.attention import AttentionSpec, Mask, attention, causal, document, sliding_window
from tessera.hw import Ceilings, get_ceilings
from tessera.hw.ceilings import BUSY

#: Largest acceptable max|ours - SDPA| per dtype; bf16 outputs differ by a few bf16 ulps at |out| ~ 1.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}
DTYPE_TAGS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


@dataclass(frozen=True, slots=True, eq=False)
class Case:
    """One shape: q ``[batch, q_len, num_q_heads, head_dim]``, k/v ``[batch, kv_len, num_kv_heads, head_dim]``."""

    name: str
    batch: int
    q_len: int
    kv_len: int
    dtype: torch.dtype
    mask: Mask
    decode: bool = False  # memory-bound: report KV GB/s against the read ceiling instead of GFLOP/s
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128

    @property
    def spec(self) -> AttentionSpec:
        return AttentionSpec(self.num_q_heads, self.num_kv_heads, self.head_dim, mask=self.mask)


def make_cases(quick: bool) -> list[Case]:
    """The full case list, or (``quick``) the same families at shapes that finish in seconds."""
    if quick:
        prefill, window, window_len, doc_len, decode_len = (512,), 256, 1024, 1024, 1024
    else:
        prefill, window, window_len, doc_len, decode_len = (1024, 4096), 1024, 8192, 4096, 4096
    f32, bf16 = torch.float32, torch.bfloat16
    cases = [Case(f"causal-{DTYPE_TAGS[dt]}-{_k(s)}", 1, s, s, dt, causal()) for dt in (f32, bf16) for s in prefill]
    cases.append(Case(f"window{window}-fp32-{_k(window_len)}", 1, window_len, window_len, f32, sliding_window(window)))
    doc_ids = torch.arange(doc_len, dtype=torch.int64) * 8 // doc_len  # 8 equal documents
    cases.append(Case(f"doc8-fp32-{_k(doc_len)}", 1, doc_len, doc_len, f32, document(doc_ids) & causal()))
    for dt in (f32, bf16):
        cases.append(Case(f"decode-{DTYPE_TAGS[dt]}-b8-{_k(decode_len)}", 8, 1, decode_len, dt, causal(), decode=True))
    return cases


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def select_cases(cases: list[Case], names: str | None) -> list[Case]:
    """Cases whose name starts with one of the comma-separated ``names`` (all when None)."""
    if not names:
        return cases
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [w for w in wanted if not any(c.name.startswith(w) for c in cases)]
    if unknown:
        raise SystemExit(f"--cases: no case name starts with {unknown}; the cases are {[c.name for c in cases]}")
    return [c for c in cases if any(c.name.startswith(w) for w in wanted)]


def keep_mask(case: Case) -> torch.Tensor:
    """The mask as bool ``[B or 1, Hq or 1, Sq, Skv]``, True where a query attends a kv position.

    Size-1 batch/head dims broadcast; queries sit at the last ``q_len`` kv positions, as in :func:`attention`.
    """
    b = torch.arange(case.batch).view(-1, 1, 1, 1)
    h = torch.arange(case.num_q_heads).view(1, -1, 1, 1) if case.mask.head_dependent else torch.zeros(1, 1, 1, 1).long()
    q_pos = torch.arange(case.kv_len - case.q_len, case.kv_len).view(1, 1, -1, 1)
    kv_pos = torch.arange(case.kv_len).view(1, 1, 1, -1)
    keep = case.mask.evaluate(b, h, q_pos, kv_pos)
    return keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))


def kept_scores(case: Case, keep: torch.Tensor) -> int:
    """Unmasked score entries over all (batch, q head, query, kv), counted exactly from the materialized mask."""
    return int(keep.sum()) * (case.batch // keep.shape[0]) * (case.num_q_heads // keep.shape[1])


def useful_flops(case: Case, kept: int) -> float:
    """2·D for q·k plus 2·D for p·v per kept score (= 4·D·Hq·kept_pairs); masked entries count nothing."""
    return 4.0 * case.head_dim * kept


def kv_bytes(case: Case) -> int:
    """Bytes of K and V a decode step must read once."""
    return 2 * case.batch * case.kv_len * case.num_kv_heads * case.head_dim * case.dtype.itemsize


def time_interleaved(fns: dict[str, Callable[[], Any]], reps: int) -> tuple[dict[str, float], dict[str, Any]]:
    """Median seconds per call of each function, and each function's warm-up output (for correctness checks).

    The functions run round-robin, so slow drift (clock frequency, neighbours on a shared machine) affects all of
    them alike and the ratios stay meaningful even when the absolute times move.
    """
    outputs = {name: fn() for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in samples.items()}, outputs


def sdpa_call(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> Callable[[], Any]:
    """SDPA on ``[B, H, S, D]`` inputs: ``is_causal`` when the mask is exactly square causal, else the bool mask."""
    causal_square = torch.ones(case.q_len, case.kv_len, dtype=torch.bool).tril()
    if case.q_len == case.kv_len and torch.equal(keep, causal_square.expand_as(keep)):
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)


def flex_call(
    case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor
) -> tuple[Callable[[], Any], float]:
    """Compiled flex_attention with its block mask built here (untimed); returns the call and its compile seconds."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    offset, mask = case.kv_len - case.q_len, case.mask

    def mask_mod(b, h, q_idx, kv_idx):
        return mask.evaluate(b, h, q_idx + offset, kv_idx)  # flex numbers queries from 0, ours sit at the end

    # A fresh compile per case: compile times stay comparable and dynamo's recompile limit never falls back to eager.
    torch.compiler.reset()
    batch = case.batch if keep.shape[0] > 1 else None
    heads = case.num_q_heads if keep.shape[1] > 1 else None
    block_mask = create_block_mask(mask_mod, batch, heads, case.q_len, case.kv_len, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)

    def call() -> Any:
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=True)

    start = time.perf_counter()
    call()  # the first call compiles
    return call, time.perf_counter() - start


def run_case(case: Case, reps: int, use_flex: bool, ceilings: Ceilings) -> dict[str, Any]:
    """Benchmark one case against its baselines; returns one JSON-ready result row."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(case.batch, case.q_len, case.num_q_heads, case.head_dim, generator=gen).to(case.dtype)
    kv_shape = (case.batch, case.kv_len, case.num_kv_heads, case.head_dim)
    k, v = (torch.randn(kv_shape, generator=gen).to(case.dtype) for _ in range(2))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # baselines take [B, H, S, D]; copied untimed
    keep, spec = keep_mask(case), case.spec
    fns = {"ours": lambda: attention(q, k, v, spec, backend="cpu"), "sdpa": sdpa_call(case, qt, kt, vt, keep)}
    row: dict[str, Any] = {
        "case": case.name, "dtype": DTYPE_TAGS[case.dtype], "batch": case.batch, "q_len": case.q_len,
        "kv_len": case.kv_len, "num_q_heads": case.num_q_heads, "num_kv_heads": case.num_kv_heads,
        "head_dim": case.head_dim, "mask": repr(case.mask), "flex_compile_s": None, "flex_error": None,
    }
    if case.decode:
        # The machine's read bandwidth drifts (49-81 GB/s between idle runs here), so the decode rate is also compared
        # with streaming the same K/V bytes (viewed as float32) through torch.sum, interleaved with ours.
        k32, v32 = k.view(torch.float32), v.view(torch.float32)
        fns["read"] = lambda: (k32.sum(), v32.sum())
    if use_flex:
        try:
            fns["flex"], row["flex_compile_s"] = flex_call(case, qt, kt, vt, keep)
        except Exception as err:  # a baseline failing must not stop the benchmark
            row["flex_error"] = _brief(err)
    times, outputs = time_interleaved(fns, reps)
    expected = outputs["sdpa"].transpose(1, 2).float()
    row["max_err_vs_sdpa"] = (outputs["ours"].float() - expected).abs().max().item()
    row["ok"] = row["max_err_vs_sdpa"] <= TOLERANCE[case.dtype]
    if "flex" in outputs:
        row["flex_max_err_vs_sdpa"] = (outputs["flex"].transpose(1, 2).float() - expected).abs().max().item()
    row.update({f"{name}_s": t for name, t in times.items()})
    row.update({f"ours_over_{name}": times["ours"] / t for name, t in times.items() if name not in ("ours", "read")})
    row.update(_throughput(case, keep, times["ours"], ceilings))
    if "read" in times:
        row["same_run_read_gbps"] = kv_bytes(case) / times["read"] / 1e9
        row["fraction_of_same_run_read"] = times["read"] / times["ours"]
    return row


def _throughput(case: Case, keep: torch.Tensor, seconds: float, ceilings: Ceilings) -> dict[str, Any]:
    kept = kept_scores(case, keep)
    out = {"kept_scores": kept, "density": kept / (case.batch * case.num_q_heads * case.q_len * case.kv_len)}
    if case.decode:
        gbps = kv_bytes(case) / seconds / 1e9
        return out | {"metric": "GB/s", "value": gbps, "fraction_of_ceiling": gbps / ceilings.read_gbps}
    gflops = useful_flops(case, kept) / seconds / 1e9
    return out | {"metric": "GFLOP/s", "value": gflops, "fraction_of_ceiling": gflops / ceilings.gemm_fp32_gflops}


def _brief(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"


def render(rows: list[dict[str, Any]], ceilings: Ceilings, console: Console) -> None:
    """Print the ceilings, one results table, then any case or flex errors."""
    c = ceilings
    busy = " [yellow](measured on a busy machine: run `tessera info --refresh` when idle)[/]" * (c.others_busy > BUSY)
    console.print(f"ceilings: fp32 GEMM {c.gemm_fp32_gflops:.1f} GFLOP/s, read {c.read_gbps:.1f} GB/s "
                  f"({c.read_method}); {c.cpu_model}, {c.torch_threads} threads{busy}", highlight=False)
    heads = sorted({f"{r['num_q_heads']}/{r['num_kv_heads']}x{r['head_dim']}" for r in rows if "error" not in r})
    table = Table(
        title="tessera cpu attention vs torch SDPA and compiled flex_attention", title_justify="left",
        caption=f"heads q/kv x D: {', '.join(heads)}. rate: useful GFLOP/s (kept scores only), decode: KV GB/s. "
        "% ceil: of the fp32 GEMM ceiling (bf16 too), decode: of the cached read bandwidth (in brackets: of torch.sum "
        "streaming the same K/V bytes in this run, GB/s). /SDPA, /flex: our median time "
        "over theirs (< 1: we are faster); flex compile time excluded.", caption_justify="left",
    )
    for col in ("case", "BxSqxSkv", "kept", "ours ms", "rate", "% ceil", "/SDPA", "/flex", "flex compile s",
                "max|err| vs SDPA"):
        table.add_column(col, justify="left" if col == "case" else "right", no_wrap=col in ("case", "rate"))
    for r in rows:
        if "error" in r:
            table.add_row(r["case"], "", "", "[red]error[/]", *[""] * 6)
            continue
        flex = f"{r['ours_over_flex']:.2f}" if "ours_over_flex" in r else ("failed" if r["flex_error"] else "-")
        compile_s = f"{r['flex_compile_s']:.1f}" if r["flex_compile_s"] is not None else "-"
        err = f"{r['max_err_vs_sdpa']:.1e}" if r["ok"] else f"[red]{r['max_err_vs_sdpa']:.1e} (too large)[/]"
        shape, rate = f"{r['batch']}x{r['q_len']}x{r['kv_len']}", f"{r['value']:.1f} {r['metric']}"
        ceil = f"{r['fraction_of_ceiling']:.1%}"
        if "fraction_of_same_run_read" in r:
            ceil += f" ({r['fraction_of_same_run_read']:.0%} of {r['same_run_read_gbps']:.0f})"
        table.add_row(r["case"], shape, f"{r['density']:.0%}", f"{r['ours_s'] * 1e3:.4g}", rate,
                      ceil, f"{r['ours_over_sdpa']:.2f}", flex, compile_s, err)
    console.print(table)
    for r in rows:
        if "error" in r:
            console.print(f"[red]{r['case']} failed:[/] {r['error']}", highlight=False)
        elif r["flex_error"]:
            console.print(f"[yellow]flex failed on {r['case']}:[/] {r['flex_error']}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (under a minute including flex compiles)")
    parser.add_argument("--cases", help="comma-separated case names or name prefixes, e.g. causal,decode-fp32")
    parser.add_argument("--no-flex", action="store_true", help="skip the compiled flex_attention baseline")
    parser.add_argument("--reps", type=int, help="timed calls per implementation (default 3 with --quick, else 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    reps = args.reps if args.reps is not None else (3 if args.quick else 5)
    if reps < 1:
        parser.error(f"--reps must be >= 1, got {reps}")
    cases = select_cases(make_cases(args.quick), args.cases)
    console, status = Console(), Console(stderr=True)
    if not console.is_terminal:
        console = Console(width=150)  # logs and pipes have no width limit; don't squeeze the table into 80 columns
    with status.status("reading (or measuring, a few seconds) this machine's ceilings..."):
        ceilings = get_ceilings()
    rows = []
    for case in cases:
        with status.status(f"running {case.name} ..."):
            try:
                rows.append(run_case(case, reps, not args.no_flex, ceilings))
            except Exception as err:  # report and go on: one broken case should not hide the others
                rows.append({"case": case.name, "error": _brief(err), "traceback": traceback.format_exc()})
    render(rows, ceilings, console)
    if args.json:
        result = {"tessera": tessera.__version__, "torch": torch.__version__, "quick": args.quick, "reps": reps,
                  "ceilings": ceilings.to_dict(), "rows": rows}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
