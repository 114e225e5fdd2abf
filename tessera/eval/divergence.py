"""How far one model's next-token distributions are from a reference's on the same positions: KL divergence,
top-1 agreement, and the tokens' negative log-likelihood, all from the two models' float32 logits in float64.

The reference's logits of every window are needed again for each format compared, so :class:`ReferenceLogits`
keeps them: the float32 logits exactly as the model gave them (a float64 log-softmax of them is the same as the one
computed when they were fresh), in memory up to a limit and in a temporary file beyond it.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tessera.eval.perplexity import ROWS, _nll

#: reference logits kept in memory up to this many bytes; more go to a temporary file (the OS caches what fits)
DEFAULT_MEMORY_LIMIT = 2 * 2**30


def kl_top1(reference: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, ``KL(P_ref || P)`` in nats and whether the two argmaxes agree.

    Parameters
    ----------
    reference, logits : float tensors ``[n, vocab]``
        Both models' logits at the same positions (any float dtype; any device, the same for both).

    Returns
    -------
    (float64 tensor ``[n]``, bool tensor ``[n]``) on the CPU
        ``sum_v p_ref(v) * (log p_ref(v) - log p(v))`` from float64 log-softmaxes of the logits, and
        ``argmax(reference) == argmax(logits)``.
    """
    if reference.shape != logits.shape or reference.dim() != 2:
        raise ValueError(f"kl_top1: the logits must both be [n, vocab], got {list(reference.shape)} and "
                         f"{list(logits.shape)}")
    kl, top1 = [], []
    for lo in range(0, reference.shape[0], ROWS):  # float64 copies of ROWS x vocab at a time, not the whole window
        ref = torch.log_softmax(reference[lo: lo + ROWS].to(torch.float64), dim=-1)
        own = torch.log_softmax(logits[lo: lo + ROWS].to(torch.float64), dim=-1)
        kl.append((ref.exp() * (ref - own)).sum(dim=-1).cpu())
        top1.append((reference[lo: lo + ROWS].argmax(dim=-1) == logits[lo: lo + ROWS].argmax(dim=-1)).cpu())
    return torch.cat(kl), torch.cat(top1)


@dataclass
class Divergence:
    """Per-position figures of one format over the windows so far, against the reference.

    Attributes
    ----------
    kl : list of float64 tensors
        Each window's per-position KL divergence (nats).
    top1 : list of bool tensors
        Each window's per-position top-1 agreement.
    nll : list of float64 tensors
        Each window's per-position negative log-likelihood of the text's next token (nats).
    """

    kl: list[torch.Tensor] = field(default_factory=list)
    top1: list[torch.Tensor] = field(default_factory=list)
    nll: list[torch.Tensor] = field(default_factory=list)

    def add(self, reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """One window's scored positions: ``reference`` and ``logits`` ``[n, vocab]``, ``targets`` int64 ``[n]``."""
        kl, top1 = kl_top1(reference.to(logits.device), logits)
        self.kl.append(kl)
        self.top1.append(top1)
        self.nll.append(_nll(logits, targets))  # perplexity's own float64 NLL: the same PPL as `tessera perplexity`

    def summary(self) -> dict[str, float | int]:
        """``ppl``, ``stderr`` (llama.cpp's), ``nll``, ``kl_mean``, ``kl_p99`` (the 99th percentile over positions,
        linear interpolation), ``kl_max``, ``top1`` (fraction) and ``n_scored``."""
        if not self.kl:
            raise ValueError("Divergence: no window added")
        kl = torch.cat(self.kl).numpy()
        nll = torch.cat(self.nll)
        n = int(nll.numel())
        mean = float(nll.mean())
        ppl = math.exp(mean)
        variance = float((nll * nll).mean()) - mean * mean
        stderr = ppl * math.sqrt(variance / (n - 1)) if n > 1 and variance > 0 else math.nan
        return {"ppl": ppl, "stderr": stderr, "nll": mean, "kl_mean": float(kl.mean()),
                "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
                "top1": float(torch.cat(self.top1).double().mean()), "n_scored": n}


class ReferenceLogits:
    """The reference's float32 logits at the scored positions of every window, kept for the formats that follow.

    Parameters
    ----------
    windows : int
        Windows to hold.
    rows : int
        Scored positions per window.
    vocab : int
        Logits per position.
    memory_limit : int
        Bytes kept in memory; a larger store is a temporary file (deleted by :meth:`close`).
    """

    def __init__(self, windows: int, rows: int, vocab: int, memory_limit: int = DEFAULT_MEMORY_LIMIT) -> None:
        shape = (windows, rows, vocab)
        self.nbytes = windows * rows * vocab * 4
        self._dir: tempfile.TemporaryDirectory | None = None
        if self.nbytes <= memory_limit:
            self._data = np.empty(shape, dtype=np.float32)
        else:
            self._dir = tempfile.TemporaryDirectory(prefix="tessera-quant-report-")
            self._data = np.lib.format.open_memmap(Path(self._dir.name) / "reference.npy", mode="w+",
                                                   dtype=np.float32, shape=shape)

    @property
    def spilled(self) -> bool:
        """Whether the logits live in a temporary file."""
        return self._dir is not None

    def put(self, window: int, logits: torch.Tensor) -> None:
        """Store window ``window``'s scored logits ``[rows, vocab]`` (float32, exactly)."""
        self._data[window] = logits.detach().to("cpu", torch.float32).numpy()

    def get(self, window: int) -> torch.Tensor:
        """Window ``window``'s stored logits, float32 ``[rows, vocab]`` on the CPU."""
        return torch.from_numpy(np.ascontiguousarray(self._data[window]))

    def close(self) -> None:
        """Drop the logits (and the temporary file)."""
        self._data = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> ReferenceLogits:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
