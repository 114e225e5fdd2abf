"""A worker rank: join the group, build its shard of the model and of the paged KV cache, then run every step
rank 0 broadcasts until told to stop."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tessera.distributed.comm import Communicator
from tessera.distributed.layers import bind
from tessera.distributed.sharding import RankShard
from tessera.models.config import ModelConfig
from tessera.models.model import Model
from tessera.models.paged import StepBatch, forward_step, new_cache


#: store key prefix a worker sets (``.../<rank>``) once it reaches rank 0's store, so that rank 0 can tell a worker
#: that is still starting from one that died on the way
JOINED_KEY = "tessera/tp/joined"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs besides its weights (picklable; sent once at spawn)."""

    rank: int
    world: int
    host: str
    port: int
    config: ModelConfig  # the rank's local config
    shard: RankShard
    vocab_ranges: list[tuple[int, int]]
    backend: str
    num_pages: int
    page_size: int
    kv_cache_dtype: str | None
    threads: int
    compute_timeout_s: float
    idle_timeout_s: float


def set_threads(threads: int) -> None:
    """Intra-op threads of this process: torch's, and Numba's where the kernels use it."""
    torch.set_num_threads(threads)
    try:
        import numba
    except ImportError:  # no Numba kernels in this install: torch's setting is all there is
        return
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies, so that no rank outlives the engine (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent already died between fork and prctl
        os._exit(1)


def step_message(batch: StepBatch, copies: list, all_logits: bool, logit_rows: list[int] | None,
                 greedy: bool = False) -> dict:
    """What rank 0 broadcasts per step: the page copies first, then the batch (host tensors), and what the step
    returns (``greedy``: tokens picked across ranks, else logits; every rank must run the same collectives)."""
    return {"op": "step", "copies": copies, "token_ids": batch.token_ids.cpu(), "q_lens": batch.q_lens,
            "kv_lens": batch.kv_lens, "page_table": batch.page_table, "slots": batch.slots.cpu(),
            "all_logits": all_logits, "logit_rows": logit_rows, "greedy": greedy}


def run_step(model: Model, cache, msg: dict) -> torch.Tensor:
    """Apply a step message to this rank's shard: page copies, then the forward (logits, or greedy tokens, on every
    rank)."""
    cache.copy_pages(msg["copies"])
    device = cache.device
    batch = StepBatch(msg["token_ids"].to(device), msg["q_lens"], msg["kv_lens"], msg["page_table"],
                      msg["slots"].to(device))
    # the backend's fused whole-layer decode has no place for the all-reduces, so shards run the per-op path
    return forward_step(model, cache, batch, all_logits=msg["all_logits"], logit_rows=msg["logit_rows"], fused=False,
                        greedy=msg["greedy"])


def worker_main(spec: WorkerSpec, weights: dict) -> None:
    """The body of a spawned worker rank (the target of its process)."""
    die_with_parent()
    set_threads(spec.threads)
    serve_steps(spec, weights, f"pid {os.getpid()}")


def serve_steps(spec: WorkerSpec, weights: dict, label: str) -> None:
    """Join rank 0's store and the group, build this rank's model and KV cache from ``weights`` (its plain shard),
    then run every step rank 0 sends until it sends stop; leaves the group on the way out.

    ``label`` (how rank 0 names this process in its errors, e.g. ``"pid 1234 on node-b"``) is the value of this
    rank's joined key.
    """
    timeout = timedelta(seconds=spec.compute_timeout_s)
    store = dist.TCPStore(spec.host, spec.port, spec.world, is_master=False, timeout=timeout)
    store.set(f"{JOINED_KEY}/{spec.rank}", label.encode())
    dist.init_process_group("gloo", store=store, rank=spec.rank, world_size=spec.world, timeout=timeout)
    try:
        comm = Communicator(spec.rank, spec.world, store, spec.idle_timeout_s)
        model = Model(spec.config, bind(weights, spec.shard, spec.vocab_ranges, comm), backend=spec.backend)
        cache = new_cache(model, spec.num_pages, spec.page_size, spec.kv_cache_dtype)
        with torch.no_grad():
            while True:
                msg = comm.next_message()
                if msg["op"] == "stop":
                    break
                run_step(model, cache, msg)
    finally:
        dist.destroy_process_group()
