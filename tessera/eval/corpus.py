"""Texts to measure perplexity on: a file read the way ``llama-perplexity -f`` reads it, and a real English corpus
that ships with every Python install (``pydoc_data.topics``, the text of ``help()``'s topics).

Both tools must see the same bytes for their figures to compare, so :func:`write_corpus` stores the pydoc corpus as
a UTF-8 file that ``llama-perplexity -f`` and ``tessera perplexity`` then both read. The corpus depends on the
Python version (its help text changes between releases): :func:`corpus_fingerprint` says which one a figure used.
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

#: names accepted by ``tessera perplexity --corpus``
CORPORA = ("pydoc",)


def pydoc_corpus() -> str:
    """The standard library's help topics (``pydoc_data.topics.topics``) as one text.

    Returns
    -------
    str
        Every topic's text in the order of the topic names, separated by one blank line, with no trailing newline
        (so that a file holding it reads back unchanged through :func:`read_text`, which drops one trailing newline
        as llama.cpp does).
    """
    from pydoc_data.topics import topics  # a ~0.5 MB module: imported only when the corpus is asked for

    return "\n\n".join(topics[name].strip("\n") for name in sorted(topics))


def corpus_text(name: str) -> str:
    """The text of the corpus ``name`` (one of :data:`CORPORA`)."""
    if name == "pydoc":
        return pydoc_corpus()
    raise ValueError(f"unknown corpus {name!r}; choose one of {list(CORPORA)}")


def write_corpus(text: str, path: str | Path) -> Path:
    """Write ``text`` to ``path`` as UTF-8 bytes, exactly (no newline translation, nothing appended).

    Returns
    -------
    Path
        ``path``.
    """
    path = Path(path)
    path.write_bytes(text.encode("utf-8"))
    return path


def read_text(path: str | Path) -> str:
    """A text file as ``llama-perplexity -f`` reads it: its bytes decoded as UTF-8, one trailing newline dropped.

    Raises
    ------
    FileNotFoundError
        When ``path`` is missing.
    ValueError
        When the file is not UTF-8 (the tokenizers work on Unicode text, and llama.cpp's on UTF-8 bytes).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    # llama.cpp's -f handler drops exactly one trailing newline; the scored tokens only match with the same text
    return text[:-1] if text.endswith("\n") else text


def corpus_fingerprint(text: str) -> dict[str, object]:
    """What identifies a text: its UTF-8 size, SHA-256 and the Python version (the pydoc corpus changes with it)."""
    data = text.encode("utf-8")
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "python": platform.python_version()}
