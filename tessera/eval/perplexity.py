"""Perplexity of a model over a text, by the protocol of llama.cpp's ``llama-perplexity``, so the two figures compare
on the same file and context size.

The protocol:

1. The whole text is tokenized once, the way llama.cpp does it: the tokenizer's own BOS in front when the vocabulary
   adds one (and no EOS: vocabularies that append one are refused, as llama.cpp refuses them), the text of control
   tokens (``<|im_start|>``, ``</s>``) read as plain text rather than as those tokens.
2. The tokens are cut from the start into non-overlapping windows ("chunks") of ``ctx`` tokens. A partial window at
   the end is dropped, and so is every window past ``max_chunks``. The text must hold at least ``2 * ctx`` tokens
   (llama.cpp's minimum).
3. When the vocabulary adds BOS, each window's first token is replaced by BOS.
4. Each window runs from an empty context. With ``first = ctx // 2``, the logits at positions ``first .. ctx - 2``
   score the tokens at ``first + 1 .. ctx - 1``: ``ctx - 1 - first`` predictions per window, each with at least
   half a window of context before it.
5. Over the ``N`` scored tokens with negative log-likelihoods ``x_i`` (natural log, from a float64 log-softmax of the
   model's logits), ``PPL = exp(mean(x))`` and its standard error is ``PPL * sqrt((mean(x^2) - mean(x)^2) / (N - 1))``,
   the standard error of the mean NLL carried through ``exp`` to first order. The running estimate after each window
   is the same formula over the windows so far.

>>> from tessera.models.load import load_model
>>> result = perplexity(load_model(), text, ctx=512, max_chunks=40)   # doctest: +SKIP
>>> print(f"PPL = {result.ppl:.4f} +/- {result.stderr:.5f}")          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tessera.models.model import Model

#: rows of float64 log-softmax computed at once: bounds the float64 copy of the logits to ROWS x vocab
ROWS = 128


@dataclass(frozen=True)
class RunningPPL:
    """The estimate over the first ``chunks`` windows (what llama.cpp prints as ``[chunks]ppl``)."""

    chunks: int
    ppl: float
    stderr: float


@dataclass(frozen=True)
class PerplexityResult:
    """One perplexity measurement.

    Attributes
    ----------
    ppl : float
        ``exp`` of the mean negative log-likelihood of the scored tokens.
    stderr : float
        Standard error of ``ppl`` (llama.cpp's ``+/-``); NaN with fewer than two scored tokens or no spread.
    nll : float
        Mean negative log-likelihood, nats per scored token.
    n_tokens : int
        Tokens of the whole text (BOS included when the vocabulary adds it).
    n_scored : int
        Tokens scored: ``n_chunks * (ctx - 1 - ctx // 2)``.
    n_chunks : int
        Windows evaluated.
    ctx : int
        Tokens per window.
    add_bos : bool
        Whether each window started with BOS.
    seconds : float
        Wall time of the windows' forward passes and scoring (tokenizing excluded).
    tokenize_seconds : float
        Wall time of tokenizing the text (0 when token ids were given).
    running : list of RunningPPL
        The estimate after each window, ``running[-1]`` being the final one.
    """

    ppl: float
    stderr: float
    nll: float
    n_tokens: int
    n_scored: int
    n_chunks: int
    ctx: int
    add_bos: bool
    seconds: float
    tokenize_seconds: float
    running: list[RunningPPL]

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``running`` as a list of dicts)."""
        return dataclasses.asdict(self)


def perplexity(model: Model, text: str | None = None, *, token_ids: Sequence[int] | torch.Tensor | None = None,
               ctx: int = 512, max_chunks: int | None = None, batch: int = 1, add_bos: bool | None = None,
               on_chunk: Callable[[RunningPPL, int], None] | None = None,
               kv_cache_dtype: str | None = None) -> PerplexityResult:
    """Perplexity of ``model`` over ``text`` (or its tokens) by llama.cpp's protocol (see the module docstring).

    Parameters
    ----------
    model : Model
        A loaded model; its tokenizer encodes ``text`` and says whether the vocabulary adds BOS.
    text : str, optional
        The text (exactly one of ``text`` and ``token_ids``). A file read with
        :func:`tessera.eval.corpus.read_text` gives the text llama.cpp reads from the same file.
    token_ids : sequence of int or int tensor ``[n]``, optional
        The already tokenized text, BOS in front if the vocabulary adds one.
    ctx : int
        Tokens per window (llama.cpp's ``-c``), at least 3 and at most the model's ``max_position``.
    max_chunks : int, optional
        Evaluate at most this many windows (llama.cpp's ``--chunks``); default: every whole window.
    batch : int
        Windows per forward pass (more is faster on wide machines; the float32 logits of ``batch * ctx`` positions
        are held at once).
    add_bos : bool, optional
        Replace each window's first token by BOS. Default: when the model's tokenizer adds BOS (llama.cpp's rule);
        False for a model without a tokenizer.
    on_chunk : callable, optional
        Called after each window as ``on_chunk(running, n_chunks)`` (a progress bar's hook).
    kv_cache_dtype : str, optional
        ``"int8"`` or ``"fp8_e4m3"``: run each window through a paged KV cache in that format
        (:class:`tessera.eval.cache_logits.CacheLogits`: every K/V the attention reads is quantized, as in the
        engine), to measure the format's cost. Default: ``Model.logits`` (K/V in the model's dtype; the same
        numbers as the paged path with an unquantized cache).

    Returns
    -------
    PerplexityResult

    Raises
    ------
    ValueError
        Bad ``ctx`` / ``max_chunks`` / ``batch``, a text shorter than two windows, a vocabulary that appends EOS, or
        BOS asked for with no BOS token known.
    TypeError
        Neither or both of ``text`` and ``token_ids``, or token ids that are not a 1-D integer sequence.
    """
    check_window_sizes(model, ctx, max_chunks, batch, where="perplexity")
    if kv_cache_dtype is not None:
        from tessera.eval.cache_logits import CacheLogits
        from tessera.kv.quantized import check_format

        window_logits = CacheLogits(model, check_format(kv_cache_dtype, "perplexity"))
    else:
        window_logits = model.logits
    ctx, batch = int(ctx), int(batch)
    cut = cut_windows(model, text, token_ids, ctx=ctx, max_chunks=max_chunks, add_bos=add_bos, where="perplexity")
    windows, n_chunks, bos = cut.ids, cut.ids.shape[0], cut.bos
    first = ctx // 2
    start = time.perf_counter()
    sums = _Sums()
    running: list[RunningPPL] = []
    for lo in range(0, n_chunks, batch):
        block = windows[lo: lo + batch]
        logits = window_logits(block)  # [b, ctx, vocab] float32, on the model's device
        for row in range(block.shape[0]):
            sums.add(_nll(logits[row, first: ctx - 1], block[row, first + 1:]))
            ppl, stderr = sums.estimate()
            running.append(RunningPPL(lo + row + 1, ppl, stderr))
            if on_chunk is not None:
                on_chunk(running[-1], n_chunks)
        del logits
    ppl, stderr = sums.estimate()
    return PerplexityResult(ppl=ppl, stderr=stderr, nll=sums.total / sums.count, n_tokens=cut.n_tokens,
                            n_scored=sums.count, n_chunks=n_chunks, ctx=ctx, add_bos=bos is not None,
                            seconds=time.perf_counter() - start, tokenize_seconds=cut.tokenize_seconds,
                            running=running)


@dataclass(frozen=True)
class Windows:
    """A text cut into scoring windows (steps 1-3 of the module docstring).

    Attributes
    ----------
    ids : int64 tensor ``[n_chunks, ctx]``
        The windows, BOS first when ``bos`` is set.
    n_tokens : int
        Tokens of the whole text.
    bos : int or None
        The token each window starts with, or None when windows are left as cut.
    tokenize_seconds : float
        Wall time of tokenizing the text (0 when token ids were given).
    """

    ids: torch.Tensor
    n_tokens: int
    bos: int | None
    tokenize_seconds: float


def cut_windows(model: Model, text: str | None = None, token_ids: Sequence[int] | torch.Tensor | None = None, *,
                ctx: int, max_chunks: int | None = None, add_bos: bool | None = None,
                where: str = "perplexity") -> Windows:
    """Tokenize ``text`` (or take its ``token_ids``) and cut it into windows of ``ctx`` tokens as
    :func:`perplexity` scores them; ``where`` prefixes the error messages (the caller's name).

    Raises
    ------
    TypeError
        Neither or both of ``text`` and ``token_ids``, or token ids that are not a 1-D integer sequence.
    ValueError
        A model without a tokenizer given text, fewer than ``2 * ctx`` tokens, or a token id outside the model's
        vocabulary.
    """
    started = time.perf_counter()
    if (text is None) == (token_ids is None):
        raise TypeError(f"{where}: pass exactly one of text and token_ids")
    if text is not None:
        if model.tokenizer is None:
            raise ValueError(f"{where}: the model has no tokenizer; tokenize the text elsewhere and pass token_ids")
        tokens = torch.tensor(tokenize(model.tokenizer, text), dtype=torch.int64)
    else:
        tokens = _as_ids(token_ids)
    tokenize_seconds = time.perf_counter() - started if text is not None else 0.0
    bos = _bos_for_windows(model, add_bos)
    if tokens.numel() < 2 * ctx:
        raise ValueError(f"{where}: a context of {ctx} needs at least {2 * ctx} tokens (two windows, "
                         f"llama-perplexity's minimum); the text has {tokens.numel()}")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= model.config.vocab_size:
        raise ValueError(f"{where}: token ids must lie in [0, {model.config.vocab_size}) (the model's vocabulary), "
                         f"got [{low}, {high}]; was the text tokenized for another model?")
    n_chunks = tokens.numel() // ctx  # the partial window at the end is never scored
    if max_chunks is not None:
        n_chunks = min(n_chunks, int(max_chunks))
    windows = tokens[: n_chunks * ctx].view(n_chunks, ctx).clone()  # [n_chunks, ctx] int64
    if bos is not None:
        windows[:, 0] = bos
    return Windows(windows, int(tokens.numel()), bos, tokenize_seconds)


def tokenize(tokenizer: Any, text: str) -> list[int]:
    """``text`` encoded as llama.cpp encodes it for perplexity: the tokenizer's BOS / EOS rule applied, control
    tokens' text (``</s>``) read as plain text, user-defined tokens matched whole.

    Parameters
    ----------
    tokenizer : tokenizers.Tokenizer
        The model's tokenizer (GGUF files and Hugging Face directories both give one).
    text : str
        The text.

    Returns
    -------
    list of int
        Token ids, BOS first when the vocabulary adds it.
    """
    # llama.cpp tokenizes with parse_special=false: a control token's spelling in the text is ordinary text. The
    # tokenizers library does the same for its "special" added tokens (GGUF control tokens) with this switch.
    # It is a property of the shared tokenizer, so it is put back afterwards.
    before = getattr(tokenizer, "encode_special_tokens", None)
    if before is not None:
        tokenizer.encode_special_tokens = True
    try:
        return list(tokenizer.encode(text).ids)
    finally:
        if before is not None:
            tokenizer.encode_special_tokens = before


def bos_token(tokenizer: Any) -> int | None:
    """The id the tokenizer puts in front of every text (its BOS), or None when it adds nothing there.

    Raises
    ------
    ValueError
        When the tokenizer appends a token (EOS) or prepends several: llama-perplexity refuses such vocabularies,
        since a trailing EOS would be scored as part of the text.
    """
    probe = "perplexity"
    plain = list(tokenizer.encode(probe, add_special_tokens=False).ids)
    full = list(tokenizer.encode(probe).ids)
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i: i + len(plain)] == plain), None)
    if at is None or len(full) - at - len(plain) > 0 or at > 1:
        raise ValueError(f"perplexity: the tokenizer adds {full[:at] if at else []} before and "
                         f"{full[at + len(plain):] if at is not None else full} after a text; only a single BOS in "
                         "front is supported (llama-perplexity refuses vocabularies that append EOS)")
    return full[0] if at == 1 else None


