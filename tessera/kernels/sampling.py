"""Vocabulary ops and the batched sampler: softmax, log-softmax, argmax, top-k, and ``sample`` with per-row params.

All ops work on the last dimension (the vocabulary) of ``[batch, vocab]`` logits in float32, bfloat16 or float16.
Probabilities and log-probabilities come back in float32, token ids in int64; ties go to the lowest index (as
``torch.argmax``). ``docs/kernels/sampling.md`` gives the exact semantics of every sampling parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tessera.dtypes import FLOAT_DTYPES
from tessera.kernels import registry


@dataclass(slots=True)
class SamplerParams:
    """What the batched sampler needs of one row (vLLM / Hugging Face names and semantics).

    Users of the engine pass :class:`tessera.engine.SamplingParams`, which is this plus when to stop and what to
    report; ``sample`` takes either.

    Applied in this order: penalties -> temperature -> top-k -> top-p -> min-p -> draw.

    Attributes
    ----------
    temperature : float >= 0; 0 means greedy (argmax of the penalized logits).
    top_k : int; keep the k largest logits (all ties of the k-th are kept); 0 or -1 = off.
    top_p : float in (0, 1]; keep the smallest prefix of the sorted distribution whose mass reaches top_p; 1 = off.
    min_p : float in [0, 1]; drop tokens whose probability is below ``min_p`` times the largest; 0 = off.
    repetition_penalty : float > 0 (HF): seen tokens' logits are divided by it when positive, multiplied when not.
    presence_penalty, frequency_penalty : float (OpenAI): ``logit -= presence * (count > 0) + frequency * count``.
    seed : int or None; a seeded request draws from its own generator, so its samples do not depend on the batch.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0 and math.isfinite(self.temperature), "temperature", ">= 0 (0 = greedy)"),
            (self.top_k == -1 or self.top_k >= 0, "top_k", ">= 1, or 0 / -1 for off"),
            (0 < self.top_p <= 1, "top_p", "in (0, 1] (1 = off)"),
            (0 <= self.min_p <= 1, "min_p", "in [0, 1] (0 = off)"),
            (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty), "repetition_penalty",
             "> 0 (1 = off)"),
            (math.isfinite(self.presence_penalty), "presence_penalty", "finite (0 = off)"),
            (math.isfinite(self.frequency_penalty), "frequency_penalty", "finite (0 = off)"),
        ]
        for ok, name, want in checks:
            if not ok:
                raise ValueError(f"{type(self).__name__}.{name} must be {want}, got {getattr(self, name)!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise TypeError(f"{type(self).__name__}.seed must be an int or None, got {type(self.seed).__name__}")

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(slots=True)
class SamplingBatch:
    """The per-row parameters of one ``sample`` call as tensors: what the backends receive.

    All tensors are on the CPU. ``temperature``, ``top_p``, ``min_p``, ``repetition``, ``presence``, ``frequency``,
    ``uniform``: float64 ``[B]``. ``top_k``: int64 ``[B]``, 0 where off (including k >= vocab). Seen tokens in CSR
    form: row ``b`` saw ``seen_ids[seen_ptr[b]:seen_ptr[b+1]]`` (int64, distinct within a row) ``seen_counts``
    times (int64). ``uniform`` holds each row's draw in [0, 1): the token is found by inverse CDF in vocabulary order.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    seen_ptr: torch.Tensor
    seen_ids: torch.Tensor
    seen_counts: torch.Tensor
    uniform: torch.Tensor


def _check_logits(op: str, logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{op}: logits must be a torch.Tensor [batch, vocab], got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"{op}: logits must be 2-D [batch, vocab], got shape {tuple(logits.shape)}; "
                         "flatten leading dims with logits.reshape(-1, vocab)")
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: logits must be float32, bfloat16 or float16, got {logits.dtype}; cast with .float()")
    if logits.shape[1] == 0:
        raise ValueError(f"{op}: the vocabulary dimension is empty (shape {tuple(logits.shape)}); need vocab >= 1")


def _check_params(op: str, params: Sequence[SamplerParams], batch: int) -> list[SamplerParams]:
    """``params`` as a list, checked to hold one :class:`SamplerParams` per row of a ``batch``-row logits tensor.

    Parameters
    ----------
    op : the public function's name, which starts the error message.
    params : what the caller passed (any iterable; it is consumed once).
    batch : the number of logits rows.

    Returns
    -------
    list[SamplerParams]
    """
    params = list(params)  # a generator is consumed here once, so the check and the caller see the same items
    if len(params) != batch or not all(isinstance(p, SamplerParams) for p in params):
        raise ValueError(f"{op}: params must be a list of {batch} SamplerParams (one per row of logits), "
                         f"got {len(params)} items")
    return params


def softmax(logits: torch.Tensor, *, temperature: float | torch.Tensor | None = None,
            backend: str = "auto") -> torch.Tensor:
    """Probabilities over the vocabulary: ``softmax(logits / temperature)``, computed in float32.

    Parameters
    ----------
    logits : torch.Tensor ``[B, V]``, float32 / bfloat16 / float16
    temperature : None (= 1), a float > 0, or a float tensor ``[B]`` of per-row temperatures > 0
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    torch.Tensor ``[B, V]`` float32, rows summing to 1.

    Examples
    --------
    >>> probs = softmax(torch.randn(4, 49152), temperature=0.7)
    """
    _check_logits("softmax", logits)
    temp = _temperature_rows(logits, temperature)
    return registry.resolve("softmax", backend, logits.device)(logits, temp)


def log_softmax(logits: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Log-probabilities over the vocabulary: ``logits - logsumexp(logits)``, computed in float32.

    Parameters
    ----------
    logits : torch.Tensor ``[B, V]``, float32 / bfloat16 / float16
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    torch.Tensor ``[B, V]`` float32.
    """
    _check_logits("log_softmax", logits)
    return registry.resolve("log_softmax", backend, logits.device)(logits)


def argmax(logits: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Index of the largest logit of each row (the lowest index among ties, as ``torch.argmax``).

    Parameters
    ----------
    logits : torch.Tensor ``[B, V]``, float32 / bfloat16 / float16 (NaN-free)
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    torch.Tensor ``[B]`` int64.
    """
    _check_logits("argmax", logits)
    return registry.resolve("argmax", backend, logits.device)(logits)


def topk(logits: torch.Tensor, k: int, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits of each row, sorted descending; among equal values the lower index comes first.

    Parameters
    ----------
    logits : torch.Tensor ``[B, V]``, float32 / bfloat16 / float16 (NaN-free)
    k : int, 1 <= k <= V
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    values : torch.Tensor ``[B, k]`` float32 (the logits, exactly)
    ids : torch.Tensor ``[B, k]`` int64
    """
    _check_logits("topk", logits)
    vocab = logits.shape[1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"topk: k must be an int in [1, vocab={vocab}], got {k!r}")
    return registry.resolve("topk", backend, logits.device)(logits, k)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplerParams],
    *,
    token_counts: torch.Tensor | Sequence[Sequence[int] | None] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row with that row's parameters: penalties -> temperature -> top-k -> top-p -> min-p.

    The returned log-probability is the sampled token's under the *final filtered* distribution (the one it was
    drawn from); greedy rows return 0. (vLLM returns the raw distribution's logprobs by default; compute those with
    :func:`log_softmax` if needed.) Each row draws one uniform number and picks its token by inverse CDF over the
    kept tokens in vocabulary order, so every backend turns the same draw into the same token up to rounding.

    Parameters
    ----------
    logits : torch.Tensor ``[B, V]``, float32 / bfloat16 / float16; every row needs a finite logit.
    params : list of B :class:`SamplerParams`, one per row.
    token_counts : the tokens each row has seen (prompt + output), for the penalties: None, an integer tensor
        ``[B, V]`` of counts, or B sequences of token ids (None for a row that saw nothing). All three penalties use
        these counts (vLLM counts only output tokens for presence / frequency: pass those if you want that).
    generators : B torch.Generator or None. A row's generator is used when given; otherwise a seeded row gets a
        fresh generator seeded with ``params.seed`` (the same draw every call: keep a generator per request across
        steps), and unseeded rows share torch's default generator.
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    ids : torch.Tensor ``[B]`` int64, on logits' device
    logprobs : torch.Tensor ``[B]`` float32, on logits' device

    Examples
    --------
    >>> ids, lps = sample(logits, [SamplerParams(temperature=0.8, top_p=0.95, seed=1), SamplerParams(0.0)])
    """
    _check_logits("sample", logits)
    batch, vocab = logits.shape
    params = _check_params("sample", params, batch)
    if generators is not None and len(generators) != batch:
        raise ValueError(f"sample: generators must have one entry (or None) per row: expected {batch}, "
                         f"got {len(generators)}")
    tensors = build_batch(params, vocab, token_counts, generators)
    return registry.resolve("sample", backend, logits.device)(logits, tensors)


def filtered_probs(
    logits: torch.Tensor,
    params: Sequence[SamplerParams],
    *,
    token_counts: torch.Tensor | Sequence[Sequence[int] | None] | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The distribution :func:`sample` draws each row from: penalties -> temperature -> top-k -> top-p -> min-p,
    renormalized. Greedy rows are a point mass on the argmax of the penalized logits.

    Speculative decoding's accept/reject rule compares these distributions of the target and the draft.

    Parameters
    ----------
    logits : torch.Tensor ``[B, V]``, float32 / bfloat16 / float16; every row needs a finite logit.
    params : list of B :class:`SamplerParams`.
    token_counts : the tokens each row has seen, as in :func:`sample`.
    backend : "auto", "reference", "cpu" or "triton"

    Returns
    -------
    torch.Tensor ``[B, V]`` float32 on logits' device; zero for filtered-out tokens, rows summing to 1.
    """
    _check_logits("filtered_probs", logits)
    batch, vocab = logits.shape
    params = _check_params("filtered_probs", params, batch)
    tensors = build_batch(params, vocab, token_counts, None, draw=False)
    return registry.resolve("filtered_probs", backend, logits.device)(logits, tensors)


