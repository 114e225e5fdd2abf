"""Speculative decoding: proposers draft tokens, one target forward verifies them, exact rejection sampling keeps
what the target would have produced. ``docs/speculative.md`` explains the design and the measured speed-ups."""

from tessera.engine.speculative.config import SpeculativeConfig, parse_speculative
from tessera.engine.speculative.decoder import SpeculativeDecoder
from tessera.engine.speculative.proposer import Draft, Proposer

__all__ = ["Draft", "Proposer", "SpeculativeConfig", "SpeculativeDecoder", "parse_speculative"]
