"""Grammars for llguidance: a request's constraint as llguidance grammar text, checked; tokenizers, cached.

llguidance (Microsoft's guidance project, Rust) computes the set of tokens that keep a text inside a grammar. It
needs two things: the grammar, here built from a JSON schema, a regular expression or a Lark / GBNF grammar, and the
tokenizer as bytes per token, which it preprocesses once (a token trie); that state is cached per tokenizer.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from functools import lru_cache
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

from tessera.engine.structured.vocab import token_bytes

#: tokenizers kept prepared (a server has one model; the tests load a few)
TOKENIZER_CACHE_SIZE = 4
#: compiled grammar texts kept; a server sees the same few schemas again and again
GRAMMAR_CACHE_SIZE = 256
#: JSON options: compact separators, no free whitespace. A grammar that allows any whitespace lets a model (a weak one
#: especially) emit newlines forever; OpenAI's strict mode output is compact too.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class _Wrapper:
    """What ``llguidance.LLTokenizer`` reads of a tokenizer: bytes per token (special tokens as ``0xFF`` + their
    text, llguidance's convention for tokens a grammar cannot spell), EOS, and an encoder for its own use."""

    def __init__(self, tokens: Any, eos_token_id: int, encode: Any = None) -> None:
        self.tokens = [b"\xff" + tokens.special[i].encode() if i in tokens.special else b
                       for i, b in enumerate(tokens.tokens)]
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        self.special_token_ids = sorted(tokens.special)
        self._encode = encode

    def __call__(self, text: str | bytes) -> list[int]:
        if self._encode is None:
            return []
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._encode(text))


def build_ll_tokenizer(tokens: Any, eos_token_ids: tuple[int, ...] | list[int],
                       encode: Any = None) -> llguidance.LLTokenizer:
    """llguidance's tokenizer from :class:`~tessera.engine.structured.vocab.TokenBytes` (uncached)."""
    wrapper = llguidance.TokenizerWrapper(_Wrapper(tokens, eos_token_ids[0], encode))
    return llguidance.LLTokenizer(wrapper, n_vocab=len(tokens.tokens), eos_token=list(eos_token_ids))


_tokenizers: OrderedDict[int, tuple[Any, Any]] = OrderedDict()
_tokenizers_lock = threading.Lock()


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer state for ``tokenizer``, built once per tokenizer object (~0.15 s for 49k tokens).

    Parameters
    ----------
    tokenizer : tokenizers.Tokenizer
        The model's tokenizer.
    vocab_size : int
        The model's vocabulary (its logits' width); ids past the tokenizer's own are never allowed.
    eos_token_ids : tuple of int
        The tokens that end generation; allowed where the grammar may end.
    """
    key = id(tokenizer)
    with _tokenizers_lock:
        hit = _tokenizers.get(key)
        if hit is not None and hit[0] is tokenizer:
            _tokenizers.move_to_end(key)
            return hit[1]
    if not eos_token_ids:
        raise ValueError("structured output: the model names no EOS token, so a grammar could never end; set "
                         "eos_token_id in its config")
    tokens = token_bytes(tokenizer)
    tokens.tokens.extend([b""] * (vocab_size - len(tokens.tokens)))
    built = build_ll_tokenizer(tokens, eos_token_ids,
                               lambda text: tokenizer.encode(text, add_special_tokens=False).ids)
    with _tokenizers_lock:
        _tokenizers[key] = (tokenizer, built)  # holding the tokenizer keeps its id from being reused
        while len(_tokenizers) > TOKENIZER_CACHE_SIZE:
            _tokenizers.popitem(last=False)
    return built


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def grammar_text(kind: str, source: str) -> str:
    """The llguidance grammar for one constraint, validated.

    Parameters
    ----------
    kind : "json_schema" (``source`` is the schema as JSON text), "json_object" (``source`` ignored), "regex" or
        "grammar" (Lark, as llguidance extends it, recognised by its ``start:`` rule, else llama.cpp's GBNF).
    source : the schema, expression or grammar text.

    Raises
    ------
    ValueError
        The schema, expression or grammar is invalid; the message names the field and llguidance's reason.
    """
    if kind == "json_schema":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(source, overrides=JSON_OPTIONS)
    elif kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(source)
    elif kind == "grammar":
        lark = source
        if not is_lark_syntax(source):  # Lark has a "start:" rule (or %llguidance); anything else is read as GBNF
            try:
                lark = gbnf_to_lark(source)
            except Exception as err:  # noqa: BLE001  the converter raises plain exceptions on bad GBNF
                raise ValueError(f"grammar: neither Lark (no 'start:' rule) nor valid GBNF (llama.cpp's "
                                 f"'root ::= ...'): {err}") from None
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    else:
        raise ValueError(f"structured output: unknown constraint kind {kind!r}; expected json_schema, json_object, "
                         "regex or grammar")
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"{kind}: invalid {_WHAT[kind]}: {messages[0] if messages else 'rejected'}")
    return grammar


_WHAT = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression",
         "grammar": "grammar (Lark or GBNF)"}


def schema_text(schema: Any) -> str:
    """A JSON schema (dict, bool or JSON text) as canonical JSON text: the cache key of its grammar.

    Raises
    ------
    ValueError
        ``schema`` is not JSON (or not JSON text), or not an object / boolean schema.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"json_schema: not valid JSON text ({err}); pass a dict or a JSON object string") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"json_schema: a schema is a JSON object (or true/false), got {type(schema).__name__}")
    try:
        return json.dumps(schema, sort_keys=True, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"json_schema: not JSON-serializable ({err})") from None
