"""Incremental detokenization that only ever emits whole characters, and stop-string matching."""

from __future__ import annotations

from typing import Any

# Tokens of the prompt decoded alongside the output: tokenizers that drop a leading space when a piece starts the
# text (SentencePiece) then render the first output token as they would in context.
_CONTEXT_TOKENS = 4
_REPLACEMENT = "\ufffd"


class Detokenizer:
    """Turns one request's output tokens into text, a delta at a time, UTF-8 safe.

    Byte-level tokenizers split one character over several tokens; decoding a prefix of them yields U+FFFD. The
    delta is held back until the decoded window no longer ends in U+FFFD, so no partial character is ever emitted.
    Each step decodes only a short window (``ids[prefix:]``), not the whole output.

    Parameters
    ----------
    tokenizer : a ``tokenizers.Tokenizer`` (``decode(ids, skip_special_tokens=...)``), or None (text stays "").
    prompt_ids : the prompt's token ids (its last few give the decoding context).
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # window start: decoded text of ids[prefix:read] was already emitted (or is context)
        self._read = len(self._ids)

    def step(self, token_id: int) -> str:
        """Add one generated token; return the newly completed text (possibly "")."""
        if self.tokenizer is None:
            return ""
        self._ids.append(int(token_id))
        done = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if len(full) <= len(done) or full.endswith(_REPLACEMENT):
            return ""  # an incomplete character (or a token with no text yet): wait for the next token
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(done):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


def find_stop(text: str, stops: list[str], new_chars: int) -> int | None:
    """Index in ``text`` where the earliest stop string starts, looking only at matches touching the last
    ``new_chars`` characters (earlier text was checked before); None when there is none."""
    best = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        at = text.find(stop, start)
        if at >= 0 and (best is None or at < best):
            best = at
    return best