def _bos_for_windows(model: Model, add_bos: bool | None) -> int | None:
    """The token each window starts with, or None to leave windows as cut."""
    tokenizer_bos = bos_token(model.tokenizer) if model.tokenizer is not None else None
    if add_bos is None:
        return tokenizer_bos
    if not add_bos:
        return None
    bos = tokenizer_bos if tokenizer_bos is not None else model.config.bos_token_id
    if bos is None:
        raise ValueError("perplexity: add_bos=True but neither the tokenizer nor the config names a BOS token")
    return int(bos)


def check_window_sizes(model: Model, ctx: int, max_chunks: int | None, batch: int, where: str = "perplexity") -> None:
    """Raise ValueError naming the bad value unless ``ctx`` (3 ..  the model's positions), ``max_chunks`` (None or
    positive) and ``batch`` (positive) are usable ints."""
    if not is_int(ctx) or ctx < 3:
        # ctx // 2 tokens of context, then at least one scored prediction before the window's last token
        raise ValueError(f"{where}: ctx must be an int >= 3 (a window scores ctx - 1 - ctx // 2 tokens), "
                         f"got {ctx!r}")
    if ctx > model.config.max_position:
        raise ValueError(f"{where}: ctx {ctx} exceeds the model's {model.config.max_position} positions")
    if max_chunks is not None and (not is_int(max_chunks) or max_chunks < 1):
        raise ValueError(f"{where}: max_chunks must be a positive int or None, got {max_chunks!r}")
    if not is_int(batch) or batch < 1:
        raise ValueError(f"{where}: batch must be a positive int, got {batch!r}")


