"""What each weight format and KV cache format costs in quality, memory and speed, on one model and one text.

Every row is measured on the same windows of the same text, by llama-perplexity's protocol
(:mod:`tessera.eval.perplexity`: non-overlapping windows of ``ctx`` tokens, BOS per the vocabulary, the second half
of each window scored). Against the float32 reference (the model's weights in float32; a GGUF file's packed blocks
de-quantized to their exact values) each row reports:

- perplexity and its standard error;
- the KL divergence ``KL(P_ref || P)`` of the next-token distribution at each scored position, its mean and 99th
  percentile, computed in float64 from the two models' float32 logits (:mod:`tessera.eval.divergence`);
- top-1 agreement: the fraction of scored positions whose most likely token is the reference's;
- bytes per weight of the projections and token tables as held, and the bytes of all the model's weights
  (:mod:`tessera.eval.weight_bytes`);
- batch-1 greedy decode tokens/s in the engine (:mod:`tessera.eval.decode_speed`).

The formats are those of :mod:`tessera.eval.quant_formats`. The reference runs first; its logits at the scored
positions are kept (:class:`~tessera.eval.divergence.ReferenceLogits`) and each other model is then built, measured
window by window against them, and dropped, so at most the reference and one other model are in memory.

>>> report = quant_report(None, corpus_text("pydoc"), ctx=512, chunks=8)       # doctest: +SKIP
>>> report.row("int8").kl_mean                                                   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.eval.decode_speed import decode_speed
from tessera.eval.divergence import DEFAULT_MEMORY_LIMIT, Divergence, ReferenceLogits
from tessera.eval.perplexity import check_window_sizes, cut_windows, is_int
from tessera.eval.quant_formats import (DEFAULT_GROUP_SIZE, QUANTIZED_KV, REFERENCE, WEIGHT_FORMATS, RowSpec,
                                        build_model, check_group_size, dtype_name, is_gguf, load_reference,
                                        parse_formats, parse_kv_formats)
from tessera.eval.weight_bytes import weight_bytes
from tessera.models.model import Model, default_model_path

#: windows evaluated by default: a report on SmolLM2 in minutes on two cores
DEFAULT_CHUNKS = 8
#: prompt tokens of the decode measurement (the text's first tokens)
DEFAULT_PROMPT_TOKENS = 16

#: ``on_step(row, what, done, total)``: ``what`` is "build", "window" or "decode"
StepHook = Callable[[str, str, int, int], None]


@dataclass(frozen=True)
class QuantRow:
    """One format's measurements (see the module docstring).

    Attributes
    ----------
    name : str
        ``"int8"``, or ``"bf16 + int8 KV"`` for a KV row.
    weights : str
        The weight format (:data:`tessera.eval.quant_formats.WEIGHT_FORMATS`).
    kv_cache : str
        What the attention read K/V from: the model's dtype (``"fp32"``, ``"bf16"``), ``"int8"`` or ``"fp8_e4m3"``.
    paged_kv : bool
        Whether the windows ran through a paged KV cache (KV rows) or ``Model.logits`` (weight rows).
    ppl, stderr, nll : float
        Perplexity, its standard error, mean negative log-likelihood (nats per scored token).
    kl_mean, kl_p99, kl_max : float
        KL divergence from the reference per scored position (nats): mean, 99th percentile, maximum.
    top1 : float
        Fraction of scored positions whose argmax is the reference's.
    n_scored : int
        Scored positions.
    bytes_per_weight : float
        Bytes of the projections and token tables as held, per weight.
    matrix_bytes, matrix_params : int
        Those bytes and weights.
    model_bytes : int
        Bytes of every weight the model holds (summed tensor bytes, not the process's resident memory).
    held : dict of str to int
        Weights of the projections and tables per format as held (``{"Q4_1": ..., "Q8_0": ...}``).
    decode_tok_s : float or None
        Median batch-1 greedy decode tokens/s (None when not measured).
    decode_runs : list of float
        Each timed decode run's tokens/s.
    decode_others_busy : float or None
        Fraction of the machine's CPU time other processes used during those runs.
    build_seconds : float
        Time to load or quantize the model (0 for a row sharing the model of an earlier row).
    eval_seconds : float
        Time of the windows' forward passes and comparison.
    """

    name: str
    weights: str
    kv_cache: str
    paged_kv: bool
    ppl: float
    stderr: float
    nll: float
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1: float
    n_scored: int
    bytes_per_weight: float
    matrix_bytes: int
    matrix_params: int
    model_bytes: int
    held: dict[str, int]
    decode_tok_s: float | None
    decode_runs: list[float]
    decode_others_busy: float | None
    build_seconds: float
    eval_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class QuantReport:
    """Every row, and how they were measured.

    Attributes
    ----------
    rows : list of QuantRow
        The reference first, then the other weight formats, each followed by its KV rows.
    model : str
        The model source.
    ctx, n_chunks, n_scored, n_tokens : int
        Tokens per window, windows, scored positions, tokens of the whole text.
    add_bos : bool
        Whether each window started with BOS.
    group_size : int
        Group along K of int8 / int4 / int4_min.
    decode_tokens, decode_repeats, prompt_tokens : int
        The decode measurement's tokens per run, timed runs and prompt length (``decode_tokens`` 0: not measured).
    reference_bytes : int
        Bytes of the reference logits kept for the comparison.
    """

    rows: list[QuantRow]
    model: str
    ctx: int
    n_chunks: int
    n_scored: int
    n_tokens: int
    add_bos: bool
    group_size: int
    decode_tokens: int
    decode_repeats: int
    prompt_tokens: int
    reference_bytes: int

    def row(self, name: str) -> QuantRow:
        """The row called ``name`` (``"int8"``, ``"bf16 + int8 KV"``)."""
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no row {name!r}; the rows are {[r.name for r in self.rows]}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``rows`` as a list of dicts)."""
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rows"},
                "reference": REFERENCE, "rows": [r.to_dict() for r in self.rows]}


