"""The backend interface, the ragged batch description every backend consumes, and the backend registry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:  # the attention package imports this module; avoid the cycle at run time
    from tessera.attention.spec import AttentionSpec


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
        object.__setattr__(self, "q_starts", tuple(np.concatenate([[0], np.cumsum(self.q_lens)[:-1]]).astype(int).tolist()) if self.q_lens else ())
        object.__setattr__(self, "kv_starts", tuple(np.concatenate([[0], np.cumsum(self.kv_lens)[:-1]]).astype(int).tolist()) if self.kv_lens else ())

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
    """One hardware target. Every backend runs the same conformance suite."""

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


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add a backend to the registry (a new accelerator is one new backend folder that calls this)."""
    _REGISTRY[backend.name] = backend
    return backend


def registered() -> dict[str, Backend]:
    """All registered backends by name, loading the built-in ones on first use."""
    # Import the built-in backends even when another one registered first (e.g. a test imported cpu directly).
    from tessera.backends import cpu, reference, triton  # noqa: F401  (registration side effects)

    return dict(_REGISTRY)


def resolve_device(backend: str, device: str | torch.device | None = None) -> torch.device:
    """The device a model, its KV cache and every tensor the engine allocates live on.

    Parameters
    ----------
    backend : a registered backend's name, or ``"auto"`` (ops and attention then follow the tensors' device).
    device : None for the backend's default (its first :meth:`Backend.device_types`; ``"cpu"`` under ``"auto"``), or
        a device the backend runs on (``"cuda"``, ``"cuda:1"``, ``torch.device("cpu")``).

    Raises
    ------
    ValueError : an unknown backend, an unparsable device, or a device the backend does not run on.
    RuntimeError : a CUDA device on a machine where ``torch.cuda.is_available()`` is False.
    """
    if backend == "auto":
        types: tuple[str, ...] = ()
    else:
        backends = registered()
        if backend not in backends:
            raise ValueError(f"unknown backend {backend!r}; choose one of {sorted(backends)} or 'auto'")
        types = _device_types(backends[backend])
    if device is None:
        device = types[0] if types else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r} ({err})") from None
    if types and resolved.type not in types:
        raise ValueError(f"backend {backend!r} runs on {' or '.join(types)} tensors, got device {str(resolved)!r}; "
                         f"pass device={types[0]!r}, or backend='auto' to let each op follow the tensors' device")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {str(resolved)!r} was asked for but torch.cuda.is_available() is False on this "
                           "machine; install a CUDA build of torch or use device='cpu'")
    return resolved


def _device_types(backend: Backend) -> tuple[str, ...]:
    method = getattr(backend, "device_types", None)
    return tuple(method()) if method is not None else ("cpu",)


class BackendUnavailableError(RuntimeError):
    """No backend (or not the requested one) can serve a request; the message lists every backend's reasons."""


def select(request: AttentionRequest, name: str = "auto") -> Backend:
    """The backend named ``name``, or under ``"auto"`` the highest-priority backend that can serve ``request``."""
    backends = registered()
    if name != "auto":
        if name not in backends:
            raise ValueError(f"unknown backend {name!r}; choose one of {sorted(backends)} or 'auto'")
        reasons = backends[name].available() + backends[name].why_not(request)
        if reasons:
            raise BackendUnavailableError(f"backend {name!r} cannot run {request.spec!r}: " + "; ".join(reasons))
        return backends[name]
    refusals: list[str] = []
    for backend in sorted(backends.values(), key=lambda b: -b.priority):
        reasons = backend.available() + backend.why_not(request)
        if not reasons:
            return backend
        refusals.append(f"  {backend.name}: " + "; ".join(reasons))
    raise BackendUnavailableError(
        f"no backend can run {request.spec!r} on {request.device} with {request.dtype}:\n" + "\n".join(refusals)
    )


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
