"""The backend interface and the ragged batch description every backend consumes (the registry: ``registry.py``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:  # the attention package imports this module; avoid the cycle at run time
    from tessera.attention.spec import AttentionSpec


def _starts(lens: tuple[int, ...]) -> tuple[int, ...]:
    """Exclusive prefix sums of ``lens`` as Python ints (``()`` for no sequences)."""
    return tuple(map(int, itertools.accumulate(lens[:-1], initial=0))) if lens else ()


@dataclass(frozen=True, slots=True)
class RaggedBatch:
    """Where each sequence of a ragged batch lives, as host-side integers.

    Sequence ``s`` owns q rows ``q_starts[s] : q_starts[s] + q_lens[s]`` of q ``[total_q, Hq, D]`` and kv rows
    ``kv_starts[s] : kv_starts[s] + kv_lens[s]`` of k/v ``[total_kv, Hkv, D]``. Its queries sit at the last
    ``q_lens[s]`` absolute positions of its kv: ``kv_lens[s] - q_lens[s] .. kv_lens[s] - 1``.
    """

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    q_starts: tuple[int, ...] = field(init=False)
    kv_starts: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        # running sums in plain Python: built on every step, where NumPy's cumsum on a few lengths cost ~10 us
        object.__setattr__(self, "q_starts", _starts(self.q_lens))
        object.__setattr__(self, "kv_starts", _starts(self.kv_lens))

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def total_q(self) -> int:
        return int(sum(self.q_lens))

    @property
    def total_kv(self) -> int:
        return int(sum(self.kv_lens))


@dataclass(frozen=True, slots=True)
class AttentionRequest:
    """What a backend is asked to run; ``why_not`` answers from this alone, before any work."""

    spec: AttentionSpec
    dtype: torch.dtype
    device: torch.device
    layout: str = "ragged"  # "ragged" (contiguous per sequence) or "paged"


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """How a backend may run a planned step; every backend accepts these and ignores what it has no use for.

    Attributes
    ----------
    shared_prefix : bool
        Sequences whose leading pages are the same pages may attend to that prefix in one shared pass and merge it
        into each sequence's own part by log-sum-exp (a cascade). Off, every sequence reads its whole cache itself:
        what a benchmark compares the cascade against.
    """

    shared_prefix: bool = True


DEFAULT_PLAN_OPTIONS = PlanOptions()


class Backend(Protocol):
    """One hardware target. Every backend runs the same conformance suite.

    Optional members beyond those below, looked up with ``getattr``: ``device_types()``, ``ops_package``,
    ``tunables_module``, ``kv_storage()``, ``kernel_variants()``, ``compute_peaks()``, ``compute_roof()``,
    ``profile_targets()``; and, for a backend whose kernels compile on the machine that runs them,
    ``quick_start_backend`` (a backend that runs the same model at once while they compile) with
    ``warm_marker_dir()`` (:mod:`tessera.tools.first_run`).
    """

    name: str
    #: higher wins under ``backend="auto"``
    priority: int
    #: optional (default False): when True, ``run`` receives ``out`` uninitialized in q's dtype and must write every
    #: row with sinks folded in; otherwise ``out`` is float32 zeros and ``execute`` adds sinks and casts
    fused_epilogue: bool

    def available(self) -> list[str]:
        """Reasons this backend cannot run at all on this machine (empty when usable)."""
        ...

    def device_types(self) -> tuple[str, ...]:
        """Optional (default ``("cpu",)``): the torch device types whose tensors this backend runs on; the first is
        where a model loaded for it lives unless the caller names a device (:func:`resolve_device`)."""
        ...

    def why_not(self, request: AttentionRequest) -> list[str]:
        """Reasons this backend cannot serve ``request`` (empty when it can)."""
        ...

    def plan(self, spec: AttentionSpec, batch: RaggedBatch, layout: KVLayout,
             options: PlanOptions = DEFAULT_PLAN_OPTIONS) -> object:
        """Host-side state for one step (validated lengths; depends on lengths, the spec's structure and ``options``,
        never on tensor values)."""
        ...

    def run(self, state: object, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor) -> None:
        """One layer: fill ``out [total_q, Hq, D]`` and ``lse [total_q, Hq]`` (float32, natural log) WITHOUT sinks;
        ``k_rows``/``v_rows`` are ``[rows, Hkv, D]`` token rows addressed by the plan's layout."""
        ...


class BackendUnavailableError(RuntimeError):
    """No backend (or not the requested one) can serve a request; the message lists every backend's reasons."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Where the keys of each sequence live in a token-row view ``k_rows [rows, Hkv, D]`` of the KV storage.

    Key ``j`` of sequence ``s`` is row ``row_base[s, j // block] + j % block``. A contiguous ragged batch is one block
    per sequence (``row_base[s, 0] = kv_starts[s]``); a paged cache has ``row_base = page_table * page_size`` and
    ``block = page_size``, with ``k_rows = k_pages.view(-1, Hkv, D)``.
    """

    row_base: np.ndarray  # int64 [num_seqs, max_blocks]
    block: int

    @staticmethod
    def contiguous(batch: RaggedBatch) -> KVLayout:
        base = np.asarray(batch.kv_starts, dtype=np.int64).reshape(-1, 1)
        return KVLayout(base, max(max(batch.kv_lens, default=0), 1))

    @staticmethod
    def paged(page_table: np.ndarray, page_size: int) -> KVLayout:
        return KVLayout(np.asarray(page_table, dtype=np.int64) * page_size, page_size)

    def rows(self, s: int, kv_len: int) -> np.ndarray | slice:
        """Row indices of sequence ``s``'s first ``kv_len`` keys (a slice when they are contiguous)."""
        if kv_len <= self.block:
            start = int(self.row_base[s, 0])
            return slice(start, start + kv_len)
        j = np.arange(kv_len, dtype=np.int64)
        return self.row_base[s, j // self.block] + j % self.block
