"""Attention masks: which (query position, kv position) pairs may attend.

A mask answers two questions:

* ``evaluate(b, h, q_pos, kv_pos)``: a boolean torch tensor, True where attention is allowed. The arguments are
  broadcastable integer tensors (FlexAttention's ``mask_mod`` convention), positions are absolute.
* ``classify(b, q_lo, q_hi, kv_lo, kv_hi)``: for rectangles of positions ``[q_lo, q_hi) x [kv_lo, kv_hi)`` (NumPy int64
  arrays that broadcast), whether every pair is kept (``FULL``), none is (``EMPTY``) or it is mixed (``PARTIAL``).
  Kernels skip EMPTY tiles and skip mask evaluation on FULL tiles. Built-in masks answer analytically; a custom mask
  answers by evaluation. ``PARTIAL`` is always a safe answer.

Masks compose with ``&``, ``|`` and ``~``.
"""

from __future__ import annotations

import inspect
from typing import Callable

import numpy as np
import torch

EMPTY, PARTIAL, FULL = np.int8(0), np.int8(1), np.int8(2)

MaskFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Mask:
    """Base class of all masks. Subclasses implement ``evaluate`` and (optionally) ``classify``."""

    #: True when ``evaluate`` may depend on the query head ``h``.
    head_dependent: bool = False
    #: True when ``evaluate`` / ``classify`` may depend on the sequence index ``b`` (planners reuse one sequence's
    #: tiles for every other sequence of the same lengths when it is False).
    batch_dependent: bool = False

    def evaluate(self, b: torch.Tensor, h: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def classify(self, b: int, q_lo: np.ndarray, q_hi: np.ndarray, kv_lo: np.ndarray, kv_hi: np.ndarray) -> np.ndarray:
        """Tile classes for rectangles of positions (half-open bounds); PARTIAL unless overridden."""
        shape = np.broadcast_shapes(np.shape(q_lo), np.shape(q_hi), np.shape(kv_lo), np.shape(kv_hi))
        return np.full(shape, PARTIAL, dtype=np.int8)

    def check_lengths(self, num_seqs: int, kv_lens: list[int], dense: bool) -> None:
        """Raise ValueError when the mask cannot cover these sequences (only document masks can fail)."""

    def structure_key(self) -> tuple | None:
        """A hashable description that fixes this mask's every value (equal keys, equal masks), or None when the mask
        holds tensors or user functions. Plan caches key on it, so two ``causal()`` objects share plans."""
        return None

    def __and__(self, other: Mask) -> Mask:
        return _And(self, _as_mask(other, "&"))

    def __or__(self, other: Mask) -> Mask:
        return _Or(self, _as_mask(other, "|"))

    def __invert__(self) -> Mask:
        return _Not(self)


def _as_mask(obj: object, op: str) -> Mask:
    if not isinstance(obj, Mask):
        raise TypeError(
            f"masks compose only with masks: got {type(obj).__name__} on the right of '{op}'. "
            "Wrap a callable with tessera.attention.custom_mask(fn) first."
        )
    return obj


class _Causal(Mask):
    def evaluate(self, b, h, q_pos, kv_pos):
        return kv_pos <= q_pos

    def classify(self, b, q_lo, q_hi, kv_lo, kv_hi):
        full = kv_hi - 1 <= q_lo
        empty = kv_lo > q_hi - 1
        return _classes(full, empty)

    def structure_key(self) -> tuple:
        return ("causal",)

    def __repr__(self) -> str:
        return "causal()"


class _SlidingWindow(Mask):
    def __init__(self, window: int) -> None:
        self.window = _positive_int(window, "sliding_window(window)")

    def evaluate(self, b, h, q_pos, kv_pos):
        return (kv_pos <= q_pos) & (kv_pos > q_pos - self.window)

    def classify(self, b, q_lo, q_hi, kv_lo, kv_hi):
        w = self.window
        full = (kv_hi - 1 <= q_lo) & (kv_lo > q_hi - 1 - w)
        empty = (kv_lo > q_hi - 1) | (kv_hi - 1 <= q_lo - w)
        return _classes(full, empty)

    def structure_key(self) -> tuple:
        return ("sliding_window", self.window)

    def __repr__(self) -> str:
        return f"sliding_window({self.window})"


class _Chunked(Mask):
    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = _positive_int(chunk_size, "chunked(chunk_size)")

    def evaluate(self, b, h, q_pos, kv_pos):
        return torch.div(q_pos, self.chunk_size, rounding_mode="floor") == torch.div(
            kv_pos, self.chunk_size, rounding_mode="floor"
        )

    def classify(self, b, q_lo, q_hi, kv_lo, kv_hi):
        c = self.chunk_size
        q_first, q_last, k_first, k_last = q_lo // c, (q_hi - 1) // c, kv_lo // c, (kv_hi - 1) // c
        full = (q_first == q_last) & (k_first == k_last) & (q_first == k_first)
        empty = (q_last < k_first) | (k_last < q_first)
        return _classes(full, empty)

    def structure_key(self) -> tuple:
        return ("chunked", self.chunk_size)

    def __repr__(self) -> str:
        return f"chunked({self.chunk_size})"


class _PrefixLM(Mask):
    def __init__(self, prefix_len: int) -> None:
        if isinstance(prefix_len, bool) or not isinstance(prefix_len, (int, np.integer)) or prefix_len < 0:
            raise ValueError(f"prefix_lm(prefix_len) expects an int >= 0, got {prefix_len!r}")
        self.prefix_len = int(prefix_len)

    def evaluate(self, b, h, q_pos, kv_pos):
        return (kv_pos < self.prefix_len) | (kv_pos <= q_pos)

    def classify(self, b, q_lo, q_hi, kv_lo, kv_hi):
        p = self.prefix_len
        full = (kv_hi - 1 < p) | (kv_hi - 1 <= q_lo)
        empty = (kv_lo >= p) & (kv_lo > q_hi - 1)
        return _classes(full, empty)

    def structure_key(self) -> tuple:
        return ("prefix_lm", self.prefix_len)

    def __repr__(self) -> str:
        return f"prefix_lm({self.prefix_len})"


class _Document(Mask):
    def __init__(self, doc_ids: torch.Tensor) -> None:
        if not isinstance(doc_ids, torch.Tensor) or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
            raise TypeError(
                f"document(doc_ids) expects an integer torch tensor over positions, got "
                f"{getattr(doc_ids, 'dtype', type(doc_ids).__name__)}"
            )
        if doc_ids.dim() not in (1, 2):
            raise ValueError(
                f"document(doc_ids) expects shape [num_positions] or [batch, num_positions], got {tuple(doc_ids.shape)}"
            )
        self.doc_ids = doc_ids.detach().to("cpu", torch.int64).contiguous()
        self._np = self.doc_ids.numpy()
        self.batch_dependent = self.doc_ids.dim() == 2

    def _row(self, b: int) -> np.ndarray:
        return self._np if self._np.ndim == 1 else self._np[b]

    def _ids_for(self, b: torch.Tensor) -> torch.Tensor:
        if self.doc_ids.dim() == 1:
            return self.doc_ids
        return self.doc_ids[b.reshape(-1)[0]] if b.numel() == 1 else self.doc_ids[b]

    def evaluate(self, b, h, q_pos, kv_pos):
        if self.doc_ids.dim() == 1 or b.numel() == 1:
            ids = self._ids_for(b).to(q_pos.device)
            return ids[q_pos] == ids[kv_pos]
        ids = self.doc_ids.to(q_pos.device)
        return ids[b, q_pos] == ids[b, kv_pos]

    def classify(self, b, q_lo, q_hi, kv_lo, kv_hi):
        row = self._row(b)
        qmin, qmax = _range_min_max(row, q_lo, q_hi)
        kmin, kmax = _range_min_max(row, kv_lo, kv_hi)
        full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        empty = (qmax < kmin) | (kmax < qmin)
        return _classes(full, empty)

    def check_lengths(self, num_seqs: int, kv_lens: list[int], dense: bool) -> None:
        n = self.doc_ids.shape[-1]
        if self.doc_ids.dim() == 2 and self.doc_ids.shape[0] != num_seqs:
            raise ValueError(
                f"document(doc_ids): doc_ids has {self.doc_ids.shape[0]} rows but the batch has {num_seqs} sequences; "
                "pass one row per sequence or a 1-D tensor shared by all"
            )
        need = max(kv_lens, default=0)
        if (dense and n != need) or n < need:
            what = f"exactly {need}" if dense else f"at least {need}"
            raise ValueError(
                f"document(doc_ids): expected {what} positions (the kv length), got {n}; "
                "doc_ids gives one document id per absolute kv position"
            )

    def __repr__(self) -> str:
        return f"document(<{tuple(self.doc_ids.shape)}>)"


def _range_min_max(row: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Min and max of ``row[lo:hi]`` for arrays of ranges (ranges are short lists of tiles, so a loop is fine)."""
    lo_b, hi_b = np.broadcast_arrays(np.asarray(lo), np.asarray(hi))
    mins = np.empty(lo_b.shape, dtype=np.int64)
    maxs = np.empty(lo_b.shape, dtype=np.int64)
    cache: dict[tuple[int, int], tuple[int, int]] = {}
    for idx in np.ndindex(lo_b.shape):
        key = (int(lo_b[idx]), int(hi_b[idx]))
        if key not in cache:
            seg = row[key[0] : key[1]]
            cache[key] = (int(seg.min()), int(seg.max()))
        mins[idx], maxs[idx] = cache[key]
    return mins, maxs


class CustomMask(Mask):
    """A user mask ``fn(b, h, q_pos, kv_pos) -> bool tensor`` built from vectorized torch ops."""

    head_dependent = True
    batch_dependent = True

    def __init__(self, fn: MaskFn) -> None:
        if not callable(fn):
            raise TypeError(f"custom_mask(fn) expects a callable fn(b, h, q_pos, kv_pos), got {type(fn).__name__}")
        self.fn = fn

    def evaluate(self, b, h, q_pos, kv_pos):
        out = self.fn(b, h, q_pos, kv_pos)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            raise TypeError(
                f"custom mask {getattr(self.fn, '__name__', self.fn)!r} must return a bool tensor, got "
                f"{getattr(out, 'dtype', type(out).__name__)}; compare positions, e.g. `return kv_pos <= q_pos`"
            )
        return out

    def __repr__(self) -> str:
        return f"custom_mask({getattr(self.fn, '__name__', 'fn')})"


class _And(Mask):
    def __init__(self, a: Mask, b: Mask) -> None:
        self.a, self.b = a, b
        self.head_dependent = a.head_dependent or b.head_dependent
        self.batch_dependent = a.batch_dependent or b.batch_dependent

    def evaluate(self, b, h, q_pos, kv_pos):
        return self.a.evaluate(b, h, q_pos, kv_pos) & self.b.evaluate(b, h, q_pos, kv_pos)

    def classify(self, b, q_lo, q_hi, kv_lo, kv_hi):
        return np.minimum(self.a.classify(b, q_lo, q_hi, kv_lo, kv_hi), self.b.classify(b, q_lo, q_hi, kv_lo, kv_hi))

    def check_lengths(self, num_seqs, kv_lens, dense):
        self.a.check_lengths(num_seqs, kv_lens, dense)
        self.b.check_lengths(num_seqs, kv_lens, dense)

    def structure_key(self) -> tuple | None:
        a, b = self.a.structure_key(), self.b.structure_key()
        return None if a is None or b is None else (type(self).__name__, a, b)

    def __repr__(self) -> str:
        return f"({self.a!r} & {self.b!r})"


class _Or(_And):
    def evaluate(self, b, h, q_pos, kv_pos):
        return self.a.evaluate(b, h, q_pos, kv_pos) | self.b.evaluate(b, h, q_pos, kv_pos)

    def classify(self, b, q_lo, q_hi, kv_lo, kv_hi):
        return np.maximum(self.a.classify(b, q_lo, q_hi, kv_lo, kv_hi), self.b.classify(b, q_lo, q_hi, kv_lo, kv_hi))

    def __repr__(self) -> str:
        return f"({self.a!r} | {self.b!r})"


class _Not(Mask):
    def __init__(self, inner: Mask) -> None:
        self.inner = inner
        self.head_dependent = inner.head_dependent
        self.batch_dependent = inner.batch_dependent

    def evaluate(self, b, h, q_pos, kv_pos):
        return ~self.inner.evaluate(b, h, q_pos, kv_pos)

    def classify(self, b, q_lo, q_hi, kv_lo, kv_hi):
        # EMPTY (0) <-> FULL (2); PARTIAL (1) stays.
        return (FULL - self.inner.classify(b, q_lo, q_hi, kv_lo, kv_hi)).astype(np.int8)

    def check_lengths(self, num_seqs, kv_lens, dense):
        self.inner.check_lengths(num_seqs, kv_lens, dense)

    def structure_key(self) -> tuple | None:
        inner = self.inner.structure_key()
        return None if inner is None else ("not", inner)

    def __repr__(self) -> str:
        return f"~{self.inner!r}"


def _classes(full: np.ndarray, empty: np.ndarray) -> np.ndarray:
    return np.where(full, FULL, np.where(empty, EMPTY, PARTIAL)).astype(np.int8)


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} expects an int >= 1, got {value!r}")
    return int(value)


def causal() -> Mask:
    """Each query sees kv positions up to and including its own: ``kv_pos <= q_pos``."""
    return _Causal()


def sliding_window(window: int) -> Mask:
    """Each query sees its ``window`` latest positions up to its own: ``q_pos - window < kv_pos <= q_pos``."""
    return _SlidingWindow(window)


def chunked(chunk_size: int) -> Mask:
    """Queries see only their own chunk: ``q_pos // chunk_size == kv_pos // chunk_size``.

    Compose with ``causal()`` for Llama-4 style chunked-local attention: ``chunked(8192) & causal()``.
    """
    return _Chunked(chunk_size)


def prefix_lm(prefix_len: int) -> Mask:
    """Bidirectional over the first ``prefix_len`` positions, causal after: ``kv_pos < prefix_len or kv_pos <= q_pos``."""
    return _PrefixLM(prefix_len)


def document(doc_ids: torch.Tensor) -> Mask:
    """Attend only within a document: ``doc_ids[q_pos] == doc_ids[kv_pos]``.

    Parameters
    ----------
    doc_ids : torch.Tensor, integer, ``[num_positions]`` or ``[batch, num_positions]``
        The document id of every absolute kv position. Compose with ``causal()`` for packed causal training.
    """
    return _Document(doc_ids)


def custom_mask(fn: MaskFn) -> Mask:
    """Wrap ``fn(b, h, q_pos, kv_pos) -> bool tensor`` (vectorized torch ops, FlexAttention's mask_mod)."""
    return CustomMask(fn)


def positional_arity(fn: Callable) -> int:
    """Number of positional parameters of ``fn`` (used by ``custom`` to tell masks from score functions)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return -1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return -1
    return sum(1 for p in params if p.kind in kinds)
