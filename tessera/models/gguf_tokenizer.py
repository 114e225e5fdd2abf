"""The tokenizer a GGUF file describes, rebuilt as a ``tokenizers.Tokenizer`` from its ``tokenizer.ggml.*`` keys.

A GGUF file has no ``tokenizer.json``: it stores the vocabulary, the merges, each token's type and the special token
ids under llama.cpp's key names. This module writes the equivalent ``tokenizer.json`` document and loads it, so that
encoding gives the ids llama.cpp and Hugging Face's GGUF loader give, for

* byte-level BPE (``tokenizer.ggml.model = "gpt2"``: GPT-2, SmolLM, Llama 3, Qwen2, ...): the file's merges;
* SentencePiece BPE (``"llama"``: Llama 1/2, Mistral, Gemma, Phi-3, ...): llama.cpp merges the adjacent pair whose
  joined text is the vocabulary entry of highest score, so the merges are every split of a vocabulary entry into
  two entries, ranked by the entry's score (ties: earlier entry first); spaces are spelled "▁", one is prepended
  to the input and after each control or user-defined token when ``tokenizer.ggml.add_space_prefix`` says so
  (default: yes; Gemma files say no), and characters outside the vocabulary fall back to the ``<0xXX>`` byte
  tokens.

Other tokenizer models (``"t5"`` unigram, ``"bert"``, ``"rwkv"``, ...) raise :class:`UnsupportedTokenizer`.

>>> tok = build_tokenizer(metadata)            # metadata: GGUF key -> value, see gguf.read_metadata
>>> tok.encode("Hello world").ids
[19556, 905]
"""

from __future__ import annotations

import json
import re
import warnings
from functools import lru_cache
from typing import Any

import numpy as np
from tokenizers import Tokenizer

#: llama.cpp's token types (``llama_token_type``); control and user-defined tokens are matched whole in the text
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"  # SentencePiece's spelling of a space

# Pre-tokenizer split patterns, keyed by ``tokenizer.ggml.pre`` (the vocabulary's training-time split; llama.cpp
# keeps the same table). Keys not listed here use GPT-2's own pattern, which ByteLevel applies itself.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# Vocabularies trained on single digits: every digit is its own pre-token before GPT-2's split.
_DIGIT_SPLIT = ("smollm", "starcoder", "refact")
_GPT2_DEFAULT = ("default", "gpt2", "gpt-2", "") + _DIGIT_SPLIT


class UnsupportedTokenizer(ValueError):
    """The file's tokenizer model (``tokenizer.ggml.model``) is one this module cannot rebuild."""


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE vocabularies spell every byte with one of these).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are shifted to the code
    points from 256 upwards, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return mapping


@lru_cache(maxsize=1)
def _outside_alphabet() -> re.Pattern[str]:
    """Matches a character that is not one of the 256 byte-alphabet letters."""
    return re.compile("[^" + "".join(re.escape(ch) for ch in byte_alphabet().values()) + "]")


