"""The tuning cache: one JSON file per machine, ``$TESSERA_CACHE_DIR/tuning/<digest>.json``.

The file holds a schema version, the full machine fingerprint (:mod:`tessera.tuning.fingerprint`) and, per tunable
and shape class, the chosen value, every candidate's measured time and when it was measured::

    {"schema": 1, "fingerprint": {...},
     "entries": {"quant_gemv_max_m": {"int4": {"chosen": 64, "default": 128, "measured_at": "...", ...}}}}

The shape class ``None`` is stored under the key ``"*"`` (JSON keys are strings).

Reading never raises: a corrupt file, another schema, or a fingerprint that is not this machine's (a home directory
copied from another host, a file renamed by hand) is ignored with one warning naming the file and the reason, and
every lookup falls back to the defaults. Writes go to a temporary file in the same directory and are renamed over the
old one, so a reader never sees half a file; a directory that cannot be written is reported with a warning and the
results stay in memory for this process.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from tessera._atomic import write_text_atomic

#: Bump when the meaning of a stored field changes; files of another schema are ignored (and overwritten by tune).
SCHEMA = 1
#: the JSON key of the shape class ``None``
ANY_CLASS = "*"

Entries = dict[str, dict[str, dict[str, Any]]]


def cache_dir() -> Path:
    """``$TESSERA_CACHE_DIR/tuning``, by default ``~/.cache/tessera/tuning`` (next to Numba's ``numba/``)."""
    root = os.environ.get("TESSERA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tessera")
    return Path(root) / "tuning"


def cache_path(machine_digest: str) -> Path:
    """The cache file of the machine whose fingerprint digest is ``machine_digest``."""
    return cache_dir() / f"{machine_digest}.json"


def class_key(shape_class: str | None) -> str:
    """The JSON key of a shape class."""
    return ANY_CLASS if shape_class is None else shape_class


def load(path: Path, fingerprint: dict[str, Any]) -> Entries:
    """The entries of ``path`` if it is a valid cache for the machine ``fingerprint``, else ``{}``.

    A missing file is silent (nothing tuned yet); any other problem warns once per call, naming the file and why.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):  # nothing tuned yet (or no cache directory at all)
        return {}
    except OSError as err:
        _warn(path, f"it cannot be read ({err})")
        return {}
    try:
        data = json.loads(text)
    except ValueError as err:
        _warn(path, f"it is not valid JSON ({err})")
        return {}
    if not isinstance(data, dict):
        _warn(path, f"it holds a JSON {type(data).__name__}, not an object")
        return {}
    if data.get("schema") != SCHEMA:
        _warn(path, f"its schema is {data.get('schema')!r}, this tessera reads schema {SCHEMA}")
        return {}
    if data.get("fingerprint") != fingerprint:
        _warn(path, f"it was measured on another machine ({_describe(data.get('fingerprint'), fingerprint)})")
        return {}
    entries = data.get("entries")
    if not isinstance(entries, dict) or not all(
            isinstance(classes, dict) and all(isinstance(e, dict) for e in classes.values())
            for classes in entries.values()):
        _warn(path, "its 'entries' are not a mapping of tunable -> shape class -> entry")
        return {}
    return entries


def save(path: Path, fingerprint: dict[str, Any], entries: Entries) -> bool:
    """Write ``entries`` (replacing the file's, see :func:`merged`) atomically; False with a warning on failure."""
    text = json.dumps({"schema": SCHEMA, "fingerprint": fingerprint, "entries": entries}, indent=2,
                      sort_keys=True) + "\n"
    try:
        write_text_atomic(path, text)
    except OSError as err:
        warnings.warn(f"could not write the tuning cache {path} ({err}); the tuned values apply to this process "
                      "only. Set TESSERA_CACHE_DIR to a writable directory to keep them", RuntimeWarning,
                      stacklevel=3)
        return False
    return True


def merged(path: Path, fingerprint: dict[str, Any], new: Entries) -> Entries:
    """The file's current entries with ``new`` laid over them (per tunable and shape class), read without warnings:
    a file that would be ignored on reading is replaced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        entries = load(path, fingerprint)
    for name, classes in new.items():
        entries.setdefault(name, {}).update(classes)
    return entries


def clear(path: Path) -> bool:
    """Delete ``path``; True if there was a file."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def _describe(theirs: Any, ours: dict[str, Any]) -> str:
    """Which fingerprint fields differ, with both values (shortened)."""
    if not isinstance(theirs, dict):
        return f"it has no valid fingerprint: {theirs!r}"[:160]
    diff = [f"{key}: {theirs.get(key)!r} there, {ours.get(key)!r} here" for key in sorted(set(theirs) | set(ours))
            if theirs.get(key) != ours.get(key)]
    return "; ".join(diff)[:400]


def _warn(path: Path, why: str) -> None:
    warnings.warn(f"ignoring the tuning cache {path}: {why}. Defaults apply; `tessera tune` re-measures",
                  RuntimeWarning, stacklevel=4)
