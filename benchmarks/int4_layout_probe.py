"""The batch-1 int4 GEMV from DRAM: the product kernel's layout against a row-interleaved one.

The int8-activation int4 kernel (``ops/_qdot_kernels.py``) reads its weight one row at a time from three arrays
(nibbles ``[N, K/2]``, float32 scales ``[N, K/g]``, uint8 zero points): three sequential address streams. (It used to
read four rows at a time, sharing each activation load: twelve streams, which the hardware prefetchers served at half
the rate; see docs/performance.md.) This probe runs the same arithmetic over a layout where each group of four rows
is stored block by block (block ``b``: the four rows' 16 bytes of nibbles; scales and ``-zero * scale`` offsets
interleaved the same way in arrays of their own): also three streams, and each activation load serves four rows. It
is a probe, not a product kernel: group 32 only, M = 1, rows a multiple of four. Its result is checked against the
product kernel's before timing.

Rows of one run only: the machine is shared and its memory rate drifts. Usage::

    python benchmarks/int4_layout_probe.py [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see kernels_cpu.py: idle pools must not spin here
import statistics
import time

import numba
import numpy as np
import torch
from numba import njit, prange
from rich.console import Console
from rich.table import Table

from tessera.backends.cpu.numba_math import FASTMATH
from tessera.backends.cpu.ops import _qdot_kernels as qk
from tessera.backends.cpu.ops._int8_simd import (
    AVX2, dot_u8s8, fma_i32, load_f32, load_i8x32, nibbles16, sum_f32x8, zero_f32x8)
from tessera.bench.harness import copies_for
from tessera.bench.machine import fingerprint

N = K = 4096
GROUP = 32
BLOCK_ROWS = 16  # row groups of four per parallel work item


@njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _group4(isa, xq, xd, gsum, packed4, scales4, offs4, out, g4):  # pragma: no cover - compiled
    """Rows ``4 g4 .. 4 g4 + 3`` from the interleaved layout (group 32)."""
    nb = xd.shape[1]
    a0 = zero_f32x8()
    a1 = zero_f32x8()
    a2 = zero_f32x8()
    a3 = zero_f32x8()
    o0 = o1 = o2 = o3 = np.float32(0.0)
    r = g4 * packed4.shape[1]
    so = g4 * scales4.shape[1]
    for b in range(nb):
        s = load_i8x32(xq, b * 32)
        d = load_f32(xd, b)
        g = gsum[b]
        a0 = fma_i32(dot_u8s8(isa, nibbles16(packed4, r + b * 64), s), load_f32(scales4, so + 4 * b) * d, a0)
        a1 = fma_i32(dot_u8s8(isa, nibbles16(packed4, r + b * 64 + 16), s), load_f32(scales4, so + 4 * b + 1) * d, a1)
        a2 = fma_i32(dot_u8s8(isa, nibbles16(packed4, r + b * 64 + 32), s), load_f32(scales4, so + 4 * b + 2) * d, a2)
        a3 = fma_i32(dot_u8s8(isa, nibbles16(packed4, r + b * 64 + 48), s), load_f32(scales4, so + 4 * b + 3) * d, a3)
        o0 += load_f32(offs4, so + 4 * b) * g
        o1 += load_f32(offs4, so + 4 * b + 1) * g
        o2 += load_f32(offs4, so + 4 * b + 2) * g
        o3 += load_f32(offs4, so + 4 * b + 3) * g
    n = 4 * g4
    out[0, n] = sum_f32x8(a0) + o0
    out[0, n + 1] = sum_f32x8(a1) + o1
    out[0, n + 2] = sum_f32x8(a2) + o2
    out[0, n + 3] = sum_f32x8(a3) + o3


@njit(nogil=True, fastmath=FASTMATH, error_model="numpy")
def interleaved_serial(isa, xq, xd, xs, packed4, scales4, offs4, out):  # pragma: no cover - compiled
    gsum = xs[0]
    for g4 in range(packed4.shape[0]):
        _group4(isa, xq, xd, gsum, packed4, scales4, offs4, out, g4)


@njit(parallel=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
def interleaved_parallel(isa, xq, xd, xs, packed4, scales4, offs4, out):  # pragma: no cover - compiled
    gsum = xs[0]
    groups = packed4.shape[0]
    for blk in prange((groups + BLOCK_ROWS - 1) // BLOCK_ROWS):
        for g4 in range(blk * BLOCK_ROWS, min(groups, (blk + 1) * BLOCK_ROWS)):
            _group4(isa, xq, xd, gsum, packed4, scales4, offs4, out, g4)


def _weights(rng: np.random.Generator) -> dict:
    """One random int4 g32 weight in both layouts (the product's and the interleaved one)."""
    packed = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
    scales = (rng.random((N, K // GROUP), dtype=np.float32) * 0.01 + 0.001).astype(np.float32)
    zeros = rng.integers(0, 16, (N, K // GROUP), dtype=np.uint8)
    offs = -zeros.astype(np.float32) * scales

    def four(a, inner):  # [N, nb * inner] -> [N/4, nb, 4, inner] -> [N/4, nb * 4 * inner]
        nb = a.shape[1] // inner
        return np.ascontiguousarray(a.reshape(N // 4, 4, nb, inner).transpose(0, 2, 1, 3)).reshape(N // 4, -1)

    return dict(packed=packed, scales=scales, zeros=zeros, packed4=four(packed, 16), scales4=four(scales, 1),
                offs4=four(offs, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rng = np.random.default_rng(20261202)
    first = _weights(rng)
    product_bytes = first["packed"].nbytes + first["scales"].nbytes + first["zeros"].nbytes
    probe_bytes = first["packed4"].nbytes + first["scales4"].nbytes + first["offs4"].nbytes
    ws = [first] + [_weights(rng) for _ in range(copies_for(product_bytes, most=32) - 1)]
    x = rng.standard_normal((1, K)).astype(np.float32)
    xq, xd, xs = qk.quantize_activations(x)
    gs = np.ascontiguousarray(xs)  # block sums are the group sums at group 32
    out = np.empty((1, N), np.float32)
    want = np.empty((1, N), np.float32)
    qk.gemv_int4_serial(AVX2, xq, xd, xs, first["packed"], first["scales"], first["zeros"], False, GROUP, want)
    for fn in (interleaved_serial, interleaved_parallel):
        out.fill(np.nan)
        fn(AVX2, xq, xd, gs, first["packed4"], first["scales4"], first["offs4"], out)
        err = float(np.abs(out - want).max() / np.abs(want).max())
        if not err < 1e-5:
            raise SystemExit(f"{fn.__name__} differs from the product kernel: relative error {err:.3g}")
    tw = [torch.randn(N, K) for _ in range(copies_for(N * K * 4, most=8))]
    tx = torch.randn(K)
    threads = numba.get_num_threads()
    cases = {
        (1, "product (3 arrays, one row at a time)"): lambda w: qk.gemv_int4_serial(
            AVX2, xq, xd, xs, w["packed"], w["scales"], w["zeros"], False, GROUP, out),
        (1, "interleaved by 4 rows (probe)"): lambda w: interleaved_serial(
            AVX2, xq, xd, gs, w["packed4"], w["scales4"], w["offs4"], out),
        (threads, "product (3 arrays, one row at a time)"): lambda w: qk.gemv_int4(
            AVX2, xq, xd, xs, w["packed"], w["scales"], w["zeros"], False, GROUP, out),
        (threads, "interleaved by 4 rows (probe)"): lambda w: interleaved_parallel(
            AVX2, xq, xd, gs, w["packed4"], w["scales4"], w["offs4"], out),
    }
    times: dict = {key: [] for key in cases}
    torch_times: dict = {1: [], threads: []}
    for _ in range(args.rounds):
        for (n_threads, name), fn in cases.items():
            numba.set_num_threads(n_threads)
            fn(ws[0])
            t0 = time.perf_counter()
            for w in ws:
                fn(w)
            times[(n_threads, name)].append((time.perf_counter() - t0) / len(ws))
        for n_threads in torch_times:
            torch.set_num_threads(n_threads)
            t0 = time.perf_counter()
            for w in tw:
                torch.mv(w, tx)
            torch_times[n_threads].append((time.perf_counter() - t0) / len(tw))
    numba.set_num_threads(threads)
    machine = fingerprint()
    table = Table(title=f"int4 g32 GEMV, M=1, {N}x{K}, weights streamed ({len(ws)} copies), "
                        f"median of {args.rounds} rounds")
    for col in ("threads", "kernel", "ms", "GB/s", "vs torch fp32"):
        table.add_column(col, justify="right" if col != "kernel" else "left")
    rows = []
    for (n_threads, name), ts in times.items():
        t = statistics.median(ts)
        base = statistics.median(torch_times[n_threads])
        nbytes = probe_bytes if "probe" in name else product_bytes
        rows.append(dict(threads=n_threads, kernel=name, ms=t * 1e3, gbps=nbytes / t / 1e9, torch_fp32_ms=base * 1e3))
        table.add_row(str(n_threads), name, f"{t * 1e3:.3f}", f"{nbytes / t / 1e9:.1f}", f"{base / t:.2f}x faster")
    for n_threads, ts in torch_times.items():
        t = statistics.median(ts)
        table.add_row(str(n_threads), "torch fp32 mv", f"{t * 1e3:.3f}", f"{N * K * 4 / t / 1e9:.1f}", "1.00x")
    console = Console()
    console.print(table)
    console.print(f"{machine['cpu_model']}, {machine['num_cores']} cores; bytes per call: product {product_bytes / 1e6:.1f} MB "
                  f"(uint8 zero points), probe {probe_bytes / 1e6:.1f} MB (float32 offsets)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine, date=time.strftime("%Y-%m-%d"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