def quant_report(source: str | Path | None = None, text: str | None = None, *,
                 token_ids: Sequence[int] | torch.Tensor | None = None, ctx: int = 512,
                 chunks: int = DEFAULT_CHUNKS, formats: Iterable[str] | None = None,
                 kv_formats: Iterable[str] | None = None, group_size: int = DEFAULT_GROUP_SIZE,
                 decode_tokens: int = 32, decode_repeats: int = 3, prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
                 backend: str = "auto", device: str | None = None, on_step: StepHook | None = None,
                 on_row: Callable[[QuantRow], None] | None = None,
                 memory_limit: int = DEFAULT_MEMORY_LIMIT) -> QuantReport:
    """Measure every format of ``source`` on ``text`` (see the module docstring).

    Parameters
    ----------
    source : a GGUF file or Hugging Face directory; None for the default SmolLM2 GGUF
    text : the text (exactly one of ``text`` and ``token_ids``)
    token_ids : the text already tokenized (BOS in front when the vocabulary adds one)
    ctx : tokens per window, at least 3 and at most the model's positions
    chunks : windows evaluated (at most the text's whole windows)
    formats : weight formats (:data:`tessera.eval.quant_formats.WEIGHT_FORMATS`); None for all the source has. The
        fp32 reference is always measured.
    kv_formats : KV rows, ``WEIGHTS:KV`` each (:func:`tessera.eval.quant_formats.parse_kv_formats`); None for the
        defaults, ``[]`` for none
    group_size : group along K of int8 / int4 / int4_min: 32, 64 or 128
    decode_tokens : tokens per decode run; 0 skips the decode measurement
    decode_repeats : timed decode runs per row (after one warm-up run)
    prompt_tokens : the decode prompt: this many of the text's first tokens
    backend, device : as for :func:`tessera.models.load.load_model`
    on_step : ``on_step(row, what, done, total)`` as work proceeds (a progress bar's hook)
    on_row : called with each row as it is finished
    memory_limit : bytes of reference logits kept in memory; more go to a temporary file

    Returns
    -------
    QuantReport

    Raises
    ------
    ValueError
        An unknown format, a bad size, or a text shorter than two windows.
    TypeError
        Neither or both of ``text`` and ``token_ids``.
    FileNotFoundError
        A missing model source.
    """
    source = Path(source) if source is not None else default_model_path()
    if not source.exists():
        raise FileNotFoundError(f"quant-report: {source} does not exist")
    gguf = is_gguf(source)
    weight_formats = parse_formats(formats, gguf)
    kv_rows = parse_kv_formats(kv_formats, gguf)
    group_size = check_group_size(group_size)
    if (text is None) == (token_ids is None):
        raise TypeError("quant-report: pass exactly one of text and token_ids")
    for name, value, least in (("chunks", chunks, 1), ("decode_tokens", decode_tokens, 0),
                               ("decode_repeats", decode_repeats, 1), ("prompt_tokens", prompt_tokens, 1)):
        if not is_int(value) or value < least:
            raise ValueError(f"quant-report: {name} must be an int >= {least}, got {value!r}")
    if decode_tokens == 1:
        raise ValueError("quant-report: decode_tokens must be 0 (no decode measurement) or >= 2")
    step = on_step or (lambda *_: None)

    step(REFERENCE, "build", 0, 1)
    started = time.perf_counter()
    reference = load_reference(source, backend, device)
    reference_build = time.perf_counter() - started
    check_window_sizes(reference, ctx, chunks, 1, where="quant-report")
    cut = cut_windows(reference, text, token_ids, ctx=ctx, max_chunks=chunks, where="quant-report")
    windows, add_bos, n_tokens = cut.ids, cut.bos is not None, cut.n_tokens
    prompt = windows[0, :min(prompt_tokens, ctx)].tolist()
    first = ctx // 2
    targets = windows[:, first + 1:]
    n_chunks = windows.shape[0]

    plan = _plan(weight_formats, kv_rows)
    rows: list[QuantRow] = []
    speeds: dict[tuple[str, str | None], Any] = {}

    def finish(spec: RowSpec, model: Model, divergence: Divergence, build_s: float, eval_s: float) -> None:
        kv = None if spec.kv is None or spec.kv not in QUANTIZED_KV else spec.kv
        speed = None
        if decode_tokens:
            key = (spec.weights, kv)  # a float cache decodes as the weight row does: measured once
            if key not in speeds:
                step(spec.name, "decode", 0, 1)
                speeds[key] = decode_speed(model, prompt, decode_tokens, decode_repeats, kv_cache_dtype=kv)
            speed = speeds[key]
        counts = weight_bytes(model)
        row = QuantRow(name=spec.name, weights=spec.weights, kv_cache=spec.kv or dtype_name(model),
                       paged_kv=spec.kv is not None, **divergence.summary(),
                       bytes_per_weight=counts.bytes_per_weight, matrix_bytes=counts.matrix_bytes,
                       matrix_params=counts.matrix_params, model_bytes=counts.model_bytes, held=counts.held,
                       decode_tok_s=speed.tok_s if speed else None, decode_runs=list(speed.runs) if speed else [],
                       decode_others_busy=speed.others_busy if speed else None,
                       build_seconds=build_s, eval_seconds=eval_s)
        rows.append(row)
        if on_row is not None:
            on_row(row)

    vocab = reference.config.vocab_size
    with ReferenceLogits(n_chunks, ctx - 1 - first, vocab, memory_limit) as stored:
        for fmt, specs in plan:
            if fmt == REFERENCE:
                model, build_s = reference, reference_build
            else:
                step(fmt, "build", 0, 1)
                started = time.perf_counter()
                model = build_model(fmt, reference, source, group_size=group_size, backend=backend, device=device)
                build_s = time.perf_counter() - started
            for spec in specs:
                started = time.perf_counter()
                divergence = _evaluate(model, spec, windows, targets, first, stored,
                                       store=spec == RowSpec(REFERENCE), on_step=step)
                finish(spec, model, divergence, build_s, time.perf_counter() - started)
                build_s = 0.0  # the next row of this model did not build it
            if model is not reference:
                del model
                gc.collect()  # the next format's model replaces this one, not joins it
        reference_bytes = stored.nbytes
    return QuantReport(rows=rows, model=str(source), ctx=ctx, n_chunks=n_chunks, n_scored=rows[0].n_scored,
                       n_tokens=n_tokens, add_bos=add_bos, group_size=group_size, decode_tokens=decode_tokens,
                       decode_repeats=decode_repeats, prompt_tokens=len(prompt), reference_bytes=reference_bytes)


