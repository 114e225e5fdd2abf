"""What a request asks for (:class:`SamplingParams`) and what it gets back (:class:`RequestOutput`)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

from tessera.kernels.sampling import SamplerParams

#: the most alternatives per token a request may ask for (OpenAI's limit)
MAX_TOP_LOGPROBS = 20
#: fields that must be real numbers (an int or a float, NumPy's too; not a bool, not a numeric string)
NUMBER_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
#: fields that must be ints (not bools, not floats); max_tokens, n and top_logprobs check type and range together
INT_FIELDS = ("top_k",)
#: fields that must be bools
BOOL_FIELDS = ("ignore_eos", "logprobs", "speculative", "json_object")
#: the structured-output fields; at most one may be set
CONSTRAINT_FIELDS = ("json_schema", "regex", "grammar", "json_object")


def _check_types(params: SamplingParams) -> None:
    """Raise TypeError naming the first field whose value has the wrong type.

    Runs before the range checks, which would otherwise fail with a bare comparison error ("'>=' not supported
    between 'str' and 'int'") that does not say which field is wrong.
    """
    name = type(params).__name__
    for field_name in NUMBER_FIELDS:
        value = getattr(params, field_name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            default = type(params).__dataclass_fields__[field_name].default
            raise TypeError(f"{name}.{field_name} must be a number (int or float), got {type(value).__name__} "
                            f"{value!r}; pass a number, e.g. {field_name}={default!r} (the default)")
    for field_name in INT_FIELDS:
        value = getattr(params, field_name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}.{field_name} must be an int, got {type(value).__name__} {value!r}")
    for field_name in BOOL_FIELDS:
        value = getattr(params, field_name)
        if not isinstance(value, bool):
            raise TypeError(f"{name}.{field_name} must be True or False, got {type(value).__name__} {value!r}")


@dataclass(slots=True)
class SamplingParams(SamplerParams):
    """The sampler's parameters plus when to stop and what to report (vLLM names).

    Attributes
    ----------
    temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, seed :
        As :class:`tessera.kernels.sampling.SamplerParams` (temperature 0 = greedy).
    max_tokens : int >= 1; generated tokens at most (finish_reason "length").
    stop : strings that end generation when they appear in the text; the stop string is trimmed from the text.
    stop_token_ids : token ids that end generation (besides the model's EOS unless ``ignore_eos``); the token is
        kept in ``token_ids`` but not in the text.
    ignore_eos : keep generating past the model's EOS tokens.
    logprobs : report each generated token's log-probability under the model's distribution: the log-softmax of
        the logits before penalties, temperature and top-k/top-p/min-p filtering (what OpenAI's API and vLLM report;
        a greedy token's logprob is then its real probability, not 0).
    top_logprobs : also report the ``top_logprobs`` most likely tokens of that distribution at each step (0..20);
        implies ``logprobs``.
    n : independent samples of the prompt (parallel sampling). The prompt is computed once; the samples share its KV
        pages and copy a shared partial page only when they first write to it. With a seed, sample ``i`` draws from
        its own generator seeded ``seed + i`` (so it equals a request with that seed and ``n = 1``).
    speculative : let the engine's speculative decoding draft tokens for this request (when the engine has a
        proposer, ``LLM(speculative=...)``); False opts this request out. Greedy outputs are the same either way;
        sampled outputs are distributed the same (docs/speculative.md). Constrained requests (below) are not drafted.
    json_schema : structured output: the text is JSON valid under this JSON schema (a dict, or its JSON text), written
        compactly (no whitespace between tokens). Supports objects (properties, required, additionalProperties),
        arrays (items, prefixItems, min/maxItems), strings (enum, const, pattern, formats, min/maxLength), numbers
        and integers (minimum, maximum, exclusive bounds), anyOf / oneOf / allOf, ``$ref`` / ``$defs``.
    regex : structured output: the whole text matches this regular expression (Rust regex syntax, anchored at both
        ends).
    grammar : structured output: the text is a sentence of this context-free grammar, in Lark syntax (llguidance's
        dialect: ``start: ...``; ``%json {...}`` embeds a JSON schema) or llama.cpp's GBNF (``root ::= ...``).
    json_object : structured output: the text is a JSON object (any keys and values).

    At most one of the four may be set. Each is checked when the params are made (a ValueError names the field and
    the problem). A constrained request finishes with "stop" as soon as its text is complete (no EOS needed), with
    "length" at ``max_tokens`` (the text is then an unfinished prefix), and with "grammar" in the rare case that
    the grammar allows no token at all (the parser's limits; no text outside the grammar is ever emitted).

    Examples
    --------
    >>> SamplingParams(temperature=0.0, max_tokens=32, stop=["\\n\\n"])
    """

    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    speculative: bool = True
    json_schema: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    #: the llguidance grammar text the constraint compiles to (None when unconstrained); set by validation
    grammar_source: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_types(self)
        SamplerParams.__post_init__(self)  # zero-arg super() breaks in slotted dataclasses
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) or not (
                0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"SamplingParams.top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got "
                             f"{self.top_logprobs!r}")
        if self.top_logprobs:
            self.logprobs = True
        if isinstance(self.stop, str):
            self.stop = [self.stop]  # a lone string is a common slip; it means one stop string
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        self.grammar_source = _constraint_grammar(self)
        if self.grammar_source is not None:
            self.speculative = False  # drafts are not checked against the grammar


def _constraint_grammar(params: SamplingParams) -> str | None:
    """The llguidance grammar of ``params``' structured-output field, or None when it has none.

    Raises
    ------
    ValueError
        More than one constraint is set, or the one set is invalid (the message names it and says why).
    """
    given = [name for name in CONSTRAINT_FIELDS if getattr(params, name) not in (None, False)]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"SamplingParams: {', '.join(given)} are set; structured output takes one constraint, "
                         "so keep one of them")
    (name,) = given
    value = getattr(params, name)
    if name in ("regex", "grammar") and (not isinstance(value, str) or not value.strip()):
        raise TypeError(f"SamplingParams.{name} must be a non-empty string, got {type(value).__name__} {value!r}")
    from tessera.engine.structured.compiler import grammar_text, schema_text

    if name == "json_schema":
        return grammar_text(name, schema_text(value))
    return grammar_text(name, "" if name == "json_object" else value)


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` samples of a request (see :attr:`RequestOutput.outputs`)."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(slots=True)
class RequestOutput:
    """One finished (or, while streaming, in-progress) request.

    Attributes
    ----------
    request_id : index of the prompt in the ``generate`` call.
    prompt_tokens : the prompt's token ids.
    token_ids : generated token ids only (a stop token id is included, a stop string's tokens too).
    text : detokenized generated text, stop string trimmed ("" when the model has no tokenizer).
    finish_reason : "stop" (EOS, stop token, stop string, or a structured output's text complete), "length"
        (max_tokens or context full), "grammar" (a structured output's grammar allowed no token), "abort"
        (:meth:`LLM.abort`), or None while running.
    logprobs : each generated token's log-probability under the model's distribution (if asked; see
        :class:`SamplingParams`).
    top_logprobs : per generated token, the ``top_logprobs`` most likely ``(token id, logprob)`` pairs, most likely
        first (if asked).
    num_cached_tokens : prompt tokens served from the prefix cache at the first admission.
    num_preemptions : times the request was preempted and recomputed.
    time_to_first_token, latency : seconds from arrival to the first token and to the finish (of the last sample).
    outputs : every sample, ``n`` of them (``SamplingParams.n``); ``token_ids``, ``text``, ``finish_reason`` and
        ``logprobs`` above are those of ``outputs[0]``.
    """

    request_id: int
    prompt_tokens: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    time_to_first_token: float | None = None
    latency: float | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        if self.outputs:
            return all(o.finish_reason is not None for o in self.outputs)
        return self.finish_reason is not None
