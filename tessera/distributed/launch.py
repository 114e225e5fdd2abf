"""Rank 0's side of tensor parallelism: spawn the worker ranks on this machine (or, under torchrun, meet the ranks
torchrun started; :mod:`tessera.distributed.torchrun`), shard the model, run each step everywhere, and fail fast and
clean when a rank dies or hangs.

The engine process is rank 0: it keeps the scheduler and the block manager, holds shard 0 of the weights and of
the paged KV cache, and before each forward broadcasts the step (page copies, token ids, slots, page table) to the
workers, which run the same forward on their shards. Logits come out whole on every rank (vocabulary all-gather);
only rank 0 samples.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tessera.distributed import torchrun
from tessera.distributed.comm import Communicator, TensorParallelError
from tessera.distributed.layers import bind
from tessera.distributed.rank_local import ShardedLoad
from tessera.distributed.sharding import local_config, mlp_unit, plan_shards, shard_weights
from tessera.distributed.worker import JOINED_KEY, WorkerSpec, run_step, set_threads, step_message, worker_main
from tessera.kv import PagedKVCache
from tessera.models.model import Model
from tessera.models.paged import StepBatch, new_cache

#: seconds a step's collective waits for a slow or stuck peer (TESSERA_TP_TIMEOUT overrides); generous because a
#: rank's first step may compile kernels
DEFAULT_TIMEOUT_S = 120.0
#: seconds a worker waits for the next step (an idle engine) before giving up on rank 0
IDLE_TIMEOUT_S = 7 * 24 * 3600.0
#: environment a worker starts with: its BLAS / OpenMP pools sized before they are created
_POOL_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def rendezvous() -> tuple[str, int]:
    """Host and port of rank 0's store: ``MASTER_ADDR`` / ``MASTER_PORT`` when set, else the loopback interface and a
    port that was free a moment ago."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT")
    if port is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
    return addr, int(port)


class BroadcastCache:
    """Rank 0's KV cache handle: its own shard, with page copies (copy-on-write) queued for the workers, which
    apply them with the next step. Every other attribute is the shard's."""

    def __init__(self, local: PagedKVCache) -> None:
        self.local = local
        self.pending: list = []

    def copy_pages(self, copies: list) -> None:
        self.local.copy_pages(copies)
        self.pending.extend(copies)

    def take_copies(self) -> list:
        copies, self.pending = self.pending, []
        return copies

    def __getattr__(self, name: str):
        return getattr(self.local, name)


class _Ranks:
    """The worker processes and the group; what shutdown needs (kept apart from the engine for weakref.finalize).

    Spawned workers are in ``procs``; workers started by torchrun are not this process's children and are known
    only by ``peers`` (rank -> "pid ... on host", from their joined keys).
    """

    def __init__(self) -> None:
        self.procs: list = []
        self.peers: dict[int, str] = {}
        self.launched = False  # the workers were started by torchrun, not spawned here
        self.bootstrap: dist.Store | None = None  # torchrun's store, kept until the workers have read the plan
        self.failed = False
        self.comm: Communicator | None = None
        self.group_up = False
        self.threads_before: int | None = None

    def finalize(self) -> None:
        """What garbage collection or interpreter exit does. Spawned workers are killed (they die with this process
        anyway); launched ones can only be told to stop, and a stop message lets them exit with status 0, so that
        torchrun reports success for a script that never called ``shutdown()``."""
        self.stop(graceful=self.launched and not self.failed)

    def stop(self, graceful: bool) -> None:
        if graceful and self.comm is not None and all(p.is_alive() for p in self.procs):
            try:
                self.comm.next_message({"op": "stop"})
            except RuntimeError:  # a rank went away meanwhile: the kill below still ends the rest
                pass
        elif self.launched and self.comm is not None:
            try:  # nothing here can kill a launched worker: wake the idle ones with the news instead
                self.comm.abort()
            except RuntimeError:  # the store is gone: the workers see that too
                pass
        deadline = time.monotonic() + (5.0 if graceful else 0.0)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5.0)
        self.procs = []
        self.bootstrap = None
        if self.group_up:
            self.group_up = False
            dist.destroy_process_group()
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
            self.threads_before = None