def is_int(value: object) -> bool:
    """An integer (Python's or NumPy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_ids(token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Token ids as a 1-D int64 CPU tensor."""
    if isinstance(token_ids, torch.Tensor):
        ids = token_ids
    else:
        values = list(token_ids)  # an empty list would otherwise become a float tensor and read as the wrong error
        ids = torch.as_tensor(values) if values else torch.zeros(0, dtype=torch.int64)
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"perplexity: token_ids must be a 1-D sequence of ints, got {ids.dtype} "
                        f"{tuple(ids.shape)}")
    return ids.to("cpu", torch.int64)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of ``targets`` under ``logits``.

    Parameters
    ----------
    logits : float tensor ``[n, vocab]``
        One window's logits at the scored positions (any float dtype, any device).
    targets : int64 tensor ``[n]``
        The token that follows each of those positions.

    Returns
    -------
    float64 tensor ``[n]`` on the CPU, ``logsumexp(logits) - logits[target]`` per row.
    """
    targets = targets.to(logits.device)
    out = []
    for lo in range(0, logits.shape[0], ROWS):  # float64 ROWS x vocab at a time, not the whole half window
        rows = logits[lo: lo + ROWS].to(torch.float64)
        picked = rows.gather(1, targets[lo: lo + ROWS, None]).squeeze(1)
        out.append(torch.logsumexp(rows, dim=1) - picked)
    return torch.cat(out).cpu()


class _Sums:
    """Running sums of the NLL and its square, in float64, for the estimate after each window."""

    def __init__(self) -> None:
        self.total = 0.0
        self.squares = 0.0
        self.count = 0

    def add(self, nll: torch.Tensor) -> None:
        self.total += float(nll.sum())
        self.squares += float((nll * nll).sum())
        self.count += int(nll.numel())

    def estimate(self) -> tuple[float, float]:
        """``(ppl, stderr)`` over the tokens so far (stderr NaN below two tokens or with no spread)."""
        mean = self.total / self.count
        ppl = math.exp(mean)
        variance = self.squares / self.count - mean * mean
        if self.count < 2 or variance <= 0:
            return ppl, math.nan
        return ppl, ppl * math.sqrt(variance / (self.count - 1))
