"""The collectives a tensor-parallel step uses, over torch.distributed (gloo on CPU), with bounded waits.

Every collective runs in one gloo group whose timeout is short, so a worker that dies or hangs mid-step fails the
step within it (a dead peer closes its sockets, which gloo reports at once; the timeout covers a peer that is alive
but stuck). Workers sit idle between steps for as long as the engine does, which no collective may: they wait on a
key in rank 0's TCP store instead (:meth:`Communicator.next_message`), then take the step in a broadcast.
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist


#: the value of a message key that announces the end of the group instead of a message (:meth:`Communicator.abort`)
ABORTED = b"aborted"


class TensorParallelError(RuntimeError):
    """A rank failed (died, hung past the timeout, or raised); the tensor-parallel engine cannot continue."""


class Communicator:
    """One rank's view of its tensor-parallel group.

    Parameters
    ----------
    rank, world : this rank and the number of ranks.
    store : rank 0's TCP store (the group's rendezvous), where rank 0 announces each message.
    idle_timeout_s : the longest a worker waits for the next message (the engine's idle time).
    """

    def __init__(self, rank: int, world: int, store: dist.Store, idle_timeout_s: float) -> None:
        self.rank, self.world, self.store = rank, world, store
        self.idle_timeout = timedelta(seconds=idle_timeout_s)
        self.num_messages = 0
        #: seconds spent in all-reduce / all-gather since the last reset (the benchmark's per-step cost)
        self.comm_seconds = 0.0
        self.num_all_reduce = 0
        #: logits all-gathers (:meth:`all_gather_cols`) and greedy picks (:meth:`argmax_across`) since the start
        self.num_all_gather = 0
        self.num_argmax = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks (float32 on the wire, the result in ``t``'s dtype); returns the sum."""
        start = time.perf_counter()
        buf = t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()
        dist.all_reduce(buf)
        self.comm_seconds += time.perf_counter() - start
        self.num_all_reduce += 1
        return buf if buf.dtype == t.dtype else buf.to(t.dtype)

    def all_gather_cols(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's ``t [T, sizes[rank]]`` along the last dimension -> ``[T, sum(sizes)]``."""
        start = time.perf_counter()
        width = max(sizes)
        if t.shape[-1] < width:  # gloo gathers equal shapes: pad, then cut each piece back
            t = torch.nn.functional.pad(t, (0, width - t.shape[-1]))
        t = t.contiguous()
        pieces = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(pieces, t)
        out = torch.cat([p[..., :n] for p, n in zip(pieces, sizes)], dim=-1)
        self.comm_seconds += time.perf_counter() - start
        self.num_all_gather += 1
        return out

    def argmax_across(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row from every rank's local best: ``values [T]`` (float32) are this rank's
        largest logits and ``indices [T]`` (int64) their global vocabulary ids; returns ``[T]`` int64, the same on
        every rank.

        The largest value wins; among equal values the lowest rank's, which holds the lower vocabulary range, so
        the result is the first maximal index of the whole row, as ``torch.argmax`` of the gathered logits.
        Exchanges ``16 * T`` bytes per rank instead of the rows' logits.
        """
        start = time.perf_counter()
        # one float64 message per rank: float32 values and ids below 2**53 are both exact in it
        mine = torch.stack([values.to(torch.float64), indices.to(torch.float64)], dim=-1).contiguous()
        pieces = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(pieces, mine)
        out = first_best(torch.stack(pieces))
        self.comm_seconds += time.perf_counter() - start
        self.num_argmax += 1
        return out

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0 sends ``obj`` (any picklable value) to every rank; every rank returns it."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0)
        if self.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, src=0)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def next_message(self, obj: object = None) -> object:
        """Rank 0: publish that message ``n`` is coming, then broadcast ``obj``. Workers: wait for it (as long as
        the engine idles, up to the idle timeout), then receive it; raise :class:`TensorParallelError` when rank 0
        announced :meth:`abort` instead."""
        key = f"tessera/tp/message/{self.num_messages}"
        if self.rank == 0:
            self.store.set(key, b"1")
            if self.num_messages:  # every worker has passed the previous key: it finished that step's collectives
                self.store.delete_key(f"tessera/tp/message/{self.num_messages - 1}")
        else:
            self.store.wait([key], self.idle_timeout)
            if self.store.get(key) == ABORTED:
                raise TensorParallelError("rank 0 ended the tensor-parallel group after a failure (its error names "
                                          "the rank that failed)")
        self.num_messages += 1
        return self.broadcast_object(obj)

    def abort(self) -> None:
        """Rank 0, instead of a next message: wake every idle worker with the news that the group has ended, so
        that a worker rank 0 cannot kill (one started by torchrun) exits instead of waiting for a step that never
        comes. A worker stuck in a collective learns it from the group's timeout instead."""
        self.store.set(f"tessera/tp/message/{self.num_messages}", ABORTED)


def first_best(candidates: torch.Tensor) -> torch.Tensor:
    """``candidates [world, T, 2]`` float64, each rank's ``(best logit, its vocabulary id)`` per row, ranks in
    vocabulary order -> ``[T]`` int64: the id of the largest logit, the lowest rank's among equal ones (so the
    lowest id, as ``torch.argmax`` over the whole row)."""
    best = candidates[..., 0].argmax(dim=0)  # torch.argmax returns the first maximal index: the lowest rank
    return candidates[..., 1].gather(0, best[None])[0].to(torch.int64)