def build_batch(params: list[SamplerParams], vocab: int, token_counts, generators, draw: bool = True
                ) -> SamplingBatch:
    """Pack per-row params, seen-token counts and each row's uniform draw into a :class:`SamplingBatch`
    (``draw=False``: no draw, ``uniform`` is zeros and no generator advances)."""
    f64 = torch.float64

    def col(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=f64)

    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    ptr, ids, counts = _seen_csr(params, vocab, token_counts)
    return SamplingBatch(
        temperature=col([p.temperature for p in params]), top_k=torch.tensor(top_k, dtype=torch.int64),
        top_p=col([p.top_p for p in params]), min_p=col([p.min_p for p in params]),
        repetition=col([p.repetition_penalty for p in params]), presence=col([p.presence_penalty for p in params]),
        frequency=col([p.frequency_penalty for p in params]), seen_ptr=ptr, seen_ids=ids, seen_counts=counts,
        uniform=_uniforms(params, generators) if draw else torch.zeros(len(params), dtype=f64),
    )


def _uniforms(params: list[SamplerParams], generators) -> torch.Tensor:
    """One U[0, 1) draw per row (float64): own generator for seeded rows, so other rows never shift their stream."""
    u = torch.empty(len(params), dtype=torch.float64)
    shared = []
    for row, p in enumerate(params):
        gen = generators[row] if generators is not None else None
        if gen is None and p.seed is not None:
            gen = torch.Generator().manual_seed(p.seed)
        if gen is None:
            shared.append(row)
        else:
            u[row] = torch.rand((), dtype=torch.float64, generator=gen, device=gen.device).item()
    if shared:
        u[shared] = torch.rand(len(shared), dtype=torch.float64)
    return u