def _check_rank_local(load: ShardedLoad, launch: torchrun.LaunchEnv | None, world: int) -> None:
    """A rank-local load holds one rank's shard: it can only serve as that rank of a torchrun group of its world
    (spawned workers are sent their shards by rank 0, which needs the whole model for that)."""
    if launch is None:
        raise ValueError("TensorParallelEngine: a rank-local load (ShardedLoad) holds one rank's shard and runs only "
                         "under torchrun; to spawn the workers here, pass the whole Model")
    if load.rank != launch.rank or len(load.shards) != world:
        raise ValueError(f"TensorParallelEngine: the rank-local load is rank {load.rank} of {len(load.shards)}, but "
                         f"this process is rank {launch.rank} of {world}")


class TensorParallelEngine:
    """Rank 0 of a ``world``-rank tensor-parallel group: on this machine, or on several under torchrun.

    Without torchrun's environment, the ``world - 1`` workers are spawned here and each receives its shard. Under
    torchrun (``RANK`` and ``WORLD_SIZE`` set; :mod:`tessera.distributed.torchrun`), every rank runs this constructor:
    rank 0 becomes the engine and the workers' shards never leave them, while on any other rank the constructor does
    not return: the process serves as that worker until rank 0 stops the group, then ends with ``SystemExit(0)``.

    Parameters
    ----------
    model : the whole model as this process loaded it (rank 0 keeps its shard; a spawned worker receives its own,
        a launched worker cuts its own from its ``model``), or, under torchrun only, this rank's rank-local load
        (:class:`tessera.distributed.rank_local.ShardedLoad`: its weights are this rank's shard already, and its
        plan is every rank's cut).
    world : ranks, 2 or more; under torchrun it must equal ``WORLD_SIZE``.
    num_pages, page_size, kv_cache_dtype : the paged cache every rank allocates (each with its own KV heads).
    threads_per_rank : intra-op threads of each rank (rank 0 included).
    timeout_s : the longest a step waits for a peer, and the ranks for each other at the start; None reads
        ``TESSERA_TP_TIMEOUT`` or uses 120 s.

    Raises
    ------
    ValueError
        Under torchrun: ``WORLD_SIZE`` differs from ``world``, or the launch environment is incomplete. A rank-local
        load outside torchrun, or of another rank or world.
    SystemExit
        Under torchrun on ranks >= 1, with code 0, after rank 0 has stopped the group.

    Attributes
    ----------
    model : rank 0's shard as a :class:`Model` (its config has rank 0's heads; tokenizer and vocabulary are whole).
    cache : rank 0's cache handle (:class:`BroadcastCache`).
    """

    def __init__(self, model: Model | ShardedLoad, world: int, num_pages: int, page_size: int,
                 kv_cache_dtype: str | None = None, threads_per_rank: int = 1, timeout_s: float | None = None) -> None:
        if not isinstance(world, int) or world < 2:
            raise ValueError(f"TensorParallelEngine: world must be an int >= 2, got {world!r}")
        loaded = model.model if isinstance(model, ShardedLoad) else model
        if loaded.device.type != "cpu":
            raise ValueError(f"tensor parallelism runs on CPU ranks over gloo for now; the model is on {loaded.device}")
        self.world = world
        self.timeout_s = float(timeout_s if timeout_s is not None else
                               os.environ.get("TESSERA_TP_TIMEOUT", DEFAULT_TIMEOUT_S))
        launch = torchrun.launch_env()
        if launch is not None:
            torchrun.check_world(launch, world)
        if isinstance(model, ShardedLoad):
            _check_rank_local(model, launch, world)
        if launch is not None and launch.rank > 0:
            torchrun.become_worker(model, launch, self.timeout_s)  # never returns
        config, weights = loaded.config, loaded.weights
        if isinstance(model, ShardedLoad):
            shards = model.shards
        else:
            shards = plan_shards(config, world, mlp_unit(weights, config.num_layers))
        vocab_ranges = [s.vocab for s in shards]
        self._ranks = _Ranks()
        self._finalizer = weakref.finalize(self, self._ranks.finalize)
        self._error: TensorParallelError | None = None
        if launch is None:
            host, port = rendezvous()
            self._spawn(loaded, shards, host, port, num_pages, page_size, kv_cache_dtype, threads_per_rank)
        else:
            host, port = launch.master_addr, 0  # port 0: rank 0's own store takes a free port, published in the plan
            self._ranks.launched = True
        try:
            wait = timedelta(seconds=self.timeout_s)
            store = dist.TCPStore(host, port, world, is_master=True, timeout=wait, wait_for_workers=False)
            if launch is not None:  # the workers learn the port of this store, and their cut, from the plan
                plan = torchrun.plan_for(model, shards, port=store.port, num_pages=num_pages, page_size=page_size,
                                         kv_cache_dtype=kv_cache_dtype, threads=threads_per_rank,
                                         timeout_s=self.timeout_s, idle_timeout_s=IDLE_TIMEOUT_S)
                self._ranks.bootstrap = torchrun.publish_plan(launch, plan)
            self._await_workers(store)
            dist.init_process_group("gloo", store=store, rank=0, world_size=world, timeout=wait)
            self._ranks.group_up = True
            self._ranks.comm = self.comm = Communicator(0, world, store, IDLE_TIMEOUT_S)
        except Exception as exc:
            error = TensorParallelError(f"tensor parallelism: the {world} ranks did not form a group ({exc}); "
                                        f"{self._rank_states()}")
            self._ranks.failed = True
            self._ranks.stop(graceful=False)
            raise error from exc
        self._ranks.bootstrap = None  # every worker has joined, so each has read the plan
        self._ranks.threads_before = torch.get_num_threads()
        set_threads(threads_per_rank)
        shard0 = shards[0]
        own = weights if isinstance(model, ShardedLoad) else shard_weights(config, weights, shard0)
        bound = bind(own, shard0, vocab_ranges, self.comm)
        self.model = dataclasses.replace(loaded, config=local_config(config, shard0), weights=bound)
        self.cache = BroadcastCache(new_cache(self.model, num_pages, page_size, kv_cache_dtype))

    def _spawn(self, model: Model, shards: list, host: str, port: int, num_pages: int, page_size: int,
               kv_cache_dtype: str | None, threads_per_rank: int) -> None:
        """Start one process per worker shard on this machine, each sent its spec and its plain weights."""
        config, weights = model.config, model.weights
        vocab_ranges = [s.vocab for s in shards]
        ctx = mp.get_context("spawn")
        saved = {k: os.environ.get(k) for k in _POOL_VARS}
        os.environ.update({k: str(threads_per_rank) for k in _POOL_VARS})
        try:
            for shard in shards[1:]:
                spec = WorkerSpec(shard.rank, self.world, host, port, local_config(config, shard), shard, vocab_ranges,
                                  model.backend, num_pages, page_size, kv_cache_dtype, threads_per_rank,
                                  self.timeout_s, IDLE_TIMEOUT_S)
                proc = ctx.Process(target=worker_main, args=(spec, shard_weights(config, weights, shard)),
                                   name=f"tessera-tp-rank{shard.rank}", daemon=True)
                proc.start()
                self._ranks.procs.append(proc)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _await_workers(self, store: dist.TCPStore) -> None:
        """Wait until every worker has reached the store; fail at once when one exits first (the store alone would
        wait out the whole timeout for it). Launched workers are not children of this process: they are awaited
        by their keys alone, and named by them afterwards."""
        ranks = range(1, self.world)
        keys = [f"{JOINED_KEY}/{r}" for r in ranks]
        deadline = time.monotonic() + self.timeout_s
        while not store.check(keys):
            if any(p.exitcode is not None for p in self._ranks.procs):
                raise RuntimeError(
                    "a worker exited before it joined (its traceback is on stderr). Each worker is a fresh process "
                    "that imports the main module first (multiprocessing's spawn): a script that creates the LLM "
                    "must do so under `if __name__ == \"__main__\":`")
            if time.monotonic() > deadline:
                if not self._ranks.launched:
                    raise RuntimeError(f"the workers did not join within {self.timeout_s:g} s")
                missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
                raise RuntimeError(
                    f"rank(s) {', '.join(map(str, missing))} of {self.world} did not join within {self.timeout_s:g} s. "
                    "Under torchrun every rank runs the same command and reaches LLM(...) with the same "
                    "tensor_parallel_size; a rank that failed before that shows its error in its own output, and "
                    "one still loading a large checkpoint needs a larger TESSERA_TP_TIMEOUT")
            time.sleep(0.02)
        if self._ranks.launched:
            self._ranks.peers = {r: store.get(k).decode() for r, k in zip(ranks, keys)}

    # ------------------------------------------------------------------------------------------- steps
    def forward_step(self, model: Model, cache: object, step: StepBatch, *, all_logits: bool = False,
                     logit_rows: list[int] | None = None, greedy: bool = False) -> torch.Tensor:
        """:func:`tessera.models.paged.forward_step` over every rank: the signature the runner calls (``model`` and
        ``cache`` are rank 0's shard and handle). ``greedy=True`` returns each row's greedy token, which the ranks
        agree on by exchanging their local best logit instead of gathering the vocabulary. Any failure ends the
        engine with a :class:`TensorParallelError`."""
        if self._error is not None:
            raise self._error
        try:
            dead = [p for p in self._ranks.procs if not p.is_alive()]
            if dead:
                raise RuntimeError("a worker is not running")
            msg = step_message(step, self.cache.take_copies(), all_logits, logit_rows, greedy)
            self.comm.next_message(msg)
            return run_step(self.model, self.cache.local, msg)
        except Exception as exc:
            for p in self._ranks.procs:  # a rank that just died is reaped within moments: report its exit code
                p.join(0.5)
            self._error = TensorParallelError(
                f"tensor-parallel step failed and the engine stopped: {self._rank_states()}; cause: "
                f"{type(exc).__name__}: {exc}. Create a new LLM to continue")
            self._ranks.failed = True
            self._ranks.stop(graceful=False)
            raise self._error from exc

    def _rank_states(self) -> str:
        if self._ranks.launched:  # not this process's children: where they run is known, their exit codes are not
            names = ", ".join(f"rank {r} ({where})" for r, where in self._ranks.peers.items()) or "the workers"
            return (f"{names} started by torchrun, whose output has their own errors; a rank that did not answer "
                    f"within {self.timeout_s:g} s is stuck or unreachable (TESSERA_TP_TIMEOUT sets the limit)")
        states = []
        for p in self._ranks.procs:
            code = p.exitcode
            if code is None:
                states.append(f"rank {p.name[len('tessera-tp-rank'):]} (pid {p.pid}) alive")
            else:
                how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                states.append(f"rank {p.name[len('tessera-tp-rank'):]} (pid {p.pid}) {how}")
        hung = (f"; an alive rank that did not answer within {self.timeout_s:g} s is stuck (TESSERA_TP_TIMEOUT sets "
                "the limit)")
        return ", ".join(states) + (hung if all(p.exitcode is None for p in self._ranks.procs) else "")

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker ranks (1 .. world-1)."""
        return [p.pid for p in self._ranks.procs]

    def shutdown(self) -> None:
        """Stop the workers (a stop message, then kill what is left after 5 s; launched workers exit on the message
        with status 0) and leave the group. Idempotent."""
        if self._finalizer.alive:
            self._finalizer.detach()
            self._ranks.stop(graceful=self._error is None)