def byte_level_spelling(token: str) -> str:
    """``token`` as a byte-level vocabulary spells it: unchanged when already spelled so, else its UTF-8 bytes.

    Some converters store a few tokens as plain text ("<think>" with a real space, say); the model's BPE only
    ever produces byte-alphabet strings, so those entries are respelled to be reachable.
    """
    if _outside_alphabet().search(token) is None:
        return token
    alphabet = byte_alphabet()
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` of a GGUF file's metadata.

    Parameters
    ----------
    meta : dict
        GGUF key -> value; needs ``tokenizer.ggml.model``, ``.tokens`` and ``.merges``, reads ``.token_type``,
        ``.pre``, ``.bos_token_id``, ``.eos_token_id``, ``.add_bos_token``, ``.add_eos_token``.

    Returns
    -------
    tokenizers.Tokenizer
        Byte-level BPE with the file's vocabulary and merges; control tokens (type 3) are special added tokens and
        user-defined ones (type 4) plain added tokens, both matched whole in the text, under their own ids. BOS/EOS
        are prepended/appended only when the file's ``add_bos_token``/``add_eos_token`` flag says so.

    Raises
    ------
    UnsupportedTokenizer
        When the file has no tokenizer or one other than byte-level BPE (``"gpt2"``).
    """
    tokenizer, notes = build_tokenizer_quietly(meta)
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return tokenizer


def build_tokenizer_quietly(meta: dict[str, Any]) -> tuple[Tokenizer, list[str]]:
    """:func:`build_tokenizer`, returning what it would warn about instead of warning: for a caller that builds the
    tokenizer on another thread (``warnings`` filters are process-wide, and a warning raised there would point into
    the thread pool) and warns on its own thread."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise UnsupportedTokenizer(f"GGUF tokenizer model {kind!r} cannot be rebuilt; supported: ['gpt2'] "
                                   "(byte-level BPE), ['llama'] (SentencePiece BPE). Encode text elsewhere and pass "
                                   "token ids")
    needs = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") if kind == "gpt2" else (
        "tokenizer.ggml.tokens", "tokenizer.ggml.scores")
    for key in needs:
        if key not in meta:
            raise UnsupportedTokenizer(f"GGUF {kind} tokenizer lacks {key!r}; the file is incomplete")
    notes: list[str] = []
    document = tokenizer_document(meta, notes) if kind == "gpt2" else sentencepiece_document(meta)
    return Tokenizer.from_str(json.dumps(document)), notes


def tokenizer_document(meta: dict[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
    """The ``tokenizer.json`` document (as a dict) equivalent to the file's byte-level BPE tokenizer; what deserves a
    warning (an unknown pre-tokenizer) is appended to ``notes``, or warned when ``notes`` is None."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {byte_level_spelling(token): index for index, token in enumerate(tokens)}
    added = [{"id": index, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind == CONTROL}
             for index, (token, kind) in enumerate(zip(tokens, types)) if kind in (CONTROL, USER_DEFINED)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")), notes),
        "post_processor": _post_processor(meta, tokens),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": _merges(meta["tokenizer.ggml.merges"])},
    }


def sentencepiece_document(meta: dict[str, Any]) -> dict[str, Any]:
    """The ``tokenizer.json`` document of a SentencePiece BPE vocabulary (``tokenizer.ggml.model = "llama"``)."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    scores = np.asarray(meta["tokenizer.ggml.scores"], dtype=np.float64)
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if not (len(scores) == len(types) == len(tokens)):
        raise ValueError(f"GGUF SentencePiece vocabulary: {len(tokens)} tokens, {len(scores)} scores and "
                         f"{len(types)} token types; the file is malformed")
    # a vocabulary entry of spaces is sometimes stored with real spaces (Gemma); the model only sees "▁"
    spelled = [_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab: dict[str, int] = {}
    for index, token in enumerate(spelled):
        vocab.setdefault(token, index)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", next((i for i, k in enumerate(types) if k == UNKNOWN), None))
    added = [{"id": index, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind == CONTROL}
             for index, (token, kind) in enumerate(zip(tokens, types)) if kind in (CONTROL, USER_DEFINED)]
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    decoders: list[dict[str, Any]] = [{"type": "Replace", "pattern": {"String": _SPACE}, "content": " "},
                                      {"type": "ByteFallback"}, {"type": "Fuse"}]
    if prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        # llama.cpp puts a space before every stretch of text that starts the input or follows a control or
        # user-defined token, even one that starts with a space (as SentencePiece does): a normalizer, which runs on
        # each stretch between added tokens, not Metaspace, which adds it once and only before a non-space
        "normalizer": {"type": "Sequence", "normalizers": [
            *([{"type": "Prepend", "prepend": _SPACE}] if prefix else []),
            {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}]},
        "pre_tokenizer": None,
        # SentencePiece vocabularies add BOS unless the file says otherwise (llama.cpp's default for them)
        "post_processor": _post_processor({"tokenizer.ggml.add_bos_token": True, **meta}, tokens),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": None if unk_id is None else tokens[int(unk_id)],
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab,
                  "merges": _merges_from_scores(spelled, scores, types, vocab)},
    }


def _merges_from_scores(tokens: list[str], scores: np.ndarray, types: list[int],
                        vocab: dict[str, int]) -> list[list[str]]:
    """Every split of a normal vocabulary entry into two entries, as BPE merges ranked by the entry's score.

    Ranking by the joined entry's score makes the BPE model apply, at each step, the adjacent pair llama.cpp's
    SentencePiece tokenizer applies (the one whose joined text scores highest).
    """
    mergeable = {t for t, k in zip(tokens, types) if k in (NORMAL, USER_DEFINED, UNUSED)}
    ranked: list[tuple[float, int, int, list[str]]] = []
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if kind != NORMAL or len(token) < 2 or vocab.get(token) != index:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-float(scores[index]), index, vocab[left], [left, right]))
    ranked.sort(key=lambda r: r[:3])
    return [merge for *_, merge in ranked]  # pairs, not "a b" strings: an entry may hold a space


def _merges(merges: list[str]) -> list[str]:
    """The file's merges, checked: byte-level tokens spell a space as "Ġ", so one real space separates each pair.
    They stay "a b" strings, the form ``tokenizers`` parses fastest (no list per merge)."""
    bad = next((m for m in merges if m.count(" ") != 1), None)
    if bad is not None:
        raise ValueError(f"GGUF merge {bad!r} is not two tokens separated by one space; the file is malformed")
    return merges


def _pre_tokenizer(pre: str, notes: list[str] | None) -> dict[str, Any]:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre in _SPLITS:
        split = {"type": "Split", "pattern": {"Regex": _SPLITS[pre]}, "behavior": "Isolated", "invert": False}
        return {"type": "Sequence", "pretokenizers": [split, {**byte_level, "use_regex": False}]}
    if pre not in _GPT2_DEFAULT:
        note = (f"GGUF pre-tokenizer {pre!r} is not known to Tessera; splitting text with GPT-2's pattern "
                f"(known: {sorted(set(_SPLITS) | set(_GPT2_DEFAULT) - {''})}). Ids may differ from llama.cpp's")
        if notes is None:
            warnings.warn(note, stacklevel=3)
        else:
            notes.append(note)
    if pre in _DIGIT_SPLIT:
        return {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    return byte_level


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> dict[str, Any]:
    """A template adding BOS / EOS exactly when the file's flags ask for them (byte-level files usually don't)."""
    single: list[dict] = [{"Sequence": {"id": "A", "type_id": 0}}]
    pair: list[dict] = [{"Sequence": {"id": "B", "type_id": 1}}]
    special: dict[str, dict] = {}
    for flag, key, at_start in (("add_bos_token", "bos_token_id", True), ("add_eos_token", "eos_token_id", False)):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if not meta.get(f"tokenizer.ggml.{flag}") or token_id is None:
            continue
        text = tokens[int(token_id)]
        special[text] = {"id": text, "ids": [int(token_id)], "tokens": [text]}
        mark_a, mark_b = ({"SpecialToken": {"id": text, "type_id": t}} for t in (0, 1))
        single = [mark_a, *single] if at_start else [*single, mark_a]
        pair = [mark_b, *pair] if at_start else [*pair, mark_b]
    return {"type": "TemplateProcessing", "single": single, "pair": single + pair, "special_tokens": special}


def gguf_tokenizer_keys(document: dict[str, Any]) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` keys of a byte-level BPE ``tokenizer.json`` document: what a GGUF file written from a
    Hugging Face checkpoint carries, so :func:`build_tokenizer` rebuilds the same tokenizer from it.

    ``tokenizer.ggml.pre`` is the name of the known split pattern the document's pre-tokenizer uses (``smollm`` for
    single digits before GPT-2's pattern, ``default`` for GPT-2's own); :class:`UnsupportedTokenizer` for other
    tokenizer models or a pre-tokenizer this module has no name for.
    """
    model = document.get("model") or {}
    if model.get("type") != "BPE" or _pre_name(document.get("pre_tokenizer")) is None:
        raise UnsupportedTokenizer(f"only byte-level BPE tokenizer.json files with a known split pattern can be "
                                   f"written to GGUF (model {model.get('type')!r}); the file is written without one")
    vocab: dict[str, int] = dict(model["vocab"])
    kinds = {}
    for added in document.get("added_tokens") or ():
        vocab[added["content"]] = added["id"]
        kinds[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    size = max(vocab.values()) + 1
    tokens = [""] * size
    for token, index in vocab.items():
        tokens[index] = token
    missing = [i for i, t in enumerate(tokens) if not t]
    if missing:
        raise UnsupportedTokenizer(f"tokenizer.json has no token for ids {missing[:5]}; GGUF needs every id below "
                                   f"{size}")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or ()]
    keys: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": _pre_name(document.get("pre_tokenizer")),
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [kinds.get(i, NORMAL) for i in range(size)],
        "tokenizer.ggml.merges": merges,
    }
    post = document.get("post_processor") or {}
    single = post.get("single") or []
    for at, flag, key in ((0, "add_bos_token", "bos_token_id"), (-1, "add_eos_token", "eos_token_id")):
        mark = single[at].get("SpecialToken") if single else None
        if mark is not None and mark.get("id") in vocab:  # the template adds this token: say so, and which it is
            keys[f"tokenizer.ggml.{flag}"] = True
            keys[f"tokenizer.ggml.{key}"] = vocab[mark["id"]]
    return keys


def _pre_name(pre: dict[str, Any] | None) -> str | None:
    """Our name of a byte-level pre-tokenizer (the inverse of :func:`_pre_tokenizer`), or None."""
    if not pre:
        return None
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "default"
    steps = pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else []
    kinds = [p.get("type") for p in steps]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"]:
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        return next((name for name, split in _SPLITS.items() if split == pattern), None)
    return None