def _seen_csr(params: list[SamplerParams], vocab: int, token_counts):
    """Seen tokens of rows with penalties, as CSR (ptr [B+1], ids [N], counts [N]); rows without penalties: none."""
    batch = len(params)
    empty = torch.zeros(0, dtype=torch.int64)
    rows = [b for b, p in enumerate(params) if p.has_penalties]
    if token_counts is None or not rows:
        return torch.zeros(batch + 1, dtype=torch.int64), empty, empty
    if isinstance(token_counts, torch.Tensor):
        if token_counts.shape != (batch, vocab) or token_counts.dtype.is_floating_point:
            raise ValueError(f"sample: token_counts as a tensor must be integer [batch={batch}, vocab={vocab}], "
                             f"got {token_counts.dtype} {tuple(token_counts.shape)}")
        if bool((token_counts < 0).any()):
            raise ValueError("sample: token_counts must be >= 0")
        per_row = [token_counts[b].cpu() for b in range(batch)]
        ids_counts = [(torch.nonzero(c).flatten(), c[c > 0].to(torch.int64)) for c in per_row]
    else:
        if len(token_counts) != batch:
            raise ValueError(f"sample: token_counts must have one id list (or None) per row: expected {batch}, "
                             f"got {len(token_counts)}")
        ids_counts = [_count_ids(token_counts[b], vocab) for b in range(batch)]
    penalized = set(rows)
    ids = [ic[0] if b in penalized else empty for b, ic in enumerate(ids_counts)]
    counts = [ic[1] if b in penalized else empty for b, ic in enumerate(ids_counts)]
    ptr = torch.zeros(batch + 1, dtype=torch.int64)
    ptr[1:] = torch.cumsum(torch.tensor([len(i) for i in ids], dtype=torch.int64), 0)
    return ptr, torch.cat(ids), torch.cat(counts)


def _count_ids(seq, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    if seq is None or len(seq) == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    ids = torch.as_tensor(seq, dtype=torch.int64).flatten().cpu()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"sample: token_counts holds token ids outside [0, vocab={vocab}): "
                         f"min {int(ids.min())}, max {int(ids.max())}")
    return torch.unique(ids, return_counts=True)


def _temperature_rows(logits: torch.Tensor, temperature) -> torch.Tensor | None:
    """None, or float64 ``[B]`` per-row temperatures (all > 0) on the CPU."""
    if temperature is None:
        return None
    batch = logits.shape[0]
    if isinstance(temperature, torch.Tensor):
        if temperature.shape not in ((batch,), ()) or not temperature.dtype.is_floating_point:
            raise ValueError(f"softmax: temperature must be a float, or a float tensor [batch={batch}], "
                             f"got {temperature.dtype} {tuple(temperature.shape)}")
        temp = temperature.detach().to("cpu", torch.float64).expand(batch).contiguous()
    else:
        temp = torch.full((batch,), float(temperature), dtype=torch.float64)
    if not bool((temp > 0).all()) or not bool(torch.isfinite(temp).all()):
        raise ValueError(f"softmax: temperature must be finite and > 0 (greedy is argmax), got "
                         f"min {float(temp.min()) if batch else float('nan')}")
    return temp