def _plan(weight_formats: list[str], kv_rows: list[RowSpec]) -> list[tuple[str, list[RowSpec]]]:
    """Each model to build, in :data:`WEIGHT_FORMATS` order, with its rows: its weight row (when asked for), then its
    KV rows. A model only KV rows need is built for them alone."""
    needed = set(weight_formats) | {r.weights for r in kv_rows}
    plan = []
    for fmt in WEIGHT_FORMATS:
        if fmt in needed:
            specs = [RowSpec(fmt)] if fmt in weight_formats else []
            plan.append((fmt, specs + [r for r in kv_rows if r.weights == fmt]))
    return plan


def _evaluate(model: Model, spec: RowSpec, windows: torch.Tensor, targets: torch.Tensor, first: int,
              stored: ReferenceLogits, *, store: bool, on_step: StepHook) -> Divergence:
    """One row's windows: each window's logits at the scored positions against the stored reference's (stored
    first when ``store``: the reference row)."""
    if spec.kv is None:
        window_logits = model.logits
    else:
        from tessera.eval.cache_logits import CacheLogits

        window_logits = CacheLogits(model, spec.kv if spec.kv in QUANTIZED_KV else None)
    divergence = Divergence()
    ctx = windows.shape[1]
    for i in range(windows.shape[0]):
        on_step(spec.name, "window", i, windows.shape[0])
        logits = window_logits(windows[i: i + 1])[0, first: ctx - 1]  # [ctx - 1 - first, vocab] float32
        if store:
            stored.put(i, logits)
        divergence.add(stored.get(i), logits, targets[i])
        del logits
    on_step(spec.name, "window", windows.shape[0], windows.shape[0])
    return divergence
