"""Ranks started by ``torchrun`` (or by anything that sets its environment), on one machine or several.

Every process runs the same command. ``LLM(..., tensor_parallel_size=N)`` makes rank 0 the engine, as on one
machine, except that it spawns nothing; on ranks 1 .. N-1 the same constructor turns the process into a worker: it
loads its own shard of the checkpoint (rank-locally, :mod:`tessera.distributed.rank_local`: each weight is cut as
it is read, so no rank holds the whole model; given a loaded ``Model``, it cuts its shard from that), joins the
group, runs every step rank 0 sends, and when rank 0 stops the group it ends the process with ``SystemExit(0)``, so
the code after ``LLM(...)`` runs on rank 0 only. No shard travels between ranks.

The rendezvous has two stages. torchrun's store (``env://``: ``MASTER_ADDR`` / ``MASTER_PORT``, hosted by torchrun's
agent on the first node) carries one value: the :class:`GroupPlan`, which holds the port of a store that rank 0 hosts
itself, rank 0's cut of the model (every rank's :class:`RankShard`), and what every rank must agree on (model
config and weight forms, cache shape, timeouts). The group then runs on rank 0's
store exactly as with spawned workers. Rank 0 hosting it matters: the store dies with rank 0, so a worker idling on
it for the next step learns at once that rank 0 is gone, where a store kept by torchrun's agent would outlive rank 0
and leave the worker waiting.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from tessera.distributed.comm import TensorParallelError
from tessera.distributed.rank_local import ShardedLoad, weight_form
from tessera.distributed.sharding import RankShard, local_config, shard_weights
from tessera.distributed.worker import WorkerSpec, serve_steps, set_threads
from tessera.models.config import ModelConfig
from tessera.models.model import Model

#: the variables that mark a process as one rank of a launched group (torchrun sets all four, and LOCAL_RANK)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: key under which rank 0 publishes the pickled :class:`GroupPlan` in torchrun's store
PLAN_KEY = "tessera/tp/plan"


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in a launched group, read from the environment torchrun sets."""

    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class GroupPlan:
    """What rank 0 tells the workers (pickled into torchrun's store once; no weights).

    Attributes
    ----------
    port : the port of rank 0's own store, on ``MASTER_ADDR``.
    config, forms : the whole model as rank 0 loaded it (:func:`weight_forms`; a rank-local load records each whole
        weight's form as it passes); a worker that loaded something else refuses.
    shards : every rank's part, as rank 0 planned it. A worker given a loaded ``Model`` cuts its shard by it; a
        rank-local worker planned the same from the checkpoint's header before loading, and refuses if they differ.
    num_pages, page_size, kv_cache_dtype : the paged KV cache every rank allocates.
    threads, timeout_s, idle_timeout_s : as :class:`tessera.distributed.worker.WorkerSpec`.
    """

    port: int
    config: ModelConfig
    forms: dict[str, str]
    shards: list[RankShard]
    num_pages: int
    page_size: int
    kv_cache_dtype: str | None
    threads: int
    timeout_s: float
    idle_timeout_s: float


def launch_env(environ: dict[str, str] | None = None) -> LaunchEnv | None:
    """The launched-group environment, or None when this process was not started as one rank of a group.

    ``RANK`` and ``WORLD_SIZE`` decide: ``MASTER_ADDR`` / ``MASTER_PORT`` alone only move the store of spawned
    workers (:func:`tessera.distributed.launch.rendezvous`).

    Raises
    ------
    ValueError
        ``RANK`` / ``WORLD_SIZE`` set but a variable missing or not a number (the message names it).
    """
    env = os.environ if environ is None else environ
    if not env.get("RANK") and not env.get("WORLD_SIZE"):
        return None
    missing = [k for k in LAUNCH_VARS if not env.get(k)]
    if missing:
        raise ValueError(f"tensor parallelism: RANK / WORLD_SIZE are set, so this process is one rank of a launched "
                         f"group, but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not; start every "
                         "rank with torchrun (which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), or unset "
                         "RANK and WORLD_SIZE to let rank 0 spawn the workers on this machine")
    try:
        rank, world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
        local_rank = int(env.get("LOCAL_RANK") or 0)
    except ValueError as exc:
        raise ValueError(f"tensor parallelism: RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers "
                         f"({exc})") from exc
    if not 0 <= rank < world:
        raise ValueError(f"tensor parallelism: RANK={rank} is outside [0, WORLD_SIZE={world})")
    return LaunchEnv(rank, world, local_rank, env["MASTER_ADDR"], port)


