"""Tensor parallelism on this machine: TP=1 (2 threads) against TP=2 (1 thread per rank) on SmolLM2, and the
measured gloo all-reduce cost (loopback), in one run.

    .venv/bin/python benchmarks/tensor_parallel.py [--prompts 8] [--max-tokens 48] [--out PATH]

Throughput is generated tokens per second of one ``generate`` over ``--prompts`` prompts (greedy, ``ignore_eos``),
after one warm-up run of the same workload. TP=1 is measured twice: with the cpu backend's fused decode layers (what
a single process runs) and on the per-op path (what each TP rank runs, since the all-reduces sit between ops). TP=2
is measured twice too: greedy tokens picked across ranks from each rank's best logit (what the engine does for
greedy requests), and with the whole vocabulary's logits gathered to every rank (what sampling requests need).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [576 * 4, 576 * 4 * 8, 576 * 4 * 64, 1 << 20]  # one token's hidden row, 8, 64 rows, 1 MiB (bytes)


def _cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def _all_reduce_rank(rank: int, init: str, repeats: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    times = []
    for n in SIZES:
        t = torch.ones(n // 4)
        for _ in range(10):
            dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(t)
        times.append((time.perf_counter() - start) / repeats)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def measure_loopback(repeats: int = 200) -> list[float]:
    """Mean seconds of a gloo all-reduce of each of :data:`SIZES` between two processes on 127.0.0.1."""
    from tessera.distributed.launch import rendezvous

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    host, port = rendezvous()
    init = f"tcp://{host}:{port}"
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, init, repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    times = queue.get(timeout=120)
    for p in procs:
        p.join(30)
    return times


def _throughput(llm, prompts, params) -> tuple[float, int]:
    llm.generate(prompts, params)  # warm-up: kernels compiled, caches touched
    start = time.perf_counter()
    out = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in out) / seconds, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", default="benchmarks/results/tensor-parallel-2026-12-04.json")
    args = parser.parse_args()
    from tessera.distributed.worker import set_threads
    from tessera.engine import LLM, SamplingParams
    from tessera.hw.links import fit_link
    from tessera.models import load_model
    from tessera.models.paged import forward_step

    model = load_model()  # SmolLM2-135M-Instruct GGUF (Q4_1 projections, Q8_0 table kept packed)
    base = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three laws of robotics",
            "import numpy as np\n", "Water boils at", "A haiku about autumn:", "The best way to learn"]
    prompts = [base[i % len(base)] for i in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    kw = dict(page_size=16, num_pages=256, max_num_seqs=args.prompts)
    result: dict = {"date": datetime.date.today().isoformat(), "cpu": _cpu_model(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__, "prompts": args.prompts,
                    "max_tokens": args.max_tokens, "command": "python benchmarks/tensor_parallel.py"}

    set_threads(2)
    tp1 = LLM(model, **kw)
    result["tp1_fused_tok_s"], _ = _throughput(tp1, prompts, params)
    tp1.runner.forward_step = functools.partial(forward_step, fused=False)
    result["tp1_per_op_tok_s"], _ = _throughput(tp1, prompts, params)
    del tp1

    tp2 = LLM(model, tensor_parallel_size=2, **kw)
    steps = [0]
    inner = tp2.runner.forward_step

    def counted(*a, **k):
        steps[0] += 1
        return inner(*a, **k)

    tp2.runner.forward_step = counted
    comm = tp2.tensor_parallel.comm
    for key, greedy_in_forward in (("tp2", True), ("tp2_gather", False)):
        tp2.runner.greedy_in_forward = greedy_in_forward
        tp2.generate(prompts, params)  # warm-up
        comm.comm_seconds, comm.num_all_reduce, comm.num_all_gather, steps[0] = 0.0, 0, 0, 0
        start = time.perf_counter()
        out = tp2.generate(prompts, params)
        seconds = time.perf_counter() - start
        result[f"{key}_tok_s"] = sum(len(o.token_ids) for o in out) / seconds
        result[f"{key}_steps"] = steps[0]
        result[f"{key}_all_reduce_per_step"] = comm.num_all_reduce / steps[0]
        result[f"{key}_logits_all_gather_per_step"] = comm.num_all_gather / steps[0]
        result[f"{key}_comm_ms_per_step"] = 1e3 * comm.comm_seconds / steps[0]
        result[f"{key}_step_ms"] = 1e3 * seconds / steps[0]
        result[f"{key}_comm_share"] = comm.comm_seconds / seconds
    tp2.shutdown()

    times = measure_loopback()
    link = fit_link("gloo loopback", SIZES, times, 2)
    result["loopback_all_reduce"] = {"bytes": SIZES, "seconds": times, "fit_latency_us": link.latency_s * 1e6,
                                     "fit_bandwidth_GBps": link.bandwidth / 1e9}
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
