"""Each token's bytes: what a grammar engine needs to know of a tokenizer to say which tokens may come next.

A grammar constrains bytes, a model emits token ids, so the mask of allowed tokens is computed over the bytes every
token id decodes to on its own. ``tokenizers`` does not expose that directly: byte-level BPE vocabularies (GPT-2,
SmolLM, Llama 3, Qwen) spell each byte with a printable character, SentencePiece vocabularies spell a space "▁"
and keep raw bytes as ``<0xXX>`` tokens, and word-level vocabularies (the tests' character tokenizer) hold the text
itself. Which spelling a tokenizer uses is read from its decoder.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tessera.models.gguf_tokenizer import byte_alphabet

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE = "\u2581"  # SentencePiece's spelling of a space


@dataclass(frozen=True, slots=True)
class TokenBytes:
    """A tokenizer's vocabulary as bytes.

    Attributes
    ----------
    tokens : ``tokens[i]`` is the bytes token ``i`` stands for (``b""`` for special tokens, which no grammar
        produces).
    special : the special (control) tokens, id -> text (``<|im_end|>``, ``</s>``, ...); never part of a grammar's
        text, though a grammar engine may end generation with one.
    """

    tokens: list[bytes]
    special: dict[int, str]


def _decoder_kind(document: dict[str, Any]) -> str:
    """"byte_level", "sentencepiece" or "text", from a ``tokenizer.json`` document's decoder."""
    decoder = document.get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        return "sentencepiece"
    return "text"


def token_bytes(tokenizer: Any) -> TokenBytes:
    """The bytes of every token of ``tokenizer`` (a ``tokenizers.Tokenizer``), in id order.

    Parameters
    ----------
    tokenizer : tokenizers.Tokenizer
        The model's tokenizer (``Model.tokenizer``).

    Returns
    -------
    TokenBytes

    Raises
    ------
    TypeError
        ``tokenizer`` is not a ``tokenizers.Tokenizer`` (it has no ``to_str`` / ``get_vocab``).
    """
    if not (hasattr(tokenizer, "to_str") and hasattr(tokenizer, "get_vocab")):
        raise TypeError(f"token_bytes: need a tokenizers.Tokenizer, got {type(tokenizer).__name__}; structured "
                        "output needs the model's tokenizer")
    document = json.loads(tokenizer.to_str())
    kind = _decoder_kind(document)
    special = {int(a["id"]): str(a["content"]) for a in document.get("added_tokens") or [] if a.get("special")}
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    size = max(vocab.values(), default=-1) + 1
    tokens = [b""] * size
    unbyte = {ch: b for b, ch in byte_alphabet().items()}
    for text, index in vocab.items():
        if index in special:
            continue
        if kind == "byte_level":
            # added tokens written as plain text (outside the byte alphabet) stand for their UTF-8 bytes
            tokens[index] = (bytes(unbyte[ch] for ch in text) if all(ch in unbyte for ch in text)
                             else text.encode("utf-8"))
        elif kind == "sentencepiece":
            match = _BYTE_TOKEN.fullmatch(text)
            tokens[index] = bytes([int(match.group(1), 16)]) if match else text.replace(_SPACE, " ").encode("utf-8")
        else:
            tokens[index] = text.encode("utf-8")
    return TokenBytes(tokens, special)
