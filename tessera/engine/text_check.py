"""Text that cannot be tokenized: lone UTF-16 surrogates, found before the tokenizer fails without saying why."""

from __future__ import annotations


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate (U+D800..U+DFFF) in ``text``, or None when it is valid Unicode text.

    JSON can spell such a code point (``"\\ud800"`` without its pair) and Python's ``json`` decodes it into a ``str``,
    but it is not a character: UTF-8 cannot encode it and tokenizers reject it with a message that names no field
    ("TextInputSequence must be str").
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def surrogate_message(text: str, where: str) -> str | None:
    """An error message for the first lone surrogate in ``text`` (``where`` names the text), or None when valid."""
    at = lone_surrogate(text)
    if at is None:
        return None
    return (f"{where} holds a lone UTF-16 surrogate U+{ord(text[at]):04X} at character {at}, which is not a "
            "character (a \\uD800-\\uDFFF escape must be one half of a high/low pair); remove it or send the whole "
            "pair")
