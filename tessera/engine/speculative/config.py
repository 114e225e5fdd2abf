"""What kind of speculation an engine runs: ``"ngram"``, ``"draft:PATH"`` or ``"self:FORMAT"``, and how many tokens."""

from __future__ import annotations

from dataclasses import dataclass

#: a verified sequence runs 1 + k query tokens; 8 is the most the attention backends treat as decode-shaped
MAX_NUM_DRAFT = 7
#: the packed formats a quantized self-draft may use, by the names users know (GGUF's) and tessera's own
SELF_FORMATS = {"q4_0": ("int4", 32), "q4_1": ("int4_min", 32), "q8_0": ("int8", 32),
                "int4": ("int4", 32), "int4_min": ("int4_min", 32), "int8": ("int8", 32)}
METHODS = ("ngram", "draft", "self")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How the engine drafts tokens.

    Attributes
    ----------
    method : ``"ngram"`` (prompt lookup: continue the latest earlier occurrence of the last n tokens),
        ``"draft"`` (a smaller checkpoint with the same vocabulary) or ``"self"`` (the target's own weights
        quantized to ``self_format``).
    num_draft : the most tokens drafted per sequence and step, 1..7; the adaptive controller drafts fewer (down to
        none) when the measured acceptance rate makes them a loss.
    draft_path : the draft checkpoint (``method="draft"``).
    self_format : ``q4_0`` / ``q4_1`` / ``q8_0`` (or ``int4`` / ``int4_min`` / ``int8``), group 32 (``method="self"``).
    ngram_max, ngram_min : the longest and shortest suffix the n-gram proposer matches. One-token suffixes are
        off by default: in open-ended text almost every token occurred before, and what followed it then rarely
        follows it now, so those drafts are mostly rejected work.
    adaptive : choose each sequence's k from its acceptance rate and the measured step costs; False always drafts
        ``num_draft``.
    """

    method: str
    num_draft: int = 4
    draft_path: str | None = None
    self_format: str | None = None
    ngram_max: int = 3
    ngram_min: int = 2
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative: method must be one of {list(METHODS)}, got {self.method!r}")
        if isinstance(self.num_draft, bool) or not isinstance(self.num_draft, int) or not (
                1 <= self.num_draft <= MAX_NUM_DRAFT):
            raise ValueError(f"speculative: num_draft must be an int in [1, {MAX_NUM_DRAFT}] (a verified sequence "
                             f"runs 1 + num_draft query tokens), got {self.num_draft!r}")
        if self.method == "draft" and not self.draft_path:
            raise ValueError("speculative: method 'draft' needs draft_path (a GGUF file or checkpoint directory "
                             "with the target's vocabulary), e.g. 'draft:/models/small.gguf'")
        if self.method == "self" and self.self_format not in SELF_FORMATS:
            raise ValueError(f"speculative: method 'self' needs self_format, one of {list(SELF_FORMATS)}, "
                             f"got {self.self_format!r}, e.g. 'self:q4_0'")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"speculative: need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")


def parse_speculative(spec: str | SpeculativeConfig | None, num_draft: int | None = None
                      ) -> SpeculativeConfig | None:
    """``"ngram"``, ``"draft:PATH"``, ``"self:FORMAT"`` (the CLI's ``--speculative``) or a config -> a config; None
    and ``"off"`` -> None. ``num_draft`` overrides the config's when given."""
    if spec is None or spec == "off":
        return None
    if isinstance(spec, SpeculativeConfig):
        if num_draft is None:
            return spec
        return SpeculativeConfig(spec.method, num_draft, spec.draft_path, spec.self_format, spec.ngram_max,
                                 spec.ngram_min, spec.adaptive)
    if not isinstance(spec, str):
        raise TypeError(f"speculative must be a string ('ngram', 'draft:PATH', 'self:FORMAT') or a "
                        f"SpeculativeConfig, got {type(spec).__name__}")
    method, _, arg = spec.partition(":")
    extra = {} if num_draft is None else {"num_draft": num_draft}
    if method == "ngram" and not arg:
        return SpeculativeConfig("ngram", **extra)
    if method == "draft":
        return SpeculativeConfig("draft", draft_path=arg or None, **extra)
    if method == "self":
        return SpeculativeConfig("self", self_format=arg.lower() or None, **extra)
    raise ValueError(f"speculative: expected 'ngram', 'draft:PATH' or 'self:FORMAT' "
                     f"(FORMAT one of {list(SELF_FORMATS)}), got {spec!r}")