def check_world(env: LaunchEnv, tensor_parallel_size: int) -> None:
    """Raise ValueError unless the launched group has exactly ``tensor_parallel_size`` ranks."""
    if env.world != tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size}, but this process is rank {env.rank} of a launched group "
            f"of WORLD_SIZE={env.world} (torchrun's --nnodes x --nproc-per-node); every rank of the group is one "
            f"tensor-parallel rank, so the two must be equal: start {tensor_parallel_size} processes in all (e.g. "
            f"`torchrun --nproc-per-node {tensor_parallel_size} ...`), or pass tensor_parallel_size={env.world}")


def whoami() -> str:
    """How other ranks name this process in messages: host and pid."""
    return f"pid {os.getpid()} on {socket.gethostname()}"


def bootstrap_store(env: LaunchEnv, timeout_s: float) -> dist.Store:
    """torchrun's store through the ``env://`` rendezvous (torch decides whether its agent or rank 0 hosts it)."""
    store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world,
                                       timeout=timedelta(seconds=timeout_s)))
    return store


def publish_plan(env: LaunchEnv, plan: GroupPlan) -> dist.Store:
    """Rank 0: put ``plan`` in torchrun's store. Returns that store, which the caller keeps until every worker has
    joined (without torchrun's agent, rank 0 hosts it, and it must outlive the workers' reads)."""
    store = bootstrap_store(env, plan.timeout_s)
    store.set(PLAN_KEY, pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
    return store


def weight_forms(weights: dict) -> dict[str, str]:
    """Each weight's :func:`weight_form`: what two ranks' loads of one checkpoint agree on exactly (a different
    file, dtype or ``keep_quantized`` shows up here)."""
    return {name: weight_form(w) for name, w in weights.items()}


def plan_for(model: Model | ShardedLoad, shards: list[RankShard], **fields) -> GroupPlan:
    """Rank 0's :class:`GroupPlan` for ``model`` (whole, or rank 0's rank-local load) cut as ``shards``; ``fields``
    are the remaining attributes."""
    if isinstance(model, ShardedLoad):
        return GroupPlan(config=model.model.config, forms=model.forms, shards=shards, **fields)
    return GroupPlan(config=model.config, forms=weight_forms(model.weights), shards=shards, **fields)


def _check_same_model(plan: GroupPlan, model: Model | ShardedLoad, env: LaunchEnv) -> None:
    """Refuse a worker whose model differs from rank 0's: its shard would not fit the others' (or, worse, fit and
    compute something else). A rank-local load compares the whole weights' forms it recorded, and its own plan."""
    if isinstance(model, ShardedLoad):
        config, forms = model.model.config, model.forms
    else:
        config, forms = model.config, weight_forms(model.weights)
    # field by field: ModelConfig compares by identity (eq=False, for its per-config caches)
    diffs = [f"{f.name}: rank 0 {getattr(plan.config, f.name)!r}, rank {env.rank} {getattr(config, f.name)!r}"
             for f in dataclasses.fields(ModelConfig) if getattr(plan.config, f.name) != getattr(config, f.name)]
    if not diffs and forms == plan.forms:
        return
    names = sorted(set(forms) | set(plan.forms))
    diffs += [f"{name}: rank 0 {plan.forms.get(name, 'absent')}, rank {env.rank} {forms.get(name, 'absent')}"
              for name in names if forms.get(name) != plan.forms.get(name)][:3]
    raise TensorParallelError(f"tensor-parallel rank {env.rank} loaded a different model than rank 0 "
                              f"({'; '.join(diffs)}); every rank must load the same checkpoint with the same dtype "
                              "and keep_quantized (the same command, and the same file at that path on every node)")


def _check_same_cut(plan: GroupPlan, load: ShardedLoad, env: LaunchEnv) -> None:
    """Refuse a rank-local load cut by a plan other than rank 0's (both come from the same header by the same rule,
    so this only fails when the ranks read different files that still gave equal forms)."""
    if load.shards != plan.shards:
        raise TensorParallelError(f"tensor-parallel rank {env.rank} planned its shard as {load.shards[env.rank]}, "
                                  f"but rank 0 planned it as {plan.shards[env.rank]}; every rank must load the same "
                                  "checkpoint (the same file at that path on every node)")


def become_worker(model: Model | ShardedLoad, env: LaunchEnv, timeout_s: float) -> NoReturn:
    """Run this process as worker rank ``env.rank`` until rank 0 stops the group, then end it with SystemExit(0).

    Parameters
    ----------
    model : this rank's rank-local load (:func:`tessera.distributed.rank_local.load_shard`), used as it is, or the
        whole model as this rank loaded it. A whole model's weights dict is emptied once this rank's shard is cut,
        which frees every weight of the whole model that the shard does not share: the caller never resumes with
        the model (this function only raises), so nothing can observe it.
    env : this rank's place in the group (``env.rank >= 1``).
    timeout_s : how long to wait for rank 0's plan (rank 0 may still be loading) and to join.

    Raises
    ------
    SystemExit
        With code 0, once rank 0 has stopped the group.
    TensorParallelError
        When the group fails: rank 0 exited or crashed, a rank hung or died, or this rank's model differs from rank
        0's. The message says which and how to go on.
    """
    try:
        store = bootstrap_store(env, timeout_s)
        plan: GroupPlan = pickle.loads(store.get(PLAN_KEY))  # waits for rank 0, up to timeout_s
    except dist.DistError as exc:
        raise TensorParallelError(
            f"tensor-parallel rank {env.rank} got no plan from rank 0 through torchrun's store at "
            f"{env.master_addr}:{env.master_port} within {timeout_s:g} s ({type(exc).__name__}: {exc}); rank 0 is "
            "still loading (TESSERA_TP_TIMEOUT raises the limit) or failed before LLM(...) (see its output)") from exc
    del store  # only rank 0's own store from here on
    _check_same_model(plan, model, env)
    set_threads(plan.threads)
    shards = plan.shards
    shard = shards[env.rank]
    if isinstance(model, ShardedLoad):
        _check_same_cut(plan, model, env)
        weights, model = model.model.weights, model.model
    else:
        weights = shard_weights(plan.config, model.weights, shard)
        model.weights.clear()  # the whole model's tensors go; the shard keeps what it shares (norms, biases)
    spec = WorkerSpec(env.rank, env.world, env.master_addr, plan.port, local_config(plan.config, shard), shard,
                      [s.vocab for s in shards], model.backend, plan.num_pages, plan.page_size, plan.kv_cache_dtype,
                      plan.threads, plan.timeout_s, plan.idle_timeout_s)
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C in torchrun's terminal reaches every rank (and torchrun's agent forwards it): rank 0 alone decides
        # how to stop (a server drains its requests first) and then stops this rank, which exits 0. Dying on the
        # interrupt here would fail rank 0's next step instead. SIGTERM keeps its default, so the agent can still
        # end this rank; rank 0's death also ends it (its store goes with rank 0).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        serve_steps(spec, weights, whoami())
    except Exception as exc:
        raise TensorParallelError(
            f"tensor-parallel rank {env.rank} of {env.world} ({whoami()}) stopped: {type(exc).__name__}: {exc}. "
            f"If rank 0 ({env.master_addr}) exited, crashed or gave up on the group first, its output says why"
        ) from exc
    raise SystemExit(0)
